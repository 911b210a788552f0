"""``python -m sglang_kvshare.launch_server``: SGLang's own HTTP server with the plugin active.

Takes every SGLang server flag plus our ``--kvshare-*`` flags. With no ``--model-path`` it serves
the embedded default model (prepared once, see ``sglang_kvshare.assets``). On a machine without
CUDA it adds CPU defaults unless the flag is given: ``--device cpu``, the ``kvshare_torch``
attention backend, float32, no CUDA graphs, a bounded KV pool.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from sglang_kvshare.config import ENV_VAR, KVShareArgs

PROG = "python -m sglang_kvshare.launch_server"

CPU_DEFAULTS = (
    ("--device", "cpu"),
    ("--attention-backend", "kvshare_torch"),
    ("--dtype", "float32"),
    ("--max-total-tokens", "16384"),
    ("--disable-cuda-graph", None),
    ("--skip-server-warmup", None),
    # an idle scheduler otherwise busy-polls a whole core; it wakes on the next request
    ("--sleep-on-idle", None),
)
DEFAULTS = (
    ("--radix-cache-backend", "kvshare"),
    # NOTE: segment injection runs between prefill chunks; the overlap scheduler is untested there.
    ("--disable-overlap-schedule", None),
)


def has_flag(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def with_defaults(argv: Sequence[str], cuda: bool) -> list[str]:
    """``argv`` plus our defaults for every flag it does not set."""
    out = list(argv)
    if not has_flag(out, "--model-path"):
        from sglang_kvshare.assets import ensure_default_model

        out += ["--model-path", ensure_default_model()]
    for flag, value in DEFAULTS + (() if cuda else CPU_DEFAULTS):
        if not has_flag(out, flag):
            out += [flag] if value is None else [flag, value]
    return out


def split_args(argv: Sequence[str]) -> tuple[KVShareArgs, list[str]]:
    """Our ``--kvshare-*`` flags, and the rest for SGLang."""
    parser = argparse.ArgumentParser(add_help=False)
    KVShareArgs.add_cli_args(parser)
    ns, rest = parser.parse_known_args(list(argv))
    return KVShareArgs.from_cli_args(ns), rest


def print_help() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ServerArgs.add_cli_args(parser)
    KVShareArgs.add_cli_args(parser)
    parser.print_help()


def main(argv: Sequence[str] | None = None) -> None:
    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    kv_args, rest = split_args(argv)
    os.environ[ENV_VAR] = kv_args.to_env()
    cuda = torch.cuda.is_available()
    if not cuda:
        from sglang_kvshare.integration import cpu_shims

        cpu_shims.install()

    from sglang.srt.plugins import load_plugins

    load_plugins()
    if "-h" in argv or "--help" in argv:
        print_help()
        return

    from sglang.launch_server import run_server
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sglang_kvshare.integration import http

    http.install(app, kv_args)
    server_args = prepare_server_args(with_defaults(rest, cuda))
    if kv_args.lr_cache and (not server_args.enable_lora or server_args.attention_backend != "kvshare_torch"):
        sys.exit("--kvshare-lr-cache needs --enable-lora (with --lora-paths) and "
                 "--attention-backend kvshare_torch (the backend that holds the LR pool)")
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
