"""Warm start (``--kvshare-anchor-pool PATH``): the anchor pools survive a restart.

- The launcher (main process) checks an existing file before SGLang starts: a corrupt file or
  one written for another model, rank or anchor dtype stops the server with a message naming the
  difference, and the file is left as it is (``check_file``).
- ``--kvshare-anchor-pool-seed SEED``: another server's file (a new or restarted worker behind a
  router starts warm from a sibling's pools). It is only read, must exist and pass the same
  checks, and is loaded when the server's own file does not exist yet (``load_path``).
- The scheduler loads it when its radix cache is built, saves it every
  ``--kvshare-anchor-pool-interval`` seconds when anchors changed (written on a thread from a
  snapshot: factors are immutable, so the snapshot is a list of references), on request
  (``POST /set_internal_state {"server_args": {"kvshare_save_anchor_pool": 1}}``), and when it
  is told to stop (SIGTERM or SIGINT: Ctrl-C reaches the whole process group, and the launcher
  sends SIGTERM to its children and waits for them before it kills what is left).

The model identity is the shape of its configuration (``model_identity``), passed from the
launcher to the scheduler processes in ``SGLANG_KVSHARE_MODEL``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

logger = logging.getLogger(__name__)

MODEL_ENV = "SGLANG_KVSHARE_MODEL"
SAVE_KEY = "kvshare_save_anchor_pool"
_CONFIG_KEYS = ("architectures", "num_hidden_layers", "hidden_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rope_theta", "max_position_embeddings")


def model_identity(model_path: str) -> Dict[str, Any]:
    """What anchors depend on: the model directory's name and its configuration's shape."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path).to_dict()
    ident = {k: cfg.get(k) for k in _CONFIG_KEYS}
    ident["name"] = Path(model_path.rstrip("/")).name
    return json.loads(json.dumps(ident))  # plain JSON values (tuples become lists)


def header(args, model: Dict[str, Any]) -> Dict[str, Any]:
    return {"model": model, "rank": args.rank, "anchor_dtype": args.anchor_dtype}


def check_file(args, model_path: str) -> Dict[str, Any]:
    """Launcher side: the model identity to hand to the schedulers; raises
    ``AnchorPoolFileError`` (its message starts with the flag) when an existing
    ``args.anchor_pool`` or the ``args.anchor_pool_seed`` (which must exist) does not fit this
    server. The seed is checked even when the server's own file will be loaded instead."""
    from sglang_kvshare.correction import store

    model = model_identity(model_path)
    for flag, path, required in (("--kvshare-anchor-pool", args.anchor_pool, False),
                                 ("--kvshare-anchor-pool-seed", args.anchor_pool_seed, True)):
        if not path or not (required or os.path.exists(path)):
            continue
        if not os.path.exists(path):
            raise store.AnchorPoolFileError(
                f"{flag}: {path} does not exist (a seed is only read: give a file that a server saved "
                f"with --kvshare-anchor-pool, or leave the flag out for a cold start)")
        try:
            payload = store.read(path)
            store.check_header(path, payload["header"], header(args, model))
        except store.AnchorPoolFileError as e:
            raise store.AnchorPoolFileError(f"{flag}: {e}; the file was left unchanged") from None
    return model


def load_path(args) -> Optional[str]:
    """The file a server starts from: its own ``--kvshare-anchor-pool`` file once that exists,
    else the seed (None: a cold start)."""
    for path in (args.anchor_pool, args.anchor_pool_seed):
        if path and os.path.exists(path):
            return path
    return None


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
        from sglang_kvshare.correction import store

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
        from sglang_kvshare.correction import store

        if not self.path:
            return False
        if self._thread is not None:
            self._thread.join()
        snapshot = {name: _Snapshot(c.state_dict()) for name, c in self.ctx._correctors.items()
                    if hasattr(c, "state_dict")}
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
        import signal

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

    def maybe_save(self) -> None:
        """Periodic save: when the interval passed and anchors changed since the last save."""
        if self.path and time.monotonic() - self.last_save >= self.interval \
                and self.ctx.anchor_version() != self.saved_version:
            self.save(wait=False)


class _Snapshot:
    """A state dict taken in the scheduler thread, written by another."""

    def __init__(self, state) -> None:
        self._state = state

    def state_dict(self):
        return self._state


def stop_children(timeout: float = 60.0) -> None:
    """Launcher side: SIGTERM this process's children (the schedulers save their anchor pools)
    and wait up to ``timeout`` seconds for them to exit."""
    import psutil

    children = psutil.Process().children()
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=timeout)
