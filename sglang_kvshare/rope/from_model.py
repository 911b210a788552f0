"""The RoPE a loaded model applied to its cached keys, read off the model itself."""

from __future__ import annotations

from sglang_kvshare.rope.align import RopeSpec, inv_freq_for


def rope_spec_for_model(model, hf_config) -> RopeSpec:
    """The RoPE of ``model`` (a torch module tree whose first rotary embedding module has
    ``rotary_dim``, ``is_neox_style`` and ``base``), with the scaling of its ``hf_config``."""
    rotary = None
    for module in model.modules():
        if hasattr(module, "rotary_dim") and hasattr(module, "is_neox_style") and hasattr(module, "base"):
            rotary = module
            break
    if rotary is None:
        raise RuntimeError("kvshare: the model has no rotary embedding module it can re-align")
    scaling = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return RopeSpec(
        inv_freq=inv_freq_for(int(rotary.rotary_dim), float(rotary.base), scaling),
        rotary_dim=int(rotary.rotary_dim),
        is_neox=bool(rotary.is_neox_style),
    )
