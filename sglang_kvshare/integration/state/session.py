"""The plugin's session: what it keeps in one process (the scheduler's, where all of it is
used). ``plugin.py`` builds one per process and hands it to every hook and to the objects SGLang
constructs (the radix cache, the attention backend)."""

from __future__ import annotations

import logging
import random
from collections import Counter
from typing import Any, Optional

import psutil
import torch
from cachetools import FIFOCache

from sglang_kvshare.config import KVShareArgs
from sglang_kvshare.correction import create_corrector
from sglang_kvshare.correction.observer import Observer
from sglang_kvshare.correction.pool import evict_lfu_oldest
from sglang_kvshare.correction.tuning import TauController
from sglang_kvshare.integration.cache.kv_io import keep_free_slots_sorted
from sglang_kvshare.integration.cpu_shims import keep_freed_memory
from sglang_kvshare.integration.state.anchor_pool_file import AnchorPoolFile
from sglang_kvshare.integration.state.forward import ForwardState
from sglang_kvshare.integration.state.request import ReqShareState
from sglang_kvshare.integration.state.twins import TwinPairs
from sglang_kvshare.lowrank import native_bfloat16
from sglang_kvshare.recompute import DroidSpeakProfile
from sglang_kvshare.recompute.hidden_store import HiddenStore
from sglang_kvshare.rope import RopeSpec, rope_spec_for_model
from sglang_kvshare.segments.reuse import ReuseClock
from sglang_kvshare.segments.sources import SourceRegistry, common_prefix

logger = logging.getLogger(__name__)


