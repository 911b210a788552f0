"""``python -m sglang_kvshare.launch_server``: SGLang's own HTTP server with the plugin active.

Takes every SGLang server flag plus our ``--kvshare-*`` flags. With no ``--model-path`` it serves
the embedded default model (prepared once, see ``sglang_kvshare.assets``). On a machine without
CUDA it adds CPU defaults unless the flag is given: ``--device cpu``, the ``kvshare_torch``
attention backend, float32, no CUDA graphs, a bounded KV pool, and ``--lora-backend torch_native``
when LoRA is on. Flags the server cannot take (``REFUSED``) stop it with a message naming the flag.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from sglang_kvshare.config import ENV_VAR, KVShareArgs
from sglang_kvshare.correction import warm_start
from sglang_kvshare.correction.store import AnchorPoolFileError
from sglang_kvshare.lora_cache.targets import check_lora_paths

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


# The LoRA kernel backends of SGLang 0.5.23 that run without CUDA: csgmv (its default), triton and
# triton_v2 pin host memory per batch (also under TRITON_INTERPRET), ascend is for NPUs.
CPU_LORA_BACKENDS = ("torch_native",)
CPU_LORA_DEFAULTS = (("--lora-backend", "torch_native"),)  # when --enable-lora or --lora-paths is given
LORA_FLAGS = ("--enable-lora", "--lora-paths")


def _positive(value: str) -> bool:
    try:
        return int(value) > 0
    except ValueError:
        return True  # not a number: SGLang's parser says so


# Flags the server cannot take: (the flag and its aliases, whether it can take a value (None: it
# cannot be given at all; a missing value is left to SGLang's parser), refused only without CUDA,
# why). Each would otherwise fail in a
# scheduler subprocess (at startup, or on the first request or injection) with a traceback.
REFUSED = (
    (
        ("--lora-backend",),
        lambda v: v in CPU_LORA_BACKENDS,
        True,
        "SGLang's other LoRA backends need CUDA; leave the flag out (torch_native is the CPU default)",
    ),
    (
        ("--radix-cache-backend",),
        lambda v: v == "kvshare",
        False,
        "the plugin keeps shared KV in its own radix cache (kvshare, the default); "
        "for another cache serve without the plugin (python -m sglang.launch_server)",
    ),
    (
        ("--disable-radix-cache",),
        None,
        False,
        "the plugin keeps shared KV in the radix cache; for a server without one use python -m sglang.launch_server",
    ),
    (
        ("--enable-hierarchical-cache", "--enable-hicache"),
        None,
        False,
        "the plugin's radix cache (kvshare) has no hierarchical (host-memory) tier",
    ),
    (
        ("--chunked-prefill-size",),
        _positive,
        False,
        "shared segments are injected between prefill chunks; give a size > 0 or leave the flag out",
    ),
)


def has_flag(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def without_flag(argv: Sequence[str], flag: str) -> list[str]:
    """``argv`` without any ``flag VALUE`` or ``flag=VALUE``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` or ``flag=VALUE`` in ``argv`` (None if absent)."""
    value = None
    for i, a in enumerate(argv):
        if a.startswith(flag + "="):
            value = a[len(flag) + 1 :]
        elif a == flag and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def check_flags(argv: Sequence[str], cuda: bool) -> None:
    """Exit with a message naming the first flag of ``argv`` (ours to SGLang) that ``REFUSED`` lists."""
    for names, ok, cpu_only, why in REFUSED:
        if cpu_only and cuda:
            continue
        for name in names:
            value = flag_value(argv, name)
            if has_flag(argv, name) and (ok is None or (value is not None and not ok(value))):
                given = name if ok is None else f"{name} {value}"
                sys.exit(f"{PROG}: {given} is not supported{' without CUDA' if cpu_only else ''}: {why}")


def with_defaults(argv: Sequence[str], cuda: bool) -> list[str]:
    """``argv`` plus our defaults for every flag it does not set."""
    out = list(argv)
    if not has_flag(out, "--model-path"):
        from sglang_kvshare.assets import ensure_default_model

        out += ["--model-path", ensure_default_model()]
    defaults = DEFAULTS if cuda else DEFAULTS + CPU_DEFAULTS
    if not cuda and any(has_flag(out, f) for f in LORA_FLAGS):
        defaults += CPU_LORA_DEFAULTS
    for flag, value in defaults:
        if not has_flag(out, flag):
            out += [flag] if value is None else [flag, value]
    return out


def split_args(argv: Sequence[str]) -> tuple[KVShareArgs, list[str]]:
    """Our ``--kvshare-*`` flags, and the rest for SGLang."""
    parser = argparse.ArgumentParser(add_help=False)
    KVShareArgs.add_cli_args(parser)
    ns, rest = parser.parse_known_args(list(argv))
    return KVShareArgs.from_cli_args(ns), rest


def print_help(launch) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    launch.add_server_cli_args(parser)
    for action in parser._actions:  # SGLang requires a model; this launcher has a default
        if "--model-path" in action.option_strings:
            action.required = False
            action.help = (
                (action.help or "").rstrip() + " (default here: the embedded "
                "SmolLM2-135M-Instruct, prepared on first use)"
            ).lstrip()
    KVShareArgs.add_cli_args(parser)
    parser.print_help()


def main(argv: Sequence[str] | None = None) -> None:
    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        kv_args, rest = split_args(argv)
    except ValueError as e:  # a --kvshare-* value out of range
        sys.exit(f"{PROG}: {e}")
    os.environ[ENV_VAR] = kv_args.to_env()
    cuda = torch.cuda.is_available()
    help_asked = "-h" in argv or "--help" in argv
    if not help_asked:
        check_flags(rest, cuda)
    if not cuda:
        from sglang_kvshare.integration import cpu_shims

        cpu_shims.install()
    from sglang_kvshare.integration import launch  # SGLang's modules: after the CPU shims

    launch.load_plugins()
    if help_asked:
        print_help(launch)
        return
    try:  # an SGLang whose hooked functions changed stops here, naming the function
        launch.check_hook_targets()
    except RuntimeError as e:
        sys.exit(f"{PROG}: {e}")
    launch.install_middleware(kv_args)
    sglang_argv = with_defaults(rest, cuda)
    if kv_args.anchor_pool or kv_args.anchor_pool_seed:
        try:
            model = warm_start.check_file(kv_args, flag_value(sglang_argv, "--model-path"))
        except AnchorPoolFileError as e:  # the message starts with the flag
            sys.exit(f"{PROG}: {e}")
        os.environ[warm_start.MODEL_ENV] = json.dumps(model)
    print(f"{PROG}: defaults added: {' '.join(sglang_argv[len(rest) :])}", file=sys.stderr, flush=True)
    server_args = launch.prepare_server_args(sglang_argv)
    if kv_args.lr_cache and (not server_args.enable_lora or server_args.attention_backend != "kvshare_torch"):
        sys.exit(
            "--kvshare-lr-cache needs --enable-lora (with --lora-paths) and "
            "--attention-backend kvshare_torch (the backend that holds the LR pool)"
        )
    if kv_args.lr_cache:
        problems = check_lora_paths(server_args.lora_paths)
        if problems:
            sys.exit(f"{PROG}: " + f"\n{PROG}: ".join(problems))
    launch.serve(server_args, save_anchor_pools=bool(kv_args.anchor_pool))


if __name__ == "__main__":
    main()
