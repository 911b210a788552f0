"""What the plugin costs traffic that shares nothing: stock SGLang against ``launch_server`` with
default flags, on plain streamed chat requests (no annotation, no header, automatic detection off).

Two servers run side by side on the default model: stock (``SGLANG_PLUGINS=none
python -m sglang.launch_server`` with the tests' CPU flags) and ours (``python -m
sglang_kvshare.launch_server``, no ``--kvshare-*`` flag). An idle server sleeps, so each setting
runs on one server at a time: per mix and concurrency the same distinct prompts go to both, in
alternating order (stock first, then ours first at the next setting), after a warm-up of each.

Mixes: ``prefill`` (``--prefill-tokens`` prompts, 8 output tokens) and ``decode`` (``--decode-prompt``
token prompts, ``--decode-output`` output tokens), every answer ``ignore_eos``. Per setting the
requests are split in two halves: stock then ours on the first, ours then stock on the second (a
drift of the machine's speed cancels). Per setting: output tokens/s (all output tokens / wall
time), TTFT p50 and time per output token p50 over all requests, and their ratios ours / stock.

``--profile S``: during the decode mix at the highest concurrency, py-spy samples each server's
scheduler for S seconds; ``results/overhead_profile.md`` lists the functions whose share of the
samples differs most (inclusive, ours against stock).

    python -m benchmarks.overhead                    # concurrency 1, 4, 16; both mixes
    python -m benchmarks.overhead --quick            # concurrency 1, 4; short prompts

Writes ``results/overhead.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
from tqdm import tqdm

from benchmarks.client import Load, closed_loop, stream_chat
from sglang_kvshare.assets import ensure_default_model
from sglang_kvshare.testing.server import kvshare_server, running, stock_server

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "river stone market lantern copper harvest signal garden ledger orbit meadow engine "
    "canvas thunder harbor pepper violet summit cobalt falcon timber quartz velvet dune"
).split()


@dataclass(frozen=True)
class Mix:
    name: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Row:
    mix: str
    concurrency: int
    requests: int
    stock: dict
    ours: dict

    def ratio(self, key: str) -> float:
        return self.ours[key] / self.stock[key]


def summary(loads: list[Load]) -> dict:
    load = Load.joined(loads)
    return {
        "output_tokens_per_s": load.output_tokens_per_s,
        "ttft_p50_s": load.median("ttft_s"),
        "tpot_p50_s": load.median("tpot_s"),
        "wall_s": load.wall_s,
        "output_tokens": load.output_tokens,
    }


def prompts(tok, n: int, tokens: int, seed: int) -> list[str]:
    """``n`` distinct prompts of about ``tokens`` tokens (random words, numbered sentences)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words, text = [], ""
        while len(tok.encode(text, add_special_tokens=False)) < tokens - 24:
            words += [f"Note {i}.{len(words)}:"] + rng.choices(WORDS, k=11)
            text = " ".join(words)
        out.append(text + "\nSummarise the notes above in one sentence.")
    return out


