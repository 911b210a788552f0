"""Should an accepted KVCMAS correction be stored as a low-rank leaf on the source's KV (issue 30)?

A later agent that attends the source's K/V in place (one copy of the shared context) can keep
its correction only as something small beside it: a leaf of rank r per layer, as PReCache keeps
its LR caches. This measures, on agent 1's question slot over MMLU tasks (the setting of
``benchmarks.reference_error``: HF transformers, float32, anchors = the other tasks'
observations, up to 10, every gate open), what such a leaf would keep:

- the effective rank of the applied delta (eq. 8; a token-weighted mix of up to 10 rank-32
  anchor deltas, so its rank is not bounded by 32): singular values holding 90 / 99 % of its
  energy, per layer, mean over layers and tasks, keys and values;
- the relative KV error against the exact cache of the source + a rank-r leaf (the delta
  re-compressed by truncated SVD, ``lowrank.factorize``), r = 8 / 16 / 32 / 64, beside the full
  correction and uncorrected reuse (fullshared), and the share of the correction's gain it keeps:
  (err_fullshared - err_leaf) / (err_fullshared - err_correction);
- the key delta in the frames a view could keep it in: the source's (a view keeps keys at the
  source's positions s0 + t: every row turned by the same s0, an orthogonal map, so rank and
  error should equal the canonical ones; measured as a check) and before RoPE (row t turned
  back by its own position t, the form a leaf rotated per key on use would store);
- the re-compression time per segment (all layers, keys and values), and the bytes of a leaf
  per agent against a copy of the segment.

With ``--context-tokens N`` the shared segment is instead an N-token context of the serving
benchmark (``serving.make_context``, distinct per task), agents 0 and 1 of the MMLU roles.

    python -m benchmarks.leaf_study [N_TASKS]     # tables on stdout; --json PATH to keep them
"""

import argparse
import json
import time

import torch

from benchmarks.datasets import load_tasks
from benchmarks.reference_error import HFModel, err
from sglang_kvshare.correction import SegmentKV
from sglang_kvshare.correction.kvcmas import KVCMASCorrector
from sglang_kvshare.lowrank import factorize
from sglang_kvshare.rope.align import shift_keys
from sglang_kvshare.workflows import get_roles

RANKS = (8, 16, 32, 64)
FRAMES = ("keys in the source frame", "keys before RoPE")


def effective_rank(Z: torch.Tensor, energy: float) -> float:
    """Mean over layers of the fewest singular values holding ``energy`` of ||Z[l]||_F^2."""
    s2 = torch.linalg.svdvals(Z.float()).square()  # [layers, min(L, D)]
    frac = s2.cumsum(-1) / s2.sum(-1, keepdim=True).clamp_min(1e-30)
    return float(((frac < energy).sum(-1) + 1).float().mean())


def leaf(Z: torch.Tensor, rank: int) -> torch.Tensor:
    """Z [layers, L, D] through a rank-``rank`` truncated SVD (``lowrank.factorize``)."""
    return factorize(Z, rank, torch.float32).reconstruct()