class Session:
    """Everything the plugin keeps in one scheduler process: the configuration, the source
    registry and the per-request states, the correctors and their gate controllers, the LR
    cache, the stored hidden states and DroidSpeak profiles, and the state of the forward now
    running (``ForwardState``), the scheduling pass's cut, ReBaseShared DB's twins and LP's kept
    own LR columns."""

    def __init__(self, args: KVShareArgs):
        self.args = args
        self.hidden = HiddenStore()  # selective recomputation's stored hidden states
        self.profiles: dict[tuple[str, int], Any] = {}  # DroidSpeak profiles by (path, layers)
        # what SGLang constructs after the plugin loaded, each received by its ``attach_*`` method
        self.runner: Any = None  # the model runner whose attention backend is kvshare_torch
        self.views_unsupported: Optional[str] = "attention backend is not kvshare_torch"
        self.tree: Any = None  # the ``kvshare`` radix tree (``cache/radix.py``)
        self.views: Any = None  # KV views (``cache/views.py``), built with the tree when supported
        self.lora_manager: Any = None  # with the LR cache: SGLang's LoRA manager, before the KV pool is sized
        self.lr_pool_cell_bytes: Optional[int] = None  # SGLang's bytes per cached token, KV + LR
        self.lr: Any = None  # the LR cache (``--kvshare-lr-cache``, ``model/lr_pool.py``)
        self.forward: Optional[ForwardState] = None  # the forward now running
        self.forwards: Counter = Counter()  # forwards begun, "shared" or "plain"
        self.memory_kept = False  # ``keep_memory_for_sharing`` ran
        self.cut_adder = None  # the PrefillAdder whose last admission was cut at a segment
        self.twins = TwinPairs()  # ReBaseShared DB
        self._own_columns: Optional[FIFOCache] = None
        self.registry = SourceRegistry(args.max_workflows, args.auto_index_tokens)
        self.reuse = ReuseClock()  # times between a source's uses (``--kvshare-leaf-policy pressure``)
        self.requests: dict[str, ReqShareState] = {}
        self._correctors: dict[str, Any] = {}
        self._controllers: dict[tuple[str, Optional[float]], Any] = {}
        self._budget: Optional[int] = None
        self.observer = Observer(args.observe)
        self.anchor_file = AnchorPoolFile(self)  # the pools on disk (``--kvshare-anchor-pool``)
        self.rng = random.Random(0)  # shadow sampling
        self.rope: Optional[RopeSpec] = None  # the model's RoPE, read at the first sharing step
        # baseshared: (workflow, agent) -> token ids the agent has processed itself
        self.processed: FIFOCache = FIFOCache(16 * args.max_workflows)

    def attach_model_runner(self, runner, views_unsupported: Optional[str]) -> None:
        """The model runner whose attention backend is ``kvshare_torch`` (its pools are the ones
        recompute jobs write) and why it cannot attend KV views (None: it can)."""
        self.runner, self.views_unsupported = runner, views_unsupported

    def attach_tree(self, tree, views) -> None:
        """The radix tree SGLang built with ``--radix-cache-backend kvshare`` and its KV views (None: off)."""
        self.tree, self.views = tree, views

    def attach_lora_manager(self, manager) -> None:
        self.lora_manager = manager

    def attach_lr_pool_cell_bytes(self, cell: int) -> None:
        """SGLang's bytes per cached token as sized with the LR columns (``lora_hooks.py``)."""
        self.lr_pool_cell_bytes = cell

    def attach_lr_cache(self, lr) -> None:
        self.lr = lr

    @property
    def own_columns(self) -> FIFOCache:
        """ReBaseShared LP: adapted request id -> its own LR column (``OwnLRColumn``), kept for
        its rebuild (``scheduler/own_column.py``) and dropped when the rebuild is released. Bounded in bytes by
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
            overrides: dict[str, Any] = {}
            if name.startswith("kvcmas"):
                overrides = {
                    "num_anchors": self.args.num_anchors,
                    "tau": self.args.tau,
                    "factor_dtype": getattr(torch, self.args.anchor_dtype),
                    "compute_dtype": self.anchor_compute_dtype(),
                }
                if name != "kvcmas_plus":  # its ranks are energy-chosen under caps of its own
                    overrides.update(rank_base=self.args.rank, rank_delta=self.args.rank)
            elif name == "kvcomm":
                overrides = {"tau": self.args.tau}
            self._correctors[name] = create_corrector(name, **overrides)
        return self._correctors[name]

    def anchor_compute_dtype(self):
        """``--kvshare-anchor-compute-dtype`` resolved for the device the model runs on (an
        accelerator when there is one, as ``anchor_budget`` assumes)."""
        choice = self.args.anchor_compute_dtype
        if choice == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
            choice = "bfloat16" if native_bfloat16(device) else "float32"
        return getattr(torch, choice)

    def gate_block(self, spec) -> Optional[int]:
        """Rows per gate decision of a request (its annotation's ``fallback``, else the
        server's ``--kvshare-fallback``): None for a dense fallback (one decision per segment)."""
        if (spec.fallback or self.args.fallback) != "rows":
            return None
        return spec.fallback_block or self.args.fallback_block

    def recompute_head(self, spec, method) -> int:
        """The head-row window of a request's accepted corrections: its annotation's, else the
        server's for the methods it applies to (``MethodSpec.head_rows``), else 0."""
        if spec.recompute_head is not None:
            return spec.recompute_head
        return self.args.recompute_head if method.head_rows else 0

    def tau_controller(self, name: str, target_rho: Optional[float] = None):
        """The gate threshold controller of method ``name`` for a reuse target (None: the
        server's ``--kvshare-target-rho``, or a fixed tau when that is -1)."""
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
                if torch.cuda.is_available():
                    free = torch.cuda.mem_get_info()[0]
                else:
                    free = psutil.virtual_memory().available
                self._budget = int(self.args.anchor_mem_fraction * free)
                logger.info(
                    "kvshare: anchor budget %.0f MiB (%.0f%% of %.0f MiB free)",
                    self._budget / 2**20,
                    100 * self.args.anchor_mem_fraction,
                    free / 2**20,
                )
        return self._budget

    def enforce_anchor_budget(self, keep=()) -> int:
        """Evict anchors (LFU among the 5 oldest of all pools, never those in ``keep``) until all
        correction state fits ``anchor_budget()``; returns how many were evicted."""
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
        return (
            {
                "anchor_bytes": self.anchor_bytes_total(),
                "anchor_budget_bytes": self._budget,
                "pending_observations": self.observer.pending,
                "observations_done": self.observer.num_done,
                "observations_failed": self.observer.num_failed,
                "correctors": {name: c.stats() for name, c in self._correctors.items()},
                "tau_controllers": {f"{n}@{t}": c.stats() for (n, t), c in self._controllers.items()},
                "view_tokens": self.view_tokens(),
                "reuse_horizon_s": self.reuse.horizon(),
                "forwards": {"plain": self.forwards["plain"], "shared": self.forwards["shared"]},
            }
            | self.anchor_file.stats()
            | ({} if self.views is None else self.views.stats())
        )

    def view_tokens(self) -> int:
        """Prompt tokens that live requests attend in a source's slots (KV views)."""
        return sum(st.view_tokens for st in self.requests.values())

    def lookup(self, req) -> Optional[ReqShareState]:
        """The segment state of a scheduler ``Req`` (None: unannotated, or not admitted)."""
        return self.requests.get(req.rid)

    def forget(self, req) -> Optional[ReqShareState]:
        return self.requests.pop(req.rid, None)

    def sort_free_slots(self) -> None:
        """Once, at the first annotated request: the KV allocator keeps its free slots sorted
        (``cache.kv_io.keep_free_slots_sorted``), so that a corrected copy can take one
        contiguous run of them. A server that never shares keeps SGLang's allocator as it is."""
        if self.tree is not None:
            keep_free_slots_sorted(self.tree.token_to_kv_pool_allocator)

    def keep_memory_for_sharing(self) -> None:
        """Once, at the first annotated request (``--kvshare-keep-freed-memory``, CPU): the
        scheduler keeps the memory it frees for reuse, so the correction's temporary tensors do
        not page-fault on every use. A server that never shares keeps glibc's defaults, as stock
        SGLang does (16 concurrent plain decodes were measured 3-12 % slower with it)."""
        if self.memory_kept or not self.args.keep_freed_memory or torch.cuda.is_available():
            return
        self.memory_kept = True
        logger.info("kvshare: keeping freed memory for reuse in the scheduler: %s", keep_freed_memory())

    def begin_forward(self, forward_batch) -> ForwardState:
        """A new forward of ``forward_batch`` starts (the attention backend's metadata step);
        counted in ``forwards`` as shared or plain (``ForwardState.shared``)."""
        rids = getattr(forward_batch, "rids", None) or ()
        shared = self.lr is not None or any(rid in self.requests for rid in rids)
        self.forwards["shared" if shared else "plain"] += 1
        self.forward = ForwardState(forward_batch, shared=shared)
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

    def profile(self, path: str, num_layers: int) -> DroidSpeakProfile:
        """The server's DroidSpeak profile; without ``--kvshare-droidspeak-profile`` every layer
        weighs the same (the groups then start at layer 0)."""
        key = (path, num_layers)
        if key not in self.profiles:
            self.profiles[key] = (
                DroidSpeakProfile.load(path, num_layers)
                if path
                else DroidSpeakProfile.of_layer_deviation([1.0] * num_layers)
            )
        return self.profiles[key]

    def rope_of(self, model_runner) -> RopeSpec:
        """The model's RoPE (read off it once per process)."""
        if self.rope is None:
            self.rope = rope_spec_for_model(model_runner.model, model_runner.model_config.hf_config)
        return self.rope
