"""Warm start, scheduler side: the anchor pools are loaded when the radix cache is built, saved
every ``--kvshare-anchor-pool-interval`` seconds when anchors changed (written on a thread from a
snapshot: factors are immutable, so the snapshot is a list of references), on request
(``/set_internal_state``, ``correction.warm_start.SAVE_KEY``), and when the scheduler is told to
stop (SIGTERM or SIGINT: Ctrl-C reaches the whole process group, and the launcher sends SIGTERM to
its children and waits for them before it kills what is left). The file's checks are
``correction.warm_start``'s.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from typing import Any, Dict, Optional

from sglang_kvshare.correction import store
from sglang_kvshare.correction.warm_start import MODEL_ENV, header, load_path

logger = logging.getLogger(__name__)


class AnchorPoolFile:
    """Scheduler side: load once, save periodically, on request and at shutdown."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.path = ctx.args.anchor_pool
        self.interval = ctx.args.anchor_pool_interval
        self.model = json.loads(os.environ.get(MODEL_ENV, "null"))
        self.last_save = time.monotonic()
        self.saved_version = None
        self.num_saves = 0
        self.loaded_from: Optional[str] = None
        self.num_loaded = 0
        self._thread: Optional[threading.Thread] = None

    def header(self) -> Dict[str, Any]:
        return header(self.ctx.args, self.model)

    def load(self) -> int:
        """Load the anchors of ``load_path`` (own file, else seed; if any); returns how many."""
        path = load_path(self.ctx.args)
        if path is None:
            return 0
        n = store.load(path, self.header(), self.ctx._correctors, create=self.ctx.corrector)
        self.loaded_from, self.num_loaded = path, n
        # anchors from a seed are not in the own file yet: the first periodic save writes them
        self.saved_version = self.ctx.anchor_version() if path == self.path else None
        logger.info("kvshare: loaded %d anchors from %s", n, path)
        return n

    def save(self, wait: bool = True) -> bool:
        """Write the pools now (on a thread unless ``wait``); False when there is no path."""
        if not self.path:
            return False
        if self._thread is not None:
            self._thread.join()
        snapshot = {
            name: _Snapshot(c.state_dict()) for name, c in self.ctx._correctors.items() if hasattr(c, "state_dict")
        }
        head, path = self.header(), self.path
        self.saved_version = self.ctx.anchor_version()
        self.last_save = time.monotonic()
        self.num_saves += 1

        def write():
            try:
                store.save(path, head, snapshot)
            except OSError:
                logger.exception("kvshare: saving the anchor pools to %s failed", path)

        if wait:
            write()
        else:
            self._thread = threading.Thread(target=write, name="kvshare-anchor-save", daemon=True)
            self._thread.start()
        return True

    def install_signal_handlers(self) -> None:
        """Save, then die as the signal asks (scheduler process, main thread)."""
        if not self.path:
            return
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        state = {"exiting": False}

        def on_signal(signum, frame):
            if state["exiting"]:
                return
            state["exiting"] = True
            try:
                self.ctx.observer.collect()
                self.save(wait=True)
                logger.info("kvshare: anchor pools saved to %s before exit", self.path)
            finally:
                signal.signal(signum, previous[signum] if callable(previous[signum]) else signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        for sig in previous:
            signal.signal(sig, on_signal)

    def stats(self) -> Dict[str, Any]:
        """Saves so far and what was loaded (``/server_info``)."""
        return {
            "anchor_pool_saves": self.num_saves,
            "anchor_pool_loaded": {"path": self.loaded_from, "anchors": self.num_loaded},
        }

    def maybe_save(self) -> None:
        """Periodic save: when the interval passed and anchors changed since the last save."""
        if (
            self.path
            and time.monotonic() - self.last_save >= self.interval
            and self.ctx.anchor_version() != self.saved_version
        ):
            self.save(wait=False)


class _Snapshot:
    """A state dict taken in the scheduler thread, written by another."""

    def __init__(self, state) -> None:
        self._state = state

    def state_dict(self):
        return self._state
