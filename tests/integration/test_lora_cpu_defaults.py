"""LoRA with SGLang's usual flags and no ``--lora-backend``: on the CPU the launcher picks
``torch_native`` (SGLang's default, csgmv, pins host memory and used to kill the scheduler on the
first request), and serves LoRA requests."""

import pytest
import torch

from sglang_kvshare.testing.server import kvshare_server
from sglang_kvshare.testing.tiny_model import build_tiny_adapter

pytestmark = pytest.mark.integration


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU defaults apply without CUDA only")
def test_lora_without_a_backend_flag_serves_on_the_cpu(tmp_path, tiny_model):
    paths = [f"{a}={build_tiny_adapter(tiny_model, tmp_path / a, seed=i + 1)}" for i, a in enumerate("ab")]
    server = kvshare_server(tiny_model, tmp_path / "server.log", "--enable-lora", "--lora-paths", *paths)
    try:
        body = {"text": "Hello, agent.", "lora_path": "b", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        r = server.generate(body)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 4
        assert server.proc.poll() is None
        assert "--lora-backend torch_native" in server.log_path.read_text()
    finally:
        server.stop()
