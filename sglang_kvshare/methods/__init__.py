"""The sharing methods a request can name, and what each needs from the engine."""

from sglang_kvshare.methods.registry import METHODS, MethodSpec, get_method, method_names, method_variant

__all__ = ["METHODS", "MethodSpec", "get_method", "method_names", "method_variant"]