def rotate(k: torch.Tensor, shift, rope) -> torch.Tensor:
    """Keys [layers, L, H*D] turned by RoPE ``shift`` positions further (an int, or [L] per row)."""
    n_layers, L, width = k.shape
    return torch.stack(
        [shift_keys(k[i].reshape(L, -1, rope.rotary_dim), shift, rope).reshape(L, width) for i in range(n_layers)]
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n_tasks", nargs="?", type=int, default=12)
    ap.add_argument(
        "--context-tokens",
        type=int,
        default=None,
        help="shared segments of this many tokens (serving contexts) instead of MMLU questions",
    )
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    hf = HFModel()
    roles = get_roles("mmlu").roles
    tasks = load_tasks("mmlu", args.n_tasks, seed=5)
    data = []
    for t in tasks:
        if args.context_tokens:
            from benchmarks.serving.workload import make_context

            q = hf.enc(make_context(hf.tok, args.context_tokens, t.id))
        else:
            q = hf.enc(t.question)
        p0 = hf.system_ids(roles[0])
        data.append((hf.segment_kv(p0, q), hf.segment_kv(hf.system_ids(roles[1]), q), len(p0)))
        print(t.id, len(q), flush=True)
    rows = {"fullshared": [], "correction": []}
    rows.update({f"leaf r={r}": [] for r in RANKS})
    rows.update({f"leaf r={r}, {frame}": [] for frame in FRAMES for r in RANKS})
    ranks = {name: {0.9: [], 0.99: []} for name in ("delta k", "delta v", *(f"delta k, {f}" for f in FRAMES))}
    seconds = {r: [] for r in RANKS}
    seg_rows, widths = [], None
    for i, (c0, c1, s0) in enumerate(data):
        ch = KVCMASCorrector()
        for o0, o1, _ in [d for j, d in enumerate(data) if j != i][:10]:
            ch.observe("q", "a0", "a1", o0, o1)
        r = ch.correct("q", "a0", "a1", c0, tau=1.0)
        if not r.accepted:
            continue
        n = r.corrected_len
        seg_rows.append(c0.seq_len)
        widths = (c0.num_layers, c0.dim)
        dk, dv = r.delta.k, r.delta.v  # [layers, n, D], canonical
        rows["fullshared"].append(err(c0, c1))
        rows["correction"].append(err(r.kv, c1))
        back = -torch.arange(n)
        frames = {
            "keys in the source frame": (rotate(dk, s0, hf.rope), -s0),  # row t at position s0 + t
            "keys before RoPE": (rotate(dk, back, hf.rope), -back),
        }  # row t turned back by t
        named = {"delta k": dk, "delta v": dv, **{f"delta k, {f}": Z for f, (Z, _) in frames.items()}}
        for name, Z in named.items():
            for e in (0.9, 0.99):
                ranks[name][e].append(effective_rank(Z, e))

        def with_delta(lk, lv):
            k, v = c0.k.clone(), c0.v.clone()
            k[:, :n] += lk
            v[:, :n] += lv
            return SegmentKV(k, v)

        for rank in RANKS:
            t0 = time.perf_counter()
            lk, lv = leaf(dk, rank), leaf(dv, rank)
            seconds[rank].append(time.perf_counter() - t0)
            rows[f"leaf r={rank}"].append(err(with_delta(lk, lv), c1))
            for frame, (Z, undo) in frames.items():
                rows[f"leaf r={rank}, {frame}"].append(err(with_delta(rotate(leaf(Z, rank), undo, hf.rope), lv), c1))
    mean = lambda xs: float(torch.tensor(xs, dtype=torch.float64).mean())  # noqa: E731
    full, corr = mean(rows["fullshared"]), mean(rows["correction"])
    print(f"\n{len(rows['correction'])} tasks with an accepted correction\n")
    print("| agent 1's question slot | rel. KV error mean | gain kept |\n|---|---:|---:|")
    table = {}
    for k, v in rows.items():
        m = mean(v)
        kept = (full - m) / (full - corr) if full != corr else float("nan")
        table[k] = {"error": m, "gain_kept": kept}
        print(f"| {k} | {m:.4f} | {kept:.2f} |")
    print("\n| matrix | effective rank, 90 % energy | 99 % |\n|---|---:|---:|")
    for k, v in ranks.items():
        print(f"| {k} | {mean(v[0.9]):.1f} | {mean(v[0.99]):.1f} |")
    n_layers, D = widths
    L = mean(seg_rows)
    copy_bytes = 2 * n_layers * L * D * 2  # keys and values, bfloat16
    print(
        "\n| leaf rank | re-compression ms (all layers, k and v) | bytes per agent (bf16) | vs a copy |\n|---:|---:|---:|---:|"
    )
    costs = {}
    for rank in RANKS:
        b = 2 * n_layers * (L * rank + rank * D) * 2
        costs[rank] = {"ms": 1000 * mean(seconds[rank]), "bytes": b, "vs_copy": b / copy_bytes}
        print(f"| {rank} | {costs[rank]['ms']:.1f} | {b / 1e3:.0f} K | {b / copy_bytes:.2f} |")
    print(
        f"\n(segments: {L:.0f} tokens on average, {n_layers} layers, {D} K/V columns; a copy: {copy_bytes / 1e3:.0f} K)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "segments": f"{args.context_tokens}-token contexts" if args.context_tokens else "MMLU questions",
                    "tasks": len(rows["correction"]),
                    "errors": table,
                    "effective_rank": {k: {str(e): mean(v) for e, v in d.items()} for k, d in ranks.items()},
                    "costs": {str(k): v for k, v in costs.items()},
                    "mean_rows": L,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
