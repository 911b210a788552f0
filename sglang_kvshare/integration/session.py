"""The plugin's session in a scheduler process, and the per-forward state its hooks share."""

from __future__ import annotations

import logging
import random
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from cachetools import FIFOCache

from sglang_kvshare.config import KVShareArgs
from sglang_kvshare.integration.hidden_store import HiddenStore
from sglang_kvshare.integration.state import META_KEY, ReqShareState, wire_spec_of
from sglang_kvshare.methods import get_method
from sglang_kvshare.segments.sources import SourceRegistry, common_prefix

logger = logging.getLogger(__name__)

_UNSET = object()


@dataclass
class ForwardState:
    """What the hooks of one model forward share (``Session.begin_forward``, a new one per
    forward batch):

    - ``plan``: the recompute plan the decoder-layer hook builds at the first layer (a
      ``BatchPlan`` or None; unset until then);
    - ``running``: while a layer runs on a row subset, (plan, active rows or None, rows split by
      request or None): which queries the ``kvshare_torch`` backend attends;
    - ``lr_columns``: with the LR cache, the LR column of each request of the batch (-1: the base
      model), which the LoRA hook writes and the attention reads with;
    - ``paged``: the batch's paged KV indices (``lr_cache.paged_indices``), built by the first
      LR attention layer and shared by all the others;
    - ``decode_runs``: in a decode, each request's KV slots as runs (``kernels.split_decode``),
      built by the first attention layer and shared by all the others."""

    batch: Any  # the ForwardBatch
    plan: Any = _UNSET
    running: Optional[tuple] = None
    lr_columns: Any = None  # [bs] int64 tensor
    paged: Optional[tuple] = None  # (kv_indices, qo_indptr, kv_indptr)
    decode_runs: Optional[list] = None  # [bs] SlotRuns

    @property
    def planned(self) -> bool:
        return self.plan is not _UNSET


class TwinPairs:
    """ReBaseShared DB (``double_batch``): each adapted request's adapter-free twin, and the
    adapted requests whose finished output is held until their twin finishes. Kept only as
    long as the requests live: a twin holds its adapted request, not the other way round."""

    def __init__(self):
        self._primary: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # twin -> adapted req
        self._twin: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapted req -> ref(twin)
        self._held: weakref.WeakSet = weakref.WeakSet()
        # either request -> [lo, hi): the positions it computed itself (``wrote``)
        self._own: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def pair(self, primary, twin) -> None:
        self._primary[twin] = primary
        self._twin[primary] = weakref.ref(twin)

    def primary_of(self, twin):
        """The adapted request of a twin (None: ``twin`` is no twin)."""
        return self._primary.get(twin)

    def twin_of(self, primary):
        """The twin of an adapted request (None: none, or gone)."""
        ref = self._twin.get(primary)
        return None if ref is None else ref()

    def paired(self, req) -> bool:
        return req in self._primary or req in self._twin

    def hold(self, primary, held: bool = True) -> None:
        if held:
            self._held.add(primary)
        else:
            self._held.discard(primary)

    def held(self, primary) -> bool:
        return primary in self._held

    def __len__(self) -> int:
        """Twins alive now."""
        return len(self._primary)

    def wrote(self, req, lo: int, hi: int) -> None:
        """A forward wrote ``req``'s KV at positions ``[lo, hi)``: its computed span grows, or
        starts again when ``lo`` does not continue it (the first forward, a retracted request)."""
        own = self._own.get(req)
        self._own[req] = (own[0], hi) if own is not None and own[1] == lo else (lo, hi)

    def own(self, req) -> Optional[tuple[int, int]]:
        """Positions ``[lo, hi)`` ``req`` computed itself (None: none yet)."""
        return self._own.get(req)


