"""Import-time workarounds that let the pinned SGLang run on a machine without CUDA.

``scripts/setup.sh`` installs a ``.pth`` file that calls :func:`install` in every interpreter of
the virtual environment, and only on machines without CUDA. Nothing here imports SGLang.

- torchvision from PyPI is a CUDA build: its ``_meta_registrations`` registers fake kernels for
  ops that do not exist, and ``import torchvision`` fails. The registrations are skipped when
  ``torchvision.extension._has_ops()`` is False.
- ``SGLANG_USE_CPU_ENGINE=1`` selects SGLang's CPU code paths, which import names from
  ``sgl_kernel`` (a CUDA-only wheel) that are never called on a CPU without AMX. A stub module
  that raises on any call stands in when the real one is absent.

Not installed by the ``.pth`` file: :func:`keep_freed_memory`, which the plugin calls in the
scheduler process (``--kvshare-keep-freed-memory``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

_STUB_NAME = "sgl_kernel"


class _TorchvisionMetaLoader(importlib.abc.Loader):
    def __init__(self, wrapped: importlib.abc.Loader):
        self._wrapped = wrapped

    def create_module(self, spec):
        return self._wrapped.create_module(spec)

    def exec_module(self, module):
        import torch
        import torchvision.extension

        if torchvision.extension._has_ops():
            return self._wrapped.exec_module(module)
        original = torch.library.register_fake
        torch.library.register_fake = lambda *a, **k: lambda fn: fn
        try:
            self._wrapped.exec_module(module)
        finally:
            torch.library.register_fake = original


def _stub_call(name: str):
    def call(*args, **kwargs):
        raise RuntimeError(
            f"sgl_kernel.{name} was called, but this machine has no CUDA and only a stub "
            "sgl_kernel is installed; this code path is not supported on CPU"
        )

    call.__name__ = name
    return call


def _stub_attr(attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _stub_call(attr)


class _StubKernelLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        # NOTE: not a package: "sgl_kernel.<submodule>" must raise ImportError, which SGLang
        # catches to pick its own CPU fallbacks.
        module.__getattr__ = _stub_attr
        module.__version__ = "0.0.0+kvshare-cpu-stub"
        module.KVSHARE_CPU_STUB = True
        return module

    def exec_module(self, module):
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision._meta_registrations":
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _TorchvisionMetaLoader(spec.loader)
            return spec
        if fullname == _STUB_NAME:
            if importlib.machinery.PathFinder.find_spec(_STUB_NAME) is not None:
                return None  # a real sgl_kernel is installed
            return importlib.util.spec_from_loader(fullname, _StubKernelLoader())
        return None


class _NoPinTorch:
    """``torch`` as seen by one SGLang module, with ``pin_memory=True`` ignored (no CUDA)."""

    def __init__(self, torch_module):
        self._torch = torch_module

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name in ("tensor", "empty", "zeros", "ones", "full", "arange"):

            def unpinned(*args, **kwargs):
                kwargs.pop("pin_memory", None)
                return attr(*args, **kwargs)

            return unpinned
        return attr


LORA_MODULES = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")


def unpin_lora() -> None:
    """SGLang's LoRA layers allocate pinned host tensors, which needs an accelerator: without
    one, pinning is dropped (``Tensor.pin_memory`` returns the tensor itself)."""
    import importlib

    import torch

    if getattr(torch.Tensor.pin_memory, "__name__", "") != "_unpinned":

        def _unpinned(self, *args, **kwargs):
            return self

        torch.Tensor.pin_memory = _unpinned
    for name in LORA_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _NoPinTorch):
            module.torch = _NoPinTorch(torch)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(mmap_threshold: int = 1 << 30, trim_threshold: int = 2 << 30) -> bool:
    """Keep freed memory in this process for reuse: glibc serves allocations up to
    ``mmap_threshold`` bytes from its heap and returns free heap memory to the system only above
    ``trim_threshold``. With glibc's defaults every temporary tensor of a few MB is a fresh
    ``mmap`` that page-faults on first touch, which on a CPU costs as much as the arithmetic of
    the correction's elementwise steps. False (nothing changed) without glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def install() -> None:
    """Activate the workarounds in this interpreter (idempotent)."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
