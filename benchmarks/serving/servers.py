"""The servers of a run: which methods run on which server (``server_groups``), and running each
group's phases on its server, started here when no URL was given (``run_on_servers``)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

import requests

from benchmarks.serving.memory import find_server_pid
from benchmarks.serving.results import Part
from benchmarks.serving.sweeps import run_methods
from benchmarks.serving.workload import LORA_KINDS, PLAIN_LORA_METHODS, lora_server_args


class ServerGroup(NamedTuple):
    """Methods run on one server: its URL (None: start one) and its launch_server flags."""

    name: str
    methods: List[str]
    url: Optional[str]
    flags: List[str]


def server_groups(args, adapters: Optional[Dict[str, str]] = None) -> List[ServerGroup]:
    """One group per server of the run, in order: one server (or one per method with
    ``--server-per-method``); for LoRA agents the LR-cache server, then a plain LoRA server for
    PLAIN_LORA_METHODS (``adapters``: name -> path, instead of the shipped ones)."""
    if args.agent_kind not in LORA_KINDS:
        if args.server_per_method:
            return [ServerGroup(m, [m], None, list(args.server_arg)) for m in args.methods]
        return [ServerGroup("main", args.methods, args.url, list(args.server_arg))]
    lora_flags = list(lora_server_args())
    if adapters:
        cut = lora_flags.index("--lora-paths")
        lora_flags = lora_flags[:cut] + ["--lora-paths", *(f"{n}={p}" for n, p in adapters.items())]
        lora_flags[lora_flags.index("--max-loras-per-batch") + 1] = str(max(4, len(adapters) + 1))  # + the base model
    plain = [m for m in args.methods if m in PLAIN_LORA_METHODS]
    groups = [
        ServerGroup("lr-cache", [m for m in args.methods if m not in plain], args.url, lora_flags),
        ServerGroup("plain-lora", plain, args.plain_lora_url, [a for a in lora_flags if a != "--kvshare-lr-cache"]),
    ]
    return [g._replace(flags=g.flags + args.server_arg) for g in groups if g.methods]


@dataclass(frozen=True)
class ServerInfo:
    """A server of the run, as the JSON's ``servers`` lists it."""

    name: str
    methods: List[str]
    url: str
    flags: List[str]
    model_path: Optional[str]
    started_here: bool
    pid: Optional[int]  # for the RSS (found from the URL's port when not started here)
    log: Optional[str]  # of a server started here


def run_on_servers(args, adapters: Optional[Dict[str, str]], bar) -> Tuple[List[Part], List[ServerInfo]]:
    """Each group's phases on its server (a server started here is stopped after its group)."""
    from transformers import AutoTokenizer

    parts: List[Part] = []
    servers: List[ServerInfo] = []
    for gi, group in enumerate(server_groups(args, adapters)):
        server, log_dir, url = None, None, group.url
        if url is None:
            from sglang_kvshare.testing.server import Server

            log_dir = Path(tempfile.mkdtemp(prefix="serving-"))
            argv = ["-m", "sglang_kvshare.launch_server"]
            if args.model_path:
                argv += ["--model-path", args.model_path]
            bar.set_description(f"starting the {group.name} server")
            server = Server(argv + group.flags, log_dir / "server.log", timeout=900)
            url = server.url
        url = url.rstrip("/")
        try:
            info = requests.get(url + "/get_model_info", timeout=30).json()
            tok = AutoTokenizer.from_pretrained(info.get("tokenizer_path") or info["model_path"])
            pid = server.proc.pid if server else ((args.server_pid if gi == 0 else None) or find_server_pid(url))
            log = str(log_dir / "server.log") if log_dir else None
            servers.append(
                ServerInfo(
                    group.name, group.methods, url, group.flags, info.get("model_path"), server is not None, pid, log
                )
            )
            first = gi == 0 or args.server_per_method
            parts.append(run_methods(args, url, pid, tok, group.methods, bar, first=first))
        finally:
            if server is not None:
                server.stop()
    return parts, servers
