"""The launcher's SGLang side (``python -m sglang_kvshare.launch_server``, main process, which is
also SGLang's HTTP process): SGLang's flags, its plugins, the hook check, the middleware on its
FastAPI app, and its server run."""

from __future__ import annotations

import os

import psutil
from sglang.launch_server import run_server
from sglang.srt.entrypoints.http_server import app
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.srt.utils import kill_process_tree

from sglang_kvshare.config import KVShareArgs
from sglang_kvshare.integration.hooks import check_hook_targets
from sglang_kvshare.integration.server import middleware

__all__ = [
    "add_server_cli_args",
    "check_hook_targets",
    "install_middleware",
    "load_plugins",
    "prepare_server_args",
    "serve",
]


def add_server_cli_args(parser) -> None:
    """SGLang's own server flags (for ``--help``)."""
    ServerArgs.add_cli_args(parser)


def install_middleware(args: KVShareArgs) -> None:
    """The annotated-request middleware on SGLang's FastAPI app (before the server starts)."""
    middleware.install(app, args)


def stop_children(timeout: float = 60.0) -> None:
    """SIGTERM this process's children (the schedulers save their anchor pools) and wait up to
    ``timeout`` seconds for them to exit."""
    children = psutil.Process().children()
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=timeout)


def serve(server_args, save_anchor_pools: bool) -> None:
    """Run SGLang's HTTP server until it stops; then its children are stopped (given time to
    save their anchor pools when ``save_anchor_pools``) and what is left is killed."""
    try:
        run_server(server_args)
    finally:
        if save_anchor_pools:
            stop_children()
        kill_process_tree(os.getpid(), include_parent=False)
