"""The launcher's argv logic (``sglang_kvshare.launch_server``): defaults and refused flags, no server."""

import subprocess
import sys

import pytest

from sglang_kvshare.launch_server import PROG, check_flags, flag_value, with_defaults

MODEL = ["--model-path", "/models/tiny"]
LORA = ["--enable-lora", "--lora-paths", "a=/ad/a", "b=/ad/b"]


def test_cpu_lora_defaults_to_the_torch_native_backend():
    for lora in (LORA, ["--lora-paths", "a=/ad/a"], ["--enable-lora"]):
        out = with_defaults(MODEL + lora, cuda=False)
        assert flag_value(out, "--lora-backend") == "torch_native"
        assert out[: len(MODEL + lora)] == MODEL + lora  # the user's flags first, unchanged


def test_no_lora_backend_without_lora_or_on_cuda_or_when_chosen():
    assert "--lora-backend" not in with_defaults(MODEL, cuda=False)
    assert "--lora-backend" not in with_defaults(MODEL + LORA, cuda=True)
    out = with_defaults(MODEL + LORA + ["--lora-backend=torch_native"], cuda=False)
    assert sum(a.startswith("--lora-backend") for a in out) == 1


def test_other_defaults_unchanged():
    cpu = with_defaults(MODEL, cuda=False)
    assert flag_value(cpu, "--device") == "cpu" and flag_value(cpu, "--radix-cache-backend") == "kvshare"
    assert "--disable-overlap-schedule" in cpu
    gpu = with_defaults(MODEL, cuda=True)
    assert "--device" not in gpu and flag_value(gpu, "--radix-cache-backend") == "kvshare"
    assert flag_value(with_defaults(MODEL + ["--dtype", "bfloat16"], cuda=False), "--dtype") == "bfloat16"


def test_flag_value():
    assert flag_value(["--x", "1", "--y"], "--x") == "1"
    assert flag_value(["--x=2"], "--x") == "2"
    assert flag_value(["--x", "1", "--x=3"], "--x") == "3"
    assert flag_value(["--xy", "1"], "--x") is None


@pytest.mark.parametrize(
    "argv,cuda,named",
    [
        (["--lora-backend", "csgmv"], False, "--lora-backend csgmv"),
        (["--lora-backend=triton"], False, "--lora-backend triton"),
        (["--lora-backend", "triton_v2"], False, "--lora-backend triton_v2"),
        (["--lora-backend", "ascend"], False, "--lora-backend ascend"),
        (["--radix-cache-backend", "lru_tree"], True, "--radix-cache-backend lru_tree"),
        (["--disable-radix-cache"], False, "--disable-radix-cache"),
        (["--disable-radix-cache"], True, "--disable-radix-cache"),
        (["--enable-hierarchical-cache"], True, "--enable-hierarchical-cache"),
        (["--enable-hicache"], False, "--enable-hicache"),
        (["--chunked-prefill-size", "-1"], False, "--chunked-prefill-size -1"),
        (["--chunked-prefill-size=0"], True, "--chunked-prefill-size 0"),
    ],
)
def test_refused_flags_exit_with_a_message_naming_the_flag(argv, cuda, named):
    with pytest.raises(SystemExit) as e:
        check_flags(MODEL + argv, cuda)
    assert isinstance(e.value.code, str)  # sys.exit(message): printed, exit status 1
    assert e.value.code.startswith(PROG) and named in e.value.code


@pytest.mark.parametrize(
    "argv,cuda",
    [
        (MODEL, False),
        (MODEL + LORA, False),
        (MODEL + LORA + ["--lora-backend", "torch_native"], False),
        (MODEL + LORA + ["--lora-backend", "csgmv"], True),
        (MODEL + LORA + ["--enable-lora-overlap-loading", "--max-loaded-loras", "8"], False),
        (MODEL + ["--radix-cache-backend", "kvshare", "--chunked-prefill-size", "16"], False),
        (MODEL + ["--chunked-prefill-size", "64", "--enable-mixed-chunk", "--disable-overlap-schedule"], False),
        (MODEL + ["--chunked-prefill-size"], False),  # no value: SGLang's parser reports it
    ],
)
def test_accepted_flags(argv, cuda):
    check_flags(argv, cuda)


def test_auto_sharing_flags():
    import argparse

    from sglang_kvshare.config import KVShareArgs

    parser = argparse.ArgumentParser()
    KVShareArgs.add_cli_args(parser)
    args = KVShareArgs.from_cli_args(parser.parse_args([]))
    assert (args.auto, args.auto_min_tokens, args.auto_scope) == ("off", 64, "request")
    args = KVShareArgs.from_cli_args(parser.parse_args(["--kvshare-auto", "kvcmas", "--kvshare-auto-scope", "server"]))
    assert (args.auto, args.auto_scope) == ("kvcmas", "server")
    with pytest.raises(SystemExit):
        parser.parse_args(["--kvshare-auto", "bogus"])
    with pytest.raises(ValueError, match="--kvshare-auto must be"):
        KVShareArgs(auto="prelr_shared")  # an LR-cache method needs --kvshare-lr-cache
    with pytest.raises(ValueError, match="--kvshare-auto-min-tokens"):
        KVShareArgs(auto_min_tokens=0)


