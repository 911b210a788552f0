import os

import pytest

# Triton reads TRITON_INTERPRET when it is first imported, and SGLang (imported by integration
# tests) imports it: switch the interpreter on before anything does, so the kernel tests can run
# their Triton kernels on the CPU. Servers started by the tests do not inherit it (server.py).
import torch  # noqa: E402  (does not import triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
