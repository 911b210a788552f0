"""Injection on SGLang's GPU attention backends, tiny model.

The same checks as the CPU tier's exactness tests, on a server whose attention is one of SGLang's
GPU backends: an agent whose context equals the source's gets the source's cache written into its
own slots (equal to a dense prefill's), and a shifted question is re-aligned (layer 0 depends on
the token alone); a kvcmas workflow runs its corrections too (on CUDA through the fused
``kv_correct`` kernel).

Two tiers: with CUDA, ``triton`` (and ``flashinfer`` when installed) in float16 (marked ``gpu``,
``scripts/gpu_check.sh``); without CUDA, SGLang's ``triton`` backend on the CPU with its Triton
kernels run by the Triton interpreter (``TRITON_INTERPRET=1``), so the Triton code a GPU runs for
attention is exercised here too.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sglang_kvshare.testing.server import kvshare_server
from sglang_kvshare.testing.workflows import SYSTEM, payload, run_workflow, segments

CUDA = torch.cuda.is_available()
GPU_BACKENDS = ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])
TIERS = [
    pytest.param(b, {}, ("--dtype", "float16"), 2e-2, marks=pytest.mark.gpu, id=f"cuda-{b}") for b in GPU_BACKENDS
] + [
    pytest.param(
        "triton",
        {"TRITON_INTERPRET": "1"},
        (),
        1e-4,
        id="cpu-interpreted-triton",
        marks=pytest.mark.skipif(CUDA, reason="the CUDA tier runs the compiled kernels"),
    )
]


@pytest.mark.parametrize("backend,env,flags,tol", TIERS)
def test_injection_on_a_gpu_attention_backend(tmp_path, tiny_model, backend, env, flags, tol):
    from sglang_kvshare.integration.cache.radix import _safe

    dumps = tmp_path / "dumps"
    server = kvshare_server(
        tiny_model,
        tmp_path / "server.log",
        "--attention-backend",
        backend,
        *flags,
        "--kvshare-dump-dir",
        str(dumps),
        env=env,
    )

    def load(workflow, agent, slot="q"):
        return torch.load(dumps / _safe(workflow) / _safe(agent) / f"{_safe(slot)}.pt", map_location="cpu")

    try:
        for method in ("nonshared", "fullshared"):
            for agent, system in (("solver", SYSTEM["solver"]), ("twin", SYSTEM["solver"]), ("critic", None)):
                r = server.generate(
                    payload(f"gpu-{method}", agent, method, segments("solver" if system else agent, {}, system), 4)
                )
                assert r.status_code == 200, r.text
                if method == "fullshared" and agent != "solver":
                    q = r.json()["meta_info"]["kvshare"]["segments"][1]
                    assert q["mode"] == "injected" and q["injected_tokens"] == q["tokens"], q
        dense, injected = load("gpu-nonshared", "twin"), load("gpu-fullshared", "twin")
        torch.testing.assert_close(injected["k"], dense["k"], atol=tol, rtol=tol)
        torch.testing.assert_close(injected["v"], dense["v"], atol=tol, rtol=tol)
        dense, shifted = load("gpu-nonshared", "critic"), load("gpu-fullshared", "critic")
        source = load("gpu-fullshared", "solver")
        assert shifted["start"] != source["start"]
        torch.testing.assert_close(shifted["k"][0], dense["k"][0], atol=tol, rtol=tol)
        assert (source["k"][0] - dense["k"][0]).abs().max() > 10 * tol  # the rotation did something
        for r in run_workflow(server, "gpu-kvcmas", "kvcmas"):
            assert r["meta_info"]["kvshare"]["method"] == "kvcmas"
        assert server.proc.poll() is None
    finally:
        server.stop()
