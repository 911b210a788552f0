import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KVSHARE_GPU_TESTS") == "1":
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
