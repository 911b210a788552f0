"""The precision of the KVCMAS correction's products on real caches, side by side: float32 products
on float16 factors against bfloat16 products on bfloat16 factors (the defaults where bfloat16 is
native, ``--kvshare-anchor-compute-dtype auto``). Agent 0 -> agent 1 of the MMLU roles over 2K
contexts built like the serving benchmark's (``benchmarks.serving.workload.make_context``); the anchors are
the first N contexts' observations, the corrected segment is context N+1's; every gate open
(tau 1). Reports the time of ``correct()`` (median of 3), the gate entropy, the corrected cache's
error against the dense target, and the difference between the two corrected caches. HF
transformers on the default model, float32, no server.

    python -m benchmarks.correction_precision [N_ANCHORS] [TOKENS]
"""

import json
import statistics
import sys
import time

import torch
from tqdm import tqdm

from benchmarks.reference_error import HFModel, err
from benchmarks.serving.workload import make_context
from sglang_kvshare.correction import create_corrector
from sglang_kvshare.workflows import get_roles

SETTINGS = {
    "float16 factors, float32 products": (torch.float16, torch.float32),
    "bfloat16 factors, bfloat16 products": (torch.bfloat16, torch.bfloat16),
}


def main():
    n_anchors = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    hf = HFModel()
    roles = get_roles("mmlu").roles
    pairs = []
    for i in tqdm(range(n_anchors + 1), desc="dense caches"):
        ids = hf.enc(make_context(hf.tok, tokens, f"precision{i}"))[:tokens]
        pairs.append((hf.segment_kv(hf.system_ids(roles[0]), ids), hf.segment_kv(hf.system_ids(roles[1]), ids)))
    source, target = pairs[-1]
    rows, corrected = {}, {}
    for name, (factor_dtype, compute_dtype) in SETTINGS.items():
        c = create_corrector("kvcmas", factor_dtype=factor_dtype, compute_dtype=compute_dtype)
        for s, t in pairs[:-1]:
            c.observe("q", "a0", "a1", s, t)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            r = c.correct("q", "a0", "a1", source, tau=1.0)
            times.append(time.perf_counter() - t0)
        corrected[name] = r.kv
        rows[name] = {"correct_s": statistics.median(times), "entropy": r.entropy, "err_vs_dense": err(r.kv, target)}
    a, b = corrected.values()
    out = {
        "anchors": n_anchors,
        "tokens": tokens,
        "uncorrected_err_vs_dense": err(source, target),
        "settings": rows,
        "corrected_rel_diff": err(b, a),
    }
    print(json.dumps(out, indent=1))
    print("\n| setting | correct() s | entropy | err vs dense |\n|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['correct_s']:.3f} | {r['entropy']:.4f} | {r['err_vs_dense']:.4f} |")
    print(f"| uncorrected | - | - | {out['uncorrected_err_vs_dense']:.4f} |")
    print(f"\ncorrected caches differ by {out['corrected_rel_diff']:.2e} (relative)")


if __name__ == "__main__":
    main()
