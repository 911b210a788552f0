"""sglang_kvshare: cross-agent KV cache sharing for multi-agent serving on SGLang.

Only ``sglang_kvshare.integration`` imports SGLang internals; everything else is plain torch.
"""

from importlib import metadata as _metadata

__version__ = "0.1.0"
SGLANG_VERSION = "0.5.23"


def check_sglang_version() -> None:
    """Raise a clear error unless exactly the supported SGLang release is installed."""
    try:
        found = _metadata.version("sglang")
    except _metadata.PackageNotFoundError:
        raise ImportError(
            f"sglang_kvshare needs sglang=={SGLANG_VERSION}, but sglang is not installed; run scripts/setup.sh"
        ) from None
    if found != SGLANG_VERSION:
        raise ImportError(
            f"sglang_kvshare supports sglang=={SGLANG_VERSION} only, found sglang=={found}; run scripts/setup.sh"
        )
