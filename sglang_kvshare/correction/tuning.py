"""Online control of the entropy gate's threshold tau (ours, beyond the paper).

The paper hand-tunes tau per workload to reach its reuse operating point (rho ~ 0.8 for the
LLM workloads, appendix B.1/B.3). A server cannot: ``TauController`` holds a reuse target
instead, and guards quality with measured errors.

- ``target_rho``: tau is the token-weighted ``target_rho`` quantile of the gate entropies of the
  last ``window`` gated segments, so about that fraction of the gated shared tokens is accepted
  (the least ambiguous matches first). The rows an accepted segment recomputed anyway (its head
  rows, ``--kvshare-recompute-head``) count as not reused, so the controller accepts more segments
  to hold the target. Segments that could not be gated (fewer than two anchors) are outside its
  reach. Before the first gate, every correction is accepted (tau 1): a fresh server reuses from
  the first segment with two anchors, and the window fills as it goes.
- Error guard (the shadow-dense monitor feeds it): a measured relative KV error above
  ``max_error`` caps tau below the entropy of the correction that erred (x ``backoff``); each
  measurement within bound lets the cap recover by ``recovery`` of its distance to 1.

Plain Python; one instance per (method, target) in a process; not thread-safe.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Optional, Tuple


class TauController:
    def __init__(
        self,
        tau: float,
        target_rho: Optional[float] = None,
        max_error: Optional[float] = None,
        window: int = 256,
        backoff: float = 0.9,
        recovery: float = 0.05,
    ) -> None:
        if target_rho is not None and not 0.0 < target_rho <= 1.0:
            raise ValueError(f"target_rho must be in (0, 1], got {target_rho}")
        if max_error is not None and max_error <= 0.0:
            raise ValueError(f"max_error must be > 0, got {max_error}")
        self.base_tau = tau
        self.target_rho = target_rho
        self.max_error = max_error
        self.backoff, self.recovery = backoff, recovery
        self.cap = 1.0
        self._gates: Deque[Tuple[float, int, int]] = deque(maxlen=window)
        self.num_errors = 0
        self.num_violations = 0
        self.last_error: Optional[float] = None

    def tau(self) -> float:
        """The threshold to gate with now."""
        tau = self.base_tau
        if self.target_rho is not None:
            tau = _reuse_quantile(self._gates, self.target_rho) if self._gates else 1.0
        return min(tau, self.cap)

    def observe_gate(self, entropy: float, tokens: int, recomputed: int = 0) -> None:
        """A gate ran on a segment of ``tokens`` rows with this normalised entropy; ``recomputed``
        of them are recomputed even where it accepts (the head rows)."""
        tokens = max(1, int(tokens))
        self._gates.append((float(entropy), tokens, min(max(0, int(recomputed)), tokens)))

    def observe_error(self, entropy: float, error: float) -> None:
        """A shadowed correction (gate entropy ``entropy``) had relative KV error ``error``."""
        self.num_errors += 1
        self.last_error = float(error)
        if self.max_error is None:
            return
        if error > self.max_error:
            self.num_violations += 1
            self.cap = min(self.cap, entropy) * self.backoff
        else:
            self.cap += (1.0 - self.cap) * self.recovery

    def stats(self) -> dict:
        return {
            "tau": self.tau(),
            "base_tau": self.base_tau,
            "target_rho": self.target_rho,
            "cap": self.cap,
            "num_gates": len(self._gates),
            "num_shadowed": self.num_errors,
            "num_error_violations": self.num_violations,
            "last_error": self.last_error,
        }


def _reuse_quantile(samples, q: float) -> float:
    """Smallest entropy v such that accepting every segment gated at <= v reuses at least ``q`` of
    all gated tokens (a segment's tokens less its recomputed rows); 1.0 (accept every segment)
    where not even that reaches ``q``. Without recomputed rows: the token-weighted q-quantile."""
    ordered = sorted(samples)
    total = sum(n for _, n, _ in ordered)
    reused = 0
    for value, n, recomputed in ordered:
        reused += n - recomputed
        if reused >= q * total - 1e-9:
            return value
    return 1.0