def test_fallback_flags():
    import argparse

    from sglang_kvshare.config import KVShareArgs

    parser = argparse.ArgumentParser()
    KVShareArgs.add_cli_args(parser)
    default = KVShareArgs.from_cli_args(parser.parse_args([]))
    assert (default.fallback, default.fallback_block) == ("rows", 64)  # chosen by measurement
    args = KVShareArgs.from_cli_args(
        parser.parse_args(["--kvshare-fallback", "dense", "--kvshare-fallback-block", "256"])
    )
    assert (args.fallback, args.fallback_block) == ("dense", 256)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kvshare-fallback", "partial"])
    with pytest.raises(ValueError, match="--kvshare-fallback-block must be >= 1"):
        KVShareArgs(fallback_block=0)


@pytest.mark.parametrize(
    "flag,default,other,bad_cli,bad_value,message",
    [("leaf_policy", "pressure", "always", "never", "sometimes", "'pressure' or 'always'")],
)
def test_choice_flags(flag, default, other, bad_cli, bad_value, message):
    import argparse

    from sglang_kvshare.config import KVShareArgs

    option = "--kvshare-" + flag.replace("_", "-")
    parser = argparse.ArgumentParser()
    KVShareArgs.add_cli_args(parser)
    assert getattr(KVShareArgs.from_cli_args(parser.parse_args([])), flag) == default
    assert getattr(KVShareArgs.from_cli_args(parser.parse_args([option, other])), flag) == other
    with pytest.raises(SystemExit):
        parser.parse_args([option, bad_cli])
    with pytest.raises(ValueError, match=f"{option} must be {message}"):
        KVShareArgs(**{flag: bad_value})


@pytest.mark.parametrize("flag", ["kv_views", "keep_freed_memory", "lr_cache"])
def test_switches_are_spelled_one_way(flag):
    """Every on/off flag is --kvshare-x / --no-kvshare-x (argparse rejects a value after it)."""
    import argparse
    import dataclasses

    from sglang_kvshare.config import KVShareArgs

    fields = {f.name: f for f in dataclasses.fields(KVShareArgs)}
    default = fields[flag].default
    assert isinstance(default, bool)
    option = "--kvshare-" + flag.replace("_", "-")
    parser = argparse.ArgumentParser()
    KVShareArgs.add_cli_args(parser)
    parse = lambda *argv: getattr(KVShareArgs.from_cli_args(parser.parse_args(list(argv))), flag)  # noqa: E731
    assert parse() is default
    assert parse(option) is True and parse(option.replace("--", "--no-", 1)) is False
    with pytest.raises(SystemExit):
        parser.parse_args([option, "off"])
    bools = [
        f.name
        for f in dataclasses.fields(KVShareArgs)
        if f.metadata.get("choices") is not None and set(f.metadata["choices"]()) == {"on", "off"}
    ]
    assert bools == [], f"on/off choice flags left: {bools}"


_RSS_AFTER_FREE = """
import sys, torch
from sglang_kvshare.integration.cpu_shims import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
before = rss_mb()
x = torch.ones(64 << 18)  # 64 MiB, above glibc's largest default mmap threshold (32 MiB)
del x
print(rss_mb() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_keeps_a_freed_tensor_in_the_process():
    """With glibc's defaults a freed 64 MiB tensor goes back to the system (the next one
    page-faults again); after ``keep_freed_memory`` it stays for reuse."""
    kept = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _RSS_AFTER_FREE, mode], capture_output=True, text=True, check=True)
        kept[mode] = float(out.stdout.split()[-1])
    assert kept["default"] < 16 and kept["keep"] > 48, kept


def test_every_flag_is_in_one_help_group_with_its_default_and_in_the_docs_table():
    import argparse
    import dataclasses
    from pathlib import Path

    from sglang_kvshare.config import GROUPS, KVShareArgs, flag_table

    names = [n for group in GROUPS.values() for n in group]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(KVShareArgs)) and len(set(names)) == len(names)
    parser = argparse.ArgumentParser()
    KVShareArgs.add_cli_args(parser)
    groups = {g.title: g for g in parser._action_groups if g.title.startswith("kvshare: ")}
    assert list(groups) == [f"kvshare: {t}" for t in GROUPS]
    for action in (a for g in groups.values() for a in g._group_actions):
        assert "(default: " in action.help, action.option_strings
    docs = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    table = docs.split("<!-- flags:begin -->\n")[1].split("<!-- flags:end -->")[0]
    assert table == flag_table(), "docs/usage.md's flag table is stale: python -m sglang_kvshare.config"
