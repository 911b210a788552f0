"""Our own server flags: one frozen dataclass, rendered as ``--kvshare-*`` CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field

from sglang_kvshare.methods import get_method, method_names
from sglang_kvshare.segments.spec import FALLBACKS

ENV_VAR = "SGLANG_KVSHARE_CONFIG"
# the --help groups of the flags, in order (every field is in one; a test checks)
GROUPS = {
    "sharing": ("method", "recompute_ratio", "droidspeak_profile"),
    "correction": (
        "tau",
        "target_rho",
        "shadow_fraction",
        "max_error",
        "fallback",
        "fallback_block",
        "recompute_head",
        "rank",
        "num_anchors",
        "anchor_budget_mb",
        "anchor_mem_fraction",
        "anchor_dtype",
        "anchor_compute_dtype",
        "observe",
    ),
    "KV views": ("kv_views", "leaf_rank", "leaf_policy"),
    "LoRA": ("lr_cache", "lp_stash_columns"),
    "automatic detection": ("auto", "auto_min_tokens", "auto_scope", "auto_scope_tokens", "auto_index_tokens"),
    "operations": (
        "anchor_pool",
        "anchor_pool_interval",
        "anchor_pool_seed",
        "dump_dir",
        "keep_freed_memory",
        "max_workflows",
    ),
}


def _flag(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class KVShareArgs:
    method: str = _flag(
        "fullshared", "default sharing method for requests whose annotation names none", choices=method_names
    )
    tau: float = _flag(0.3, "entropy gate threshold of the correction methods (higher: more reuse)")
    target_rho: float = _flag(
        0.85,
        "hold this reuse ratio (0-1] of the gated shared tokens by tuning tau online (the "
        "token-weighted quantile of recent gate entropies; the paper's LLM operating point is "
        "rho ~ 0.8, which a target of 0.8 undershot on SmolLM2 at 2K: 0.75); -1: a fixed --kvshare-tau",
    )
    shadow_fraction: float = _flag(
        0.0,
        "shadow-dense monitor: compute this fraction of accepted corrections densely as well, "
        "measure the corrected cache's relative KV error, export it, and lower tau when it "
        "exceeds --kvshare-max-error",
    )
    max_error: float = _flag(0.05, "relative KV error above which a shadowed correction lowers tau")
    fallback: str = _flag(
        "rows",
        "what a correction method recomputes when its gate rejects a segment: 'rows' gates the "
        "segment's blocks of --kvshare-fallback-block rows again and recomputes only the rejected "
        "ones, attending the corrected rows (beyond the papers; chosen by measurement, "
        "docs/results.md; dense where the attention backend or model cannot recompute rows); "
        "'dense' prefills the whole segment (the papers)",
        choices=lambda: list(FALLBACKS),
    )
    fallback_block: int = _flag(
        64, "rows per gate decision with --kvshare-fallback rows (64: measured against 256, docs/results.md)"
    )
    recompute_head: int = _flag(
        6,
        "head rows (ours): of a segment kvcmas(_plus) corrects, the rows within this many tokens after the last "
        "token where the prompt differs from the source's are computed by the chunk before it (not reused for "
        "--kvshare-target-rho); 6: KL 0.17x fullshared's at rho 0.89, docs/results.md; 0: the papers",
    )
    kv_views: bool = _flag(
        True,
        "a later agent reads a shared segment it reuses unchanged (fullshared) in the source's KV "
        "slots, in place (one copy of the context; its queries turned by the RoPE offset), where "
        "the kvshare_torch backend on the CPU with page size 1 can attend them, else copies; "
        "--no-kvshare-kv-views always writes a re-rotated copy into the request's own slots",
    )
    leaf_rank: int = _flag(
        8,
        "with KV views: a later agent whose KVCMAS correction the gate accepts reads the shared "
        "segment in the source's slots plus the correction as a low-rank leaf of this rank per "
        "layer (keys and values; 8 kept all of the correction's gain in benchmarks.leaf_study, "
        "docs/results.md); 0: the corrected segment is written as a copy into the agent's own slots",
    )
    leaf_policy: str = _flag(
        "pressure",
        "when an accepted correction becomes a leaf (--kvshare-leaf-rank > 0): 'pressure' writes a "
        "corrected copy while the KV pool holds it without evicting a source that is read again "
        "(free slots, or LRU victims all older than the p90 time between a source's uses), and a "
        "leaf otherwise (leaves cost correction and decode time on the CPU, docs/results.md); "
        "'always' keeps every accepted correction as a leaf; a request's 'leaves' key overrides",
        choices=lambda: ["pressure", "always"],
    )
    rank: int = _flag(32, "rank of the low-rank anchor states (base cache and delta)")
    num_anchors: int = _flag(10, "anchors kept per shared slot (V)")
    recompute_ratio: float = _flag(
        -1.0,
        "recompute budget (fraction of a shared segment's token-layers, rho = 1 - ratio) of "
        "cacheblend, droidspeak and relaycaching; -1: the papers' defaults, 0.1 for agents that "
        "differ by system prompt and 0.3 for LoRA agents",
    )
    droidspeak_profile: str = _flag(
        "",
        "DroidSpeak's offline layer-deviation profile (JSON written by benchmarks.coverage); "
        "empty: every layer weighs the same",
    )
    anchor_budget_mb: float = _flag(
        -1.0,
        "byte budget of all anchor pools together, in MiB; -1: --kvshare-anchor-mem-fraction of "
        "the memory free when the first anchor is stored (as SGLang sizes its KV pool)",
    )
    anchor_mem_fraction: float = _flag(0.1, "fraction of free memory for the anchor budget when it is -1")
    anchor_dtype: str = _flag(
        "bfloat16", "storage dtype of the low-rank anchor factors", choices=lambda: ["float16", "bfloat16", "float32"]
    )
    anchor_compute_dtype: str = _flag(
        "auto",
        "dtype of the correction's gate and delta matrix products (everything else is float32); auto: "
        "bfloat16 where its products are native (CUDA, CPUs with AVX512-BF16 or AMX), else float32",
        choices=lambda: ["auto", "float32", "bfloat16"],
    )
    observe: str = _flag(
        "background",
        "where a dense fallback's anchor is factorised: a one-thread child process beside the "
        "scheduler (background) or inside the scheduler step (inline)",
        choices=lambda: ["background", "inline"],
    )
    keep_freed_memory: bool = _flag(
        True,
        "CPU scheduler, from its first annotated request on: keep memory the scheduler frees for "
        "reuse (glibc mallopt: allocations up to 1 GiB from the heap, free heap returned to the "
        "system above 2 GiB), so the correction's temporary tensors do not page-fault on every "
        "use (docs/results.md); a server that never shares keeps glibc's defaults; "
        "--no-kvshare-keep-freed-memory: glibc's defaults, as in a plain SGLang server",
    )
    anchor_pool: str = _flag(
        "",
        "warm start: load the anchor pools from this file at startup (if it exists) and save them "
        "at shutdown and every --kvshare-anchor-pool-interval seconds",
    )
    anchor_pool_interval: float = _flag(300.0, "seconds between periodic saves of --kvshare-anchor-pool")
    anchor_pool_seed: str = _flag(
        "",
        "warm start from another server's anchor-pool file (read, never written): loaded at "
        "startup when the --kvshare-anchor-pool file does not exist yet, or without "
        "--kvshare-anchor-pool; the file must exist and fit this server",
    )
    dump_dir: str = _flag(
        "",
        "evaluation mode: write the K/V of every shared segment of each finished annotated "
        "request under this directory (<workflow>/<agent>/<slot>.pt)",
    )
    lr_cache: bool = _flag(
        False,
        "PReCache: keep base values plus per-adapter LR caches (needs --enable-lora and the "
        "kvshare_torch attention backend); required by baseshared, prelr_shared, rebase_shared_lp, rebase_shared_db",
    )
    lp_stash_columns: float = _flag(
        1.0,
        "rebase_shared_lp: room for the adapted turns' own LR columns kept for their rebuilds, in "
        "LR columns per KV slot; with the LR cache SGLang's pool sizing counts it in the bytes per "
        "cached token (0: none kept; a rebuild then writes the agent's column from adapter-free states)",
    )
    auto: str = _flag(
        "off",
        "automatic sharing for requests without a kvshare annotation (unmodified agent apps): in a "
        "scope (header X-KVShare-Workflow, else the API key), every run of prompt tokens that repeats "
        "an earlier prompt or output of the scope is shared with this method; per request the header "
        "X-KVShare-Method overrides it ('none' opts out)",
        choices=lambda: ["off", *method_names()],
    )
    auto_min_tokens: int = _flag(
        64, "automatic sharing: a repeated run of at least this many tokens becomes a shared span"
    )
    auto_scope_tokens: int = _flag(
        1 << 20, "automatic sharing: tokens of prompts and outputs indexed per scope (oldest forgotten first)"
    )
    auto_index_tokens: int = _flag(
        1 << 23, "automatic sharing: tokens indexed in all scopes (~16 bytes each; oldest scope's first)"
    )
    auto_scope: str = _flag(
        "request",
        "automatic sharing: 'request' shares only within the X-KVShare-Workflow header or the API "
        "key; 'server' also puts requests with neither into one server-wide scope",
        choices=lambda: ["request", "server"],
    )
    max_workflows: int = _flag(4096, "workflows whose source records are remembered (oldest forgotten first)")

    def __post_init__(self) -> None:
        checks = (
            ("tau", 0.0 <= self.tau <= 1.0, "in [0, 1]"),
            ("target_rho", self.target_rho == -1.0 or 0.0 < self.target_rho <= 1.0, "in (0, 1] or -1"),
            ("shadow_fraction", 0.0 <= self.shadow_fraction <= 1.0, "in [0, 1]"),
            ("max_error", self.max_error > 0.0, "> 0"),
            ("anchor_budget_mb", self.anchor_budget_mb == -1.0 or self.anchor_budget_mb >= 0.0, ">= 0 or -1"),
            ("anchor_mem_fraction", 0.0 < self.anchor_mem_fraction < 1.0, "in (0, 1)"),
            ("anchor_pool_interval", self.anchor_pool_interval > 0.0, "> 0"),
            ("fallback_block", self.fallback_block >= 1, ">= 1"),
            ("recompute_head", self.recompute_head >= 0, ">= 0"),
            ("leaf_rank", self.leaf_rank >= 0, ">= 0"),
            ("leaf_policy", self.leaf_policy in ("pressure", "always"), "'pressure' or 'always'"),
            ("rank", self.rank >= 1, ">= 1"),
            ("num_anchors", self.num_anchors >= 1, ">= 1"),
            ("lp_stash_columns", self.lp_stash_columns >= 0.0, ">= 0"),
            ("auto_min_tokens", self.auto_min_tokens >= 1, ">= 1"),
            ("auto_scope_tokens", self.auto_scope_tokens >= 1, ">= 1"),
            ("auto_index_tokens", self.auto_index_tokens >= 1, ">= 1"),
            (
                "auto",
                self.auto == "off" or self.lr_cache or not get_method(self.auto).lr_sharing,
                "a method without an LR cache unless --kvshare-lr-cache is set",
            ),
        )
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"--kvshare-{name.replace('_', '-')} must be {what}, got {getattr(self, name)}")

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> "KVShareArgs":
        raw = os.environ.get(ENV_VAR)
        return cls(**json.loads(raw)) if raw else cls()

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for title, names in GROUPS.items():
            group = parser.add_argument_group(f"kvshare: {title}")
            for name in names:
                f = fields[name]
                kw = {"default": f.default, "help": f"{f.metadata['help']} (default: {_shown(f.default)})"}
                if isinstance(f.default, bool):  # --kvshare-x / --no-kvshare-x
                    kw["action"] = BooleanSwitch
                else:
                    kw["type"] = type(f.default)
                choices = f.metadata.get("choices")
                if choices is not None:
                    kw["choices"] = choices()
                group.add_argument(cli_name(name), dest="kvshare_" + name, **kw)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "KVShareArgs":
        return cls(**{f.name: getattr(ns, "kvshare_" + f.name) for f in dataclasses.fields(cls)})


def cli_name(name: str) -> str:
    return "--kvshare-" + name.replace("_", "-")


def _shown(default) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return "''" if default == "" else str(default)


class BooleanSwitch(argparse.BooleanOptionalAction):
    """``--kvshare-x`` / ``--no-kvshare-x``, the one spelling of every on/off flag (its help
    already names the default, which argparse would append again)."""

    def __init__(self, *args, help=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.help = help


def flag_table() -> str:
    """The markdown table of every flag, by group (docs/usage.md holds it; a test compares)."""
    fields = {f.name: f for f in dataclasses.fields(KVShareArgs)}
    rows = ["| group | flag | default | meaning |", "|---|---|---|---|"]
    for title, names in GROUPS.items():
        for name in names:
            f = fields[name]
            choices = f.metadata.get("choices")
            meaning = f.metadata["help"] + (f" (one of: {', '.join(choices())})" if choices else "")
            flag = cli_name(name).replace("--", "--[no-]", 1) if isinstance(f.default, bool) else cli_name(name)
            rows.append(f"| {title} | `{flag}` | `{_shown(f.default)}` | {meaning.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(flag_table(), end="")
