"""Benchmarks of sglang_kvshare on real SGLang servers (run as ``python -m benchmarks.<name>``)."""
