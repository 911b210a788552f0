"""How each request of the running forward reads its keys (``kvshare_torch``): the RoPE offsets
of the KV views it reads (``cache/views.py``), its KV leaves (``cache/leaves.py``) and the plans
built from them (``kernels.offset_attention``), each kept in the forward's state for the other
layers."""

from __future__ import annotations

from typing import Optional

import torch

from sglang_kvshare.kernels.kv_leaf import KeyLeaf
from sglang_kvshare.kernels.offset_attention import KeyPlan, key_plan
from sglang_kvshare.kernels.split_decode import slot_runs


def unshifted(slots: torch.Tensor) -> torch.Tensor:
    """Shifts 0 for keys read at their own positions: ``offset_extend_attention`` then attends
    the keys before the first query in place (no gather) and an extend's own keys causally,
    where SDPA's mask over a prefix makes the CPU kernel compute every key block."""
    return torch.zeros(len(slots), dtype=torch.int64, device=slots.device)


class RequestKeys:
    """``session``: the plugin's session (views, request states, the forward now running);
    ``model_runner``: the runner whose RoPE turns queries and keys."""

    def __init__(self, session, model_runner) -> None:
        self.session = session
        self.model_runner = model_runner

    def rope(self):
        return self.session.rope_of(self.model_runner)

    def _kept(self, store: str, i: int, seq_lens, build):
        """``build()``, kept in the running forward's ``store`` dict under request ``i`` for the
        other layers when ``seq_lens`` is that forward's (None: the one begun)."""
        fwd = self.session.forward
        if fwd is None or (seq_lens is not None and fwd.batch.seq_lens is not seq_lens):
            return build()  # not the forward the backend began: compute without keeping
        kept = getattr(fwd, store)
        if i not in kept:
            kept[i] = build()
        return kept[i]

    def _plain(self) -> bool:
        """The forward begun is plain (``ForwardState.shared`` False): no request reads a view or leaf."""
        fwd = self.session.forward
        return fwd is not None and not fwd.shared

    def shifts(self, i: int, slots: torch.Tensor, seq_lens=None) -> Optional[torch.Tensor]:
        """Request ``i``'s per-key RoPE offsets over its slots ``slots`` (KV views), or None
        when it reads every key at its own position."""
        views = self.session.views
        if views is None or views.marked == 0 or self._plain():
            return None
        return self._kept("key_shifts", i, seq_lens, lambda: views.offsets(slots))

    def leaf(self, i: int, slots: torch.Tensor, seq_lens=None) -> Optional[KeyLeaf]:
        """Request ``i``'s KV leaves on ``slots`` (its agent's), or None."""
        views = self.session.views
        if views is None or views.leaves is None or not views.leaves.leaves or self._plain():
            return None

        def build():
            fwd = self.session.forward
            rids = None if fwd is None else getattr(fwd.batch, "rids", None)
            st = None if rids is None else self.session.requests.get(rids[i])
            return None if st is None else views.leaves.key_leaf(st.spec.agent, slots)

        return self._kept("key_leaves", i, seq_lens, build)

    def read(self, i: int, slots: torch.Tensor, seq_lens=None, own_positions: bool = False):
        """(shifts, leaf) of request ``i``'s ``slots``: shifts 0 where it reads no view but a
        leaf, or ``own_positions`` asks for the in-place path; (None, None) for plain keys."""
        shifts = self.shifts(i, slots, seq_lens)
        leaf = self.leaf(i, slots, seq_lens)
        if shifts is None and (leaf is not None or own_positions):
            shifts = unshifted(slots)
        return shifts, leaf

    def prefix_plan(self, i: int, slots, shifts, leaf, seq_lens) -> KeyPlan:
        """Request ``i``'s ``KeyPlan`` of the keys before its extend (``slots``)."""
        return self._kept("key_plans", i, seq_lens, lambda: key_plan(slots, shifts, self.rope(), leaf=leaf))

    def decode_parts(self, i: int, slots: torch.Tensor, seq_lens):
        """Request ``i``'s slots as ``SlotRuns``, or, when it reads KV views or leaves, its ``KeyPlan``."""
        shifts, leaf = self.read(i, slots, seq_lens)
        return slot_runs(slots) if shifts is None else key_plan(slots, shifts, self.rope(), leaf=leaf)
