"""Every SGLang target the plugin hooks or registers into must resolve: an upstream rename fails here."""

import importlib

import pytest

from sglang_kvshare.integration import double_batch, lr_cache, meta, recompute_path, scheduler_hooks

TARGETS = sorted(
    set(scheduler_hooks.TARGETS.values())
    | set(lr_cache.TARGETS.values())
    | set(double_batch.TARGETS.values())
    | set(recompute_path.TARGETS.values())
    | {meta.TARGET}
)

NAMES = [
    "sglang.srt.mem_cache.registry.register_radix_cache_backend",
    "sglang.srt.mem_cache.registry.get_radix_cache_factory",
    "sglang.srt.mem_cache.radix_cache.RadixCache.on_release",
    "sglang.srt.mem_cache.radix_cache.RadixCache.match_prefix",
    "sglang.srt.mem_cache.radix_cache.RadixCache.path_device_indices",
    "sglang.srt.mem_cache.allocation.alloc_token_slots",
    "sglang.srt.mem_cache.allocation.alloc_paged_token_slots_extend",
    "sglang.srt.layers.attention.attention_registry.register_attention_backend",
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend",
    "sglang.srt.server_args.add_attention_backend_choices",
    "sglang.srt.managers.schedule_policy._PrefillAdmission",
    "sglang.srt.managers.schedule_policy.AddReqResult.OTHER",
    "sglang.srt.entrypoints.http_server.get_global_state",
]


def resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("target", TARGETS + NAMES)
def test_target_resolves(target):
    assert resolve(target) is not None


def test_admission_record_has_the_fields_we_rebuild():
    from sglang.srt.managers.schedule_policy import _PrefillAdmission

    assert _PrefillAdmission.__dataclass_fields__.keys() == {
        "prefix_len", "extend_len", "max_new_tokens", "is_chunked", "replay_len"
    }


def test_plugin_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("kvshare") == "sglang_kvshare.integration.plugin:load"


def test_wrong_sglang_version_is_a_clear_error(monkeypatch):
    import sglang_kvshare

    monkeypatch.setattr(sglang_kvshare._metadata, "version", lambda name: "0.4.0")
    with pytest.raises(ImportError, match="supports sglang==0.5.23 only"):
        sglang_kvshare.check_sglang_version()
