"""Trained adapters in adapters/ through the LR cache: PEFT layout and scaling, and LR-split
attention equal to PEFT's own attention on the real SmolLM2 model (layer 0)."""

from pathlib import Path

import pytest
import torch

from sglang_kvshare.lora_cache import flash_lora_attention, load_peft_adapter, lr_values
from sglang_kvshare.rope.align import RopeSpec, inv_freq_for, shift_keys

torch.set_num_threads(1)
ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"
QV = ADAPTERS / "smollm2-critic-qv-r8"
QKVO = ADAPTERS / "smollm2-solver-qkvo-r8"


@pytest.mark.skipif(not QV.is_dir() or not QKVO.is_dir(), reason="trained adapters missing")
def test_peft_adapter_layout():
    qv, qkvo = load_peft_adapter(QV), load_peft_adapter(QKVO)
    assert {p for _, p in qv} == {"q_proj", "v_proj"} and len(qv) == 2 * 30
    assert {p for _, p in qkvo} == {"q_proj", "k_proj", "v_proj", "o_proj"} and len(qkvo) == 4 * 30
    v0 = qv[(0, "v_proj")]
    assert v0.A.shape == (8, 576) and v0.B.shape == (8, 3 * 64) and v0.scaling == 2.0
    assert v0.B.abs().max() > 0  # trained: B moved away from its zero init


@pytest.mark.slow
@pytest.mark.skipif(not QV.is_dir(), reason="trained adapters missing")
def test_lr_split_equals_peft_attention_real_model():
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_kvshare.assets import ensure_default_model

    path = ensure_default_model(progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, str(QV)).eval()
    attn = model.get_base_model().model.layers[0].self_attn
    seen = {}
    h1 = (
        model.get_base_model()
        .model.layers[0]
        .input_layernorm.register_forward_hook(lambda m, i, o: seen.__setitem__("x", o[0]))
    )
    h2 = attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("o", a[0][0]))
    ids = tok("Question: Tom has 3 apples and buys 4 more. How many?", return_tensors="pt")
    with torch.no_grad():
        model(**ids)
        h1.remove(), h2.remove()
        x = seen["x"]  # [T, 576]
        T, Hq, Hkv, D = x.shape[0], 9, 3, 64
        cfg = base.config
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or cfg.rope_theta
        rope = RopeSpec(inv_freq_for(D, float(theta)), D, is_neox=True)
        pos = torch.arange(T)
        q = shift_keys(attn.q_proj(x).view(T, Hq, D), pos, rope)  # PEFT q_proj: base + LoRA
        k = shift_keys(attn.k_proj(x).view(T, Hkv, D), pos, rope)
        v_base = attn.v_proj.base_layer(x).view(T, Hkv, D)
        ad = load_peft_adapter(QV)[(0, "v_proj")]
        lr = lr_values(x, ad.A, ad.scaling)
        out = flash_lora_attention(q, k, v_base, lr, ad.B).reshape(T, Hq * D)
        torch.testing.assert_close(out, seen["o"], atol=1e-4, rtol=1e-4)
        no_lr = flash_lora_attention(q, k, v_base, None, None).reshape(T, Hq * D)
        assert (no_lr - seen["o"]).abs().max() > 1e-4