def bodies(texts: list[str], max_tokens: int) -> list[dict]:
    return [
        {
            "model": "default",
            "messages": [{"role": "user", "content": t}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for t in texts
    ]


def run(args) -> list[Row]:
    from transformers import AutoTokenizer

    model = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(model)
    mixes = [
        m
        for m in (Mix("prefill", args.prefill_tokens, 8), Mix("decode", args.decode_prompt, args.decode_output))
        if m.name in args.mixes
    ]
    settings = [(m, c) for m in mixes for c in args.concurrency]
    rows: list[Row] = []
    samples: dict[str, Counter] = {}
    with (
        tempfile.TemporaryDirectory() as d,
        running(
            lambda: stock_server(model, Path(d) / "stock.log", timeout=900),
            lambda: kvshare_server(model, Path(d) / "ours.log", *args.server_arg, timeout=900),
        ) as (stock, ours),
    ):
        servers = {"stock": stock, "ours": ours}
        for name, server in servers.items():  # warm-up: a request of each mix
            for mix in mixes:
                stream_chat(server.url, bodies(prompts(tok, 1, mix.prompt_tokens, seed=-1), mix.output_tokens)[0])
        for k, (mix, c) in enumerate(tqdm(settings, desc="settings")):
            n = max(args.min_requests, 4 * c)
            batch = bodies(prompts(tok, n, mix.prompt_tokens, seed=k), mix.output_tokens)
            loads: dict[str, list[Load]] = {"stock": [], "ours": []}
            profiled = args.profile and mix.name == "decode" and c == max(args.concurrency)
            for half, order in ((batch[: n // 2], ("stock", "ours")), (batch[n // 2 :], ("ours", "stock"))):
                for name in order:
                    run_load = functools.partial(
                        closed_loop, functools.partial(stream_chat, servers[name].url), half, c
                    )
                    if profiled and name not in samples:  # each server's first half, sampled
                        load, samples[name] = sample_scheduler(servers[name], run_load, args.profile)
                    else:
                        load = run_load()
                    loads[name].append(load)
            rows.append(Row(mix.name, c, n, summary(loads["stock"]), summary(loads["ours"])))
            tqdm.write(
                f"{mix.name} c={c}: tok/s {rows[-1].ratio('output_tokens_per_s'):.3f}x "
                f"TTFT {rows[-1].ratio('ttft_p50_s'):.3f}x TPOT {rows[-1].ratio('tpot_p50_s'):.3f}x"
            )
            write(args, rows)
    if samples:
        Path(args.out).with_name(Path(args.out).name + "_profile.md").write_text(profile_table(samples))
    return rows


def sample_scheduler(server, run_load, seconds: float) -> tuple[Load, Counter]:
    """``run_load()`` while py-spy samples the server's scheduler process for ``seconds`` (after
    a quarter of them, when the requests are decoding); (the load, inclusive samples per
    function, with ``""`` counting all samples)."""
    sched = next(p for p in psutil.Process(server.proc.pid).children(recursive=True) if "scheduler" in p.name())
    with tempfile.TemporaryDirectory() as d, ThreadPoolExecutor(1) as pool:
        future = pool.submit(run_load)
        time.sleep(seconds / 4)
        raw = Path(d) / "raw.txt"
        subprocess.run(
            [
                str(Path(sys.executable).with_name("py-spy")),
                "record",
                "-p",
                str(sched.pid),
                "-r",
                "50",
                "-d",
                str(int(seconds)),
                "-f",
                "raw",
                "-o",
                str(raw),
                "--nonblocking",
            ],
            check=True,
            capture_output=True,
        )
        counts: Counter = Counter()
        for line in raw.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            counts[""] += int(n)
            for frame in {f.split(" (")[0] for f in stack.split(";")}:
                counts[frame] += int(n)
        return future.result(), counts


def profile_table(samples: dict[str, Counter], top: int = 20) -> str:
    """The functions whose inclusive share of the scheduler's samples differs most, ours against stock."""
    share = {k: {f: n / c[""] for f, n in c.items() if f} for k, c in samples.items()}
    funcs = sorted(
        set(share["ours"]) | set(share["stock"]), key=lambda f: -abs(share["ours"].get(f, 0) - share["stock"].get(f, 0))
    )
    lines = [
        f"py-spy, 50 Hz, samples: stock {samples['stock']['']}, ours {samples['ours']['']}",
        "",
        "| function | stock % | ours % |",
        "|---|---|---|",
    ]
    lines += [
        f"| `{f}` | {100 * share['stock'].get(f, 0):.1f} | {100 * share['ours'].get(f, 0):.1f} |" for f in funcs[:top]
    ]
    return "\n".join(lines) + "\n"


def table(rows: list[Row]) -> str:
    lines = [
        "| mix | concurrency | requests | stock tok/s | ours tok/s | tok/s ratio | stock TTFT p50 s | "
        "TTFT ratio | stock TPOT p50 ms | TPOT ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.mix} | {r.concurrency} | {r.requests} | {r.stock['output_tokens_per_s']:.1f} | "
            f"{r.ours['output_tokens_per_s']:.1f} | {r.ratio('output_tokens_per_s'):.3f}x | "
            f"{r.stock['ttft_p50_s']:.3f} | {r.ratio('ttft_p50_s'):.3f}x | "
            f"{1000 * r.stock['tpot_p50_s']:.1f} | {r.ratio('tpot_p50_s'):.3f}x |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("output_tokens_per_s", "output tokens/s"), ("ttft_p50_s", "TTFT p50"), ("tpot_p50_s", "TPOT p50"))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{r.mix}\nc={r.concurrency}" for r in rows]
    for j, (key, name) in enumerate(keys):
        ax.bar([i + (j - 1) * 0.27 for i in range(len(rows))], [r.ratio(key) for r in rows], 0.27, label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("ours / stock")
    ax.set_title("Plain traffic: launch_server (default flags) against stock SGLang")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(args, rows: list[Row]) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "args": vars(args)}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    out.with_suffix(".md").write_text(table(rows) + "\n")
    plot(rows, out.with_suffix(".png"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--mixes", nargs="+", choices=("prefill", "decode"), default=["prefill", "decode"])
    ap.add_argument("--server-arg", action="append", default=[], help="a launch_server flag for ours (repeatable)")
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-output", type=int, default=128)
    ap.add_argument("--min-requests", type=int, default=8, help="requests per setting: max(this, 4 x concurrency)")
    ap.add_argument(
        "--profile",
        type=float,
        default=0.0,
        help="seconds of py-spy samples of each scheduler in the decode mix at the top concurrency",
    )
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 4, 256-token prompts, 32 output tokens")
    ap.add_argument("--out", default=str(ROOT / "results" / "overhead"))
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.prefill_tokens, args.decode_prompt, args.decode_output = [1, 4], 256, 128, 32
        args.min_requests = 4
    rows = run(args)
    print(table(rows))


if __name__ == "__main__":
    main()
