"""Which adapters the engine's LR cache serves (``lora_cache.targets``), read off PEFT configs."""

import json
from pathlib import Path

from sglang_kvshare.lora_cache.targets import adapts_keys, check_lora_paths, lora_path_entries, lr_cache_refusal

ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"


def cfg(targets, **extra):
    return {"r": 8, "lora_alpha": 16, "target_modules": targets, **extra}


def test_qv_qkvo_and_mlp_adapters_are_served():
    for targets in (
        ["q_proj", "v_proj"],
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        ["model.layers.0.self_attn.k_proj"],
        ["q_proj", "gate_proj", "up_proj", "down_proj"],
    ):
        assert lr_cache_refusal("a", cfg(targets)) is None, targets
    assert adapts_keys(cfg(["q_proj", "model.layers.3.self_attn.k_proj"]))
    assert not adapts_keys(cfg(["q_proj", "v_proj"])) and not adapts_keys(cfg("all-linear"))


def test_unservable_adapters_are_refused_by_name_and_reason():
    cases = {
        "fused": (cfg(["qkv_proj"]), "qkv_proj"),
        "emb": (cfg(["q_proj", "embed_tokens"]), "embed_tokens"),
        "short": (cfg("all-linear"), "shorthand"),
        "ranks": (cfg(["k_proj"], rank_pattern={"k_proj": 4}), "rank_pattern"),
        "dora": (cfg(["v_proj"], use_dora=True), "DoRA"),
    }
    for name, (c, why) in cases.items():
        msg = lr_cache_refusal(name, c)
        assert msg is not None and f"adapter {name!r}" in msg and why in msg, msg


def test_lora_paths_entries_and_shipped_adapters(tmp_path):
    assert list(lora_path_entries(["a=/x", "/y", {"lora_name": "c", "lora_path": "/z"}])) == [
        ("a", "/x"),
        ("/y", "/y"),
        ("c", "/z"),
    ]
    shipped = [f"{d.name}={d}" for d in sorted(ADAPTERS.iterdir()) if d.is_dir()]
    assert any("qkvo" in s for s in shipped)
    assert check_lora_paths(shipped) == []  # QV and QKVO role adapters
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps(cfg(["q_proj", "lm_head"])))
    problems = check_lora_paths([f"critic={bad}", "hub-id/not-here"])
    assert len(problems) == 1 and "'critic'" in problems[0] and "lm_head" in problems[0]
