"""Registry of sharing methods: one name per method, as the papers name them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MethodSpec:
    """What the engine does for the shared (PH) segments of a request under this method.

    injects: PH segments whose source cache exists are injected instead of computed.
    corrector: name in ``sglang_kvshare.correction`` applied to injected caches (None: as is).
    """

    name: str
    injects: bool
    description: str
    corrector: str | None = None


METHODS: dict[str, MethodSpec] = {
    m.name: m
    for m in (
        MethodSpec("nonshared", False, "every agent prefills its whole prompt (stock SGLang)"),
        MethodSpec(
            "fullshared",
            True,
            "inject the source agent's cache of each shared segment, RoPE re-aligned, uncorrected",
        ),
    )
}


def method_names() -> list[str]:
    return list(METHODS)


def get_method(name: str) -> MethodSpec:
    """The method called ``name``; raises KeyError naming the known methods."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(
            f"unknown kvshare method {name!r}; known methods: {', '.join(METHODS)}"
        ) from None