class Session:
    """Everything the plugin keeps in one scheduler process: the configuration, the source
    registry and the per-request states, the correctors and their gate controllers, the LR
    cache, the stored hidden states and DroidSpeak profiles, and the state of the forward now
    running (``ForwardState``), the scheduling pass's cut, ReBaseShared DB's twins and LP's kept
    own LR columns. Created
    once per process (``plugin.session()``)."""

    def __init__(self, args: KVShareArgs):
        self.args = args
        self.lr = None  # the LR cache (``--kvshare-lr-cache``), created by the attention backend
        self.lora_manager = None  # with the LR cache: SGLang's LoRA manager, before the KV pool is sized
        self.lr_pool_cell_bytes: Optional[int] = None  # SGLang's bytes per cached token, KV + LR
        self.hidden = HiddenStore()  # selective recomputation's stored hidden states
        self.profiles: dict[tuple[str, int], Any] = {}  # DroidSpeak profiles by (path, layers)
        self.runner = None  # the model runner whose attention backend is kvshare_torch
        self.forward: Optional[ForwardState] = None  # the forward now running
        self.cut_adder = None  # the PrefillAdder whose last admission was cut at a segment
        self.twins = TwinPairs()  # ReBaseShared DB
        self._own_columns: Optional[FIFOCache] = None
        self.registry = SourceRegistry(args.max_workflows)
        self.requests: dict[str, ReqShareState] = {}
        self._correctors: dict[str, Any] = {}
        self._controllers: dict[tuple[str, Optional[float]], Any] = {}
        self._budget: Optional[int] = None
        from sglang_kvshare.integration.observer import Observer

        self.observer = Observer(args.observe)
        from sglang_kvshare.integration.anchor_file import AnchorPoolFile

        self.anchor_file = AnchorPoolFile(self)
        self.rng = random.Random(0)  # shadow sampling
        self.rope = None  # the model's RopeSpec, set at the first injection
        # baseshared: (workflow, agent) -> token ids the agent has processed itself
        self.processed: FIFOCache = FIFOCache(16 * args.max_workflows)

    @property
    def own_columns(self) -> FIFOCache:
        """ReBaseShared LP: adapted request id -> its own LR column (``OwnLRColumn``), kept for
        its rebuild (``own_lr``) and dropped when the rebuild is released. Bounded in bytes by
        the room SGLang's pool sizing reserved (``--kvshare-lp-stash-columns`` LR columns of
        every KV slot; oldest dropped first); created with the LR cache."""
        if self._own_columns is None:
            budget = 0
            if self.lr is not None:
                rows = self.lr.kv_pool.get_value_buffer(0).shape[0]
                budget = rows * self.lr.bytes_per_token["lp_stash_bytes_per_token"]
            self._own_columns = FIFOCache(maxsize=max(budget, 1), getsizeof=lambda kept: kept.nbytes())
        return self._own_columns

    def remember_processed(self, workflow: str, agent: str, tokens: tuple[int, ...]) -> None:
        self.processed[(workflow, agent)] = tokens

    def processed_prefix(self, workflow: str, agent: str, tokens) -> int:
        """Length of the common prefix of ``tokens`` and what ``agent`` processed before."""
        return common_prefix(self.processed.get((workflow, agent), ()), tokens)

    def corrector(self, name: str):
        """The process-wide corrector of method ``name`` (one set of pools per method)."""
        if name not in self._correctors:
            import torch

            from sglang_kvshare.correction import create_corrector

            overrides: dict[str, Any] = {}
            if name.startswith("kvcmas"):
                overrides = {"num_anchors": self.args.num_anchors, "tau": self.args.tau,
                             "factor_dtype": getattr(torch, self.args.anchor_dtype),
                             "compute_dtype": self.anchor_compute_dtype()}
                if name != "kvcmas_plus":  # its ranks are energy-chosen under caps of its own
                    overrides.update(rank_base=self.args.rank, rank_delta=self.args.rank)
            elif name == "kvcomm":
                overrides = {"tau": self.args.tau}
            self._correctors[name] = create_corrector(name, **overrides)
        return self._correctors[name]

    def anchor_compute_dtype(self):
        """``--kvshare-anchor-compute-dtype`` resolved for the device the model runs on (an
        accelerator when there is one, as ``anchor_budget`` assumes)."""
        import torch

        from sglang_kvshare.lowrank import native_bfloat16

        choice = self.args.anchor_compute_dtype
        if choice == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
            choice = "bfloat16" if native_bfloat16(device) else "float32"
        return getattr(torch, choice)

    def tau_controller(self, name: str, target_rho: Optional[float] = None):
        """The gate threshold controller of method ``name`` for a reuse target (None: the
        server's ``--kvshare-target-rho``, or a fixed tau when that is -1)."""
        from sglang_kvshare.correction.tuning import TauController

        if target_rho is None and self.args.target_rho > 0:
            target_rho = self.args.target_rho
        key = (name, target_rho)
        if key not in self._controllers:
            max_error = self.args.max_error if self.args.shadow_fraction > 0 else None
            self._controllers[key] = TauController(
                getattr(self.corrector(name).config, "tau", 1.0), target_rho=target_rho, max_error=max_error
            )
        return self._controllers[key]

    def anchor_bytes_total(self) -> int:
        return sum(c.nbytes() for c in self._correctors.values())

    def anchor_budget(self) -> int:
        """Bytes all correction state may hold: ``--kvshare-anchor-budget-mb``, or (when -1)
        ``--kvshare-anchor-mem-fraction`` of the memory free when first asked (after SGLang
        sized its KV pool): the accelerator's when the model runs on one, else the host's."""
        if self._budget is None:
            if self.args.anchor_budget_mb >= 0:
                self._budget = int(self.args.anchor_budget_mb * 2**20)
            else:
                import torch

                if torch.cuda.is_available():
                    free = torch.cuda.mem_get_info()[0]
                else:
                    import psutil

                    free = psutil.virtual_memory().available
                self._budget = int(self.args.anchor_mem_fraction * free)
                logger.info("kvshare: anchor budget %.0f MiB (%.0f%% of %.0f MiB free)",
                            self._budget / 2**20, 100 * self.args.anchor_mem_fraction, free / 2**20)
        return self._budget

    def enforce_anchor_budget(self, keep=()) -> int:
        """Evict anchors (LFU among the 5 oldest of all pools, never those in ``keep``) until all
        correction state fits ``anchor_budget()``; returns how many were evicted."""
        from sglang_kvshare.correction.pool import evict_lfu_oldest

        pools = [c for c in self._correctors.values() if hasattr(c, "anchors")]
        fixed = sum(c.nbytes() for c in self._correctors.values() if not hasattr(c, "anchors"))
        return evict_lfu_oldest(pools, self.anchor_budget() - fixed, keep=keep)

    def anchor_version(self) -> int:
        """Changes whenever an anchor is inserted, merged or evicted."""
        total = 0
        for c in self._correctors.values():
            st = c.stats()
            total += st.get("num_inserted", 0) + st.get("num_merged", 0) + st.get("num_evicted", 0)
        return total

    def stats(self) -> dict[str, Any]:
        """Plain-value state of the sharing machinery (``/server_info`` internal state)."""
        return {
            "anchor_bytes": self.anchor_bytes_total(),
            "anchor_budget_bytes": self._budget,
            "pending_observations": self.observer.pending,
            "observations_done": self.observer.num_done,
            "observations_failed": self.observer.num_failed,
            "correctors": {name: c.stats() for name, c in self._correctors.items()},
            "tau_controllers": {f"{n}@{t}": c.stats() for (n, t), c in self._controllers.items()},
            "anchor_pool_saves": self.anchor_file.num_saves,
            "anchor_pool_loaded": {"path": self.anchor_file.loaded_from, "anchors": self.anchor_file.num_loaded},
        }

    def lookup(self, req) -> Optional[ReqShareState]:
        """The segment state of a scheduler ``Req`` (None: unannotated, or not admitted)."""
        return self.requests.get(req.rid)

    def admit(self, req) -> Optional[ReqShareState]:
        """The segment state of an annotated ``Req`` that entered the scheduler's waiting queue,
        created (and the request adjusted by its method family, ``sharing.Family.admit``) unless
        it exists; None if unannotated. Called again when a retracted request re-enters."""
        st = self.requests.get(req.rid)
        if st is not None:
            return st
        spec = wire_spec_of(req)
        if spec is None:
            return None
        from sglang_kvshare.integration.sharing import family_of

        st = ReqShareState(spec=spec, method=get_method(spec.method), prompt_len=len(req.origin_input_ids))
        self.requests[req.rid] = st
        family_of(st.method).admit(self, req, st)
        req.customized_info = {META_KEY: [st.refresh_meta()]}
        return st

    def forget(self, req) -> Optional[ReqShareState]:
        return self.requests.pop(req.rid, None)

    def begin_forward(self, forward_batch) -> ForwardState:
        """A new forward of ``forward_batch`` starts (the attention backend's metadata step)."""
        self.forward = ForwardState(forward_batch)
        return self.forward

    def forward_of(self, forward_batch) -> ForwardState:
        """The state of the forward running ``forward_batch`` (a new one per batch)."""
        if self.forward is None or self.forward.batch is not forward_batch:
            return self.begin_forward(forward_batch)
        return self.forward

    def running_forward(self, forward_batch) -> Optional[ForwardState]:
        """The state of the forward running ``forward_batch`` if one was begun, else None."""
        fwd = self.forward
        return fwd if fwd is not None and fwd.batch is forward_batch else None

    def profile(self, path: str, num_layers: int):
        """The server's DroidSpeak profile; without ``--kvshare-droidspeak-profile`` every layer
        weighs the same (the groups then start at layer 0)."""
        from sglang_kvshare.integration.recompute_jobs import load_profile, profile_of

        key = (path, num_layers)
        if key not in self.profiles:
            self.profiles[key] = load_profile(path, num_layers) if path else profile_of([1.0] * num_layers)
        return self.profiles[key]

    def init_lr(self, model_runner):
        """Create the LR cache once per process when ``--kvshare-lr-cache`` is on."""
        if self.lr is None and self.args.lr_cache:
            from sglang_kvshare.integration.lr_cache import LRCache

            self.lr = LRCache(model_runner)
            logger.info("kvshare LR cache: %d adapter columns, %d layers", self.lr.n_slots, len(self.lr.layer_of))
        return self.lr
