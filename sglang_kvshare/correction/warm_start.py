"""Warm start (``--kvshare-anchor-pool PATH``): the anchor pool file's identity and checks.

- The launcher (main process) checks an existing file before SGLang starts: a corrupt file or
  one written for another model, rank or anchor dtype stops the server with a message naming the
  difference, and the file is left as it is (:func:`check_file`).
- ``--kvshare-anchor-pool-seed SEED``: another server's file (a new or restarted worker behind a
  router starts warm from a sibling's pools). It is only read, must exist and pass the same
  checks, and is loaded when the server's own file does not exist yet (:func:`load_path`).
- The scheduler loads, saves periodically, on request (``POST /set_internal_state
  {"server_args": {"kvshare_save_anchor_pool": 1}}``, :data:`SAVE_KEY`) and at shutdown
  (``integration/state/anchor_pool_file.py``).

The model identity is the shape of its configuration (:func:`model_identity`), passed from the
launcher to the scheduler processes in ``SGLANG_KVSHARE_MODEL`` (:data:`MODEL_ENV`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Optional

from sglang_kvshare.correction import store

MODEL_ENV = "SGLANG_KVSHARE_MODEL"
SAVE_KEY = "kvshare_save_anchor_pool"
_CONFIG_KEYS = (
    "architectures",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rope_theta",
    "max_position_embeddings",
)


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
    model = model_identity(model_path)
    for flag, path, required in (
        ("--kvshare-anchor-pool", args.anchor_pool, False),
        ("--kvshare-anchor-pool-seed", args.anchor_pool_seed, True),
    ):
        if not path or not (required or os.path.exists(path)):
            continue
        if not os.path.exists(path):
            raise store.AnchorPoolFileError(
                f"{flag}: {path} does not exist (a seed is only read: give a file that a server saved "
                f"with --kvshare-anchor-pool, or leave the flag out for a cold start)"
            )
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
