"""Every SGLang target the plugin hooks or registers into must resolve, and every hooked target
must still have the parameters its hook relies on: an upstream rename or signature change fails
here (and at startup, ``hooks.check_hook_targets``)."""

import dataclasses

import pytest

from sglang_kvshare.integration.hooks import all_hooks, check_hook_targets
from sglang_kvshare.integration.hookspec import check, resolve

HOOKS = all_hooks()
TARGETS = [hook.target for hook in HOOKS]

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


@pytest.mark.parametrize("target", TARGETS + NAMES)
def test_target_resolves(target):
    assert resolve(target) is not None


def test_every_hooked_target_has_one_hook_whose_expected_signature_matches():
    assert len(TARGETS) == len(set(TARGETS)) == 22
    assert all(hook.params for hook in HOOKS)
    check_hook_targets()


def test_a_changed_signature_fails_with_the_targets_name(monkeypatch):
    from sglang.srt.managers.schedule_policy import PrefillAdder

    hook = next(h for h in HOOKS if h.target == "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req")
    monkeypatch.setattr(PrefillAdder, "add_chunked_req", lambda self, request, limit: None)
    with pytest.raises(RuntimeError, match="PrefillAdder.add_chunked_req has parameters"):
        check([hook])
    monkeypatch.delattr(PrefillAdder, "add_chunked_req")
    with pytest.raises(RuntimeError, match="PrefillAdder.add_chunked_req does not exist"):
        check([hook])


def test_a_target_hooked_twice_is_refused():
    hook = HOOKS[0]
    with pytest.raises(RuntimeError, match="hooked twice"):
        check([hook, dataclasses.replace(hook, fn=lambda *a: None)])


def test_admission_record_has_the_fields_we_rebuild():
    from sglang.srt.managers.schedule_policy import _PrefillAdmission

    assert _PrefillAdmission.__dataclass_fields__.keys() == {
        "prefix_len",
        "extend_len",
        "max_new_tokens",
        "is_chunked",
        "replay_len",
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
