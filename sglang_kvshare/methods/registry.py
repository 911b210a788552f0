"""Registry of sharing methods: one name per method, as the papers name them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MethodSpec:
    """What the engine does for the shared (PH) segments of a request under this method.

    injects: PH segments whose source cache exists are injected instead of computed.
    corrector: name in ``sglang_kvshare.correction`` applied to injected caches (None: as is).
    chained: the correction starts from the source agent's materialised cache; otherwise from a
        context-free reference cache of the segment, which costs one extra prefill per segment.
    selector: selective recomputation rule in ``sglang_kvshare.recompute`` (CacheBlend,
        DroidSpeak, RelayCaching): the source cache is reused and the token-layers the rule picks,
        within the budget ``recompute_ratio``, are recomputed under the target's context.
    lr_sharing: PReCache family (agents differ by LoRA adapter; needs ``--kvshare-lr-cache``):
        all agents of a workflow share ONE radix namespace of base K/V plus per-adapter LR caches,
        and reuse a common token prefix instead of injecting segments. ``baseshared``: an agent
        still computes shared context it has not processed itself (its own X.A); ``prelr``: every
        computed token's LR is written for all adapters, so only new tokens are computed;
        ``rebase_lp``: as prelr, but the cache of an adapted turn is rebuilt from adapter-free
        hidden states by one base-model prefill of its new tokens after the turn (lazy prefill):
        base K/V and the other adapters' LR columns from those states, the turn's own adapter's
        column kept from its adapted states;
        ``rebase_db``: the same cache, built by an adapter-free twin request that runs in the same
        continuous batches as the adapted turn, forced to its tokens (double batching).
    head_rows: the server's ``--kvshare-recompute-head`` applies (ours, on KVCMAS; the baselines
        stay as their papers; a request's ``recompute_head`` applies to every corrector).
    """

    name: str
    injects: bool
    description: str
    corrector: str | None = None
    chained: bool = True
    selector: str | None = None
    lr_sharing: str | None = None
    head_rows: bool = False

    @property
    def needs_reference(self) -> bool:
        return self.corrector is not None and not self.chained


METHODS: dict[str, MethodSpec] = {
    m.name: m
    for m in (
        MethodSpec("nonshared", False, "every agent prefills its whole prompt (stock SGLang)"),
        MethodSpec(
            "fullshared", True, "inject the source agent's cache of each shared segment, RoPE re-aligned, uncorrected"
        ),
        MethodSpec(
            "kvcmas",
            True,
            "KVCMAS: low-rank anchor pools, entropy gate, chained correction along the workflow (and head rows, ours)",
            corrector="kvcmas",
            head_rows=True,
        ),
        MethodSpec(
            "kvcmas_nonchained",
            True,
            "KVCMAS ablation: the same anchors relative to a context-free reference (not chained)",
            corrector="kvcmas_nonchained",
            chained=False,
        ),
        MethodSpec(
            "kvcmas_plus",
            True,
            "KVCMAS with ranks chosen by retained energy and a per-edge systematic delta (ours)",
            corrector="kvcmas_plus",
            head_rows=True,
        ),
        MethodSpec(
            "kvcomm",
            True,
            "KVComm: full-dimensional anchors (V=20) relative to a context-free reference, not chained",
            corrector="kvcomm",
            chained=False,
        ),
        MethodSpec(
            "graphflow",
            True,
            "GraphFlow: one correction per recurring (slot, source, target) relation, no matching",
            corrector="graphflow",
            chained=False,
        ),
        MethodSpec(
            "cacheblend",
            True,
            "CacheBlend: reuse the source cache, recompute the top KV-deviation tokens past the check layers",
            selector="cacheblend",
        ),
        MethodSpec(
            "droidspeak",
            True,
            "DroidSpeak: reuse the source cache, recompute every token in profiled critical layer "
            "groups from the stored hidden state",
            selector="droidspeak",
        ),
        MethodSpec(
            "relaycaching",
            True,
            "RelayCaching: reuse the source cache, recompute deviation x attention tokens in the "
            "critical middle layers",
            selector="relaycaching",
        ),
        MethodSpec(
            "baseshared",
            False,
            "LRAgent: one base cache, each agent computes the shared context it has not processed",
            lr_sharing="baseshared",
        ),
        MethodSpec(
            "prelr_shared",
            False,
            "PReCache PreLRShared: LR caches of all agents written as context is computed",
            lr_sharing="prelr",
        ),
        MethodSpec(
            "rebase_shared_lp",
            False,
            "PReCache ReBaseShared, lazy prefill: adapter-free rebuild of each turn's new tokens",
            lr_sharing="rebase_lp",
        ),
        MethodSpec(
            "rebase_shared_db",
            False,
            "PReCache ReBaseShared, double batching: an adapter-free twin rides in the same batches",
            lr_sharing="rebase_db",
        ),
    )
}


def method_names() -> list[str]:
    return list(METHODS)


def get_method(name: str) -> MethodSpec:
    """The method called ``name``; raises KeyError naming the known methods."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown kvshare method {name!r}; known methods: {', '.join(METHODS)}") from None


def method_variant(label: str) -> tuple[str, dict]:
    """A benchmark label ``METHOD[+VARIANT...]`` -> (method, annotation keys). Variants: the
    fallback of a correction method (``+dense``; ``+rows64``: ``fallback: rows``,
    ``fallback_block: 64``; ``+rows``: the server's block size), ``+rho0.5``: the gate's reuse
    target for the request (``target_rho``), ``+copy``: later agents copy shared segments
    instead of reading them in place (``kv_views: false``), ``+leaf``: every accepted
    correction a KV leaf, whatever the pool (``leaves: true``), or ``+head16``: the head-row
    window of an accepted correction (``recompute_head: 16``). Plain method names map to themselves;
    variants combine (``kvcmas+dense+rho0.5``)."""
    name, *variants = label.split("+")
    get_method(name)
    keys: dict = {}
    for variant in variants:
        if variant == "copy":
            keys["kv_views"] = False
        elif variant == "leaf":
            keys["leaves"] = True
        elif variant == "dense":
            keys["fallback"] = "dense"
        elif variant.startswith("rows") and (variant[4:] == "" or variant[4:].isdigit()):
            keys.update(fallback="rows", **({"fallback_block": int(variant[4:])} if variant[4:] else {}))
        elif variant.startswith("head") and variant[4:].isdigit():
            keys["recompute_head"] = int(variant[4:])
        elif variant.startswith("rho") and _is_number(variant[3:]):
            keys["target_rho"] = float(variant[3:])
        else:
            raise KeyError(
                f"unknown variant {variant!r} of method {name!r} (dense, rows, rowsN, rhoX, headN, copy or leaf)"
            )
    return name, keys


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
