"""Injection on SGLang's GPU attention backends (skipped without CUDA; ``scripts/gpu_check.sh``).

The same checks as the CPU tier's exactness tests, on a server whose KV pool and attention run on
CUDA: an agent whose context equals the source's gets the source's cache written into its own
slots (equal to a dense prefill's, up to the backend's float16 arithmetic), and a shifted question
is re-aligned (layer 0 depends on the token alone). On CUDA the correction methods write through
the fused ``kv_correct`` kernel; a kvcmas workflow runs through it too.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.integration.server import kvshare_server
from tests.integration.workflow_helpers import SYSTEM, payload, run_workflow, segments

pytestmark = pytest.mark.gpu

BACKENDS = ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_injection_on_a_gpu_attention_backend(tmp_path, tiny_model, backend):
    from sglang_kvshare.integration.tree import _safe

    dumps = tmp_path / "dumps"
    server = kvshare_server(tiny_model, tmp_path / "server.log", "--attention-backend", backend,
                            "--dtype", "float16", "--kvshare-dump-dir", str(dumps))

    def load(workflow, agent, slot="q"):
        return torch.load(dumps / _safe(workflow) / _safe(agent) / f"{_safe(slot)}.pt", map_location="cpu")

    try:
        for method in ("nonshared", "fullshared"):
            for agent, system in (("solver", SYSTEM["solver"]), ("twin", SYSTEM["solver"]), ("critic", None)):
                r = server.generate(payload(f"gpu-{method}", agent, method,
                                            segments("solver" if system else agent, {}, system), 4))
                assert r.status_code == 200, r.text
                if method == "fullshared" and agent != "solver":
                    q = r.json()["meta_info"]["kvshare"]["segments"][1]
                    assert q["mode"] == "injected" and q["injected_tokens"] == q["tokens"], q
        dense, injected = load("gpu-nonshared", "twin"), load("gpu-fullshared", "twin")
        torch.testing.assert_close(injected["k"], dense["k"], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(injected["v"], dense["v"], atol=2e-2, rtol=2e-2)
        dense, shifted = load("gpu-nonshared", "critic"), load("gpu-fullshared", "critic")
        assert shifted["start"] != load("gpu-fullshared", "solver")["start"]
        torch.testing.assert_close(shifted["k"][0], dense["k"][0], atol=2e-2, rtol=2e-2)
        # the fused correction write (kv_correct) on the CUDA pool
        for r in run_workflow(server, "gpu-kvcmas", "kvcmas"):
            assert r["meta_info"]["kvshare"]["method"] == "kvcmas"
        assert server.proc.poll() is None
    finally:
        server.stop()
