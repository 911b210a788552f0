"""How a hook on a (private) SGLang function is declared: once, where it is written.

A side's :class:`HookSet` collects its hooks with ``@hooks.around(target, params)`` (or
``after``): the target's dotted name and the leading parameters (and keywords read by name) the
hook relies on. Registration (:meth:`HookSet.register`, which binds the hook's context: the
session, or the HTTP process's metrics) and the startup signature check (:func:`check`) both come
from that one declaration. An SGLang upgrade that renames a target or changes its parameters
stops the launcher with the target's name.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_kvshare import SGLANG_VERSION


@dataclass(frozen=True)
class Hook:
    """One hook: ``fn(context, original, *args, **kwargs)`` (AROUND) or
    ``fn(context, result, *args, **kwargs)`` (AFTER) on ``target``."""

    target: str
    fn: Callable
    kind: HookType
    params: tuple[str, ...]  # the target's leading parameters the hook passes on or reads
    reads: tuple[str, ...] = ()  # other parameters of the target it reads by name


class HookSet:
    """The hooks of one module, registered together with one context."""

    def __init__(self) -> None:
        self.hooks: list[Hook] = []

    def _declare(self, kind: HookType, target: str, params: Iterable[str], reads: Iterable[str]):
        def declare(fn):
            self.hooks.append(Hook(target, fn, kind, tuple(params), tuple(reads)))
            return fn

        return declare

    def around(self, target: str, params: Iterable[str], reads: Iterable[str] = ()):
        return self._declare(HookType.AROUND, target, params, reads)

    def after(self, target: str, params: Iterable[str], reads: Iterable[str] = ()):
        return self._declare(HookType.AFTER, target, params, reads)

    def register(self, context: Any) -> None:
        for hook in self.hooks:
            HookRegistry.register(hook.target, functools.partial(hook.fn, context), hook.kind)


def resolve(dotted: str):
    """The object a dotted name stands for (the longest importable module, then attributes)."""
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


def check(hooks: Iterable[Hook]) -> None:
    """Raise ``RuntimeError`` naming the first target hooked twice, gone, or whose signature no
    longer has the parameters its hook relies on."""
    seen: set[str] = set()
    for hook in hooks:
        target = hook.target
        if target in seen:
            raise RuntimeError(f"kvshare: SGLang target {target} is hooked twice; declare one hook per target")
        seen.add(target)
        try:
            obj = resolve(target)
        except (ImportError, AttributeError) as e:
            raise RuntimeError(
                f"kvshare: hooked SGLang target {target} does not exist ({e}); "
                f"this plugin supports sglang=={SGLANG_VERSION}"
            ) from None
        params = list(inspect.signature(obj).parameters)
        missing = [p for p in hook.reads if p not in params]
        if params[: len(hook.params)] != list(hook.params) or missing:
            raise RuntimeError(
                f"kvshare: hooked SGLang target {target} has parameters ({', '.join(params)}); its hook "
                f"relies on ({', '.join(hook.params)}, ...){' and ' + ', '.join(missing) if missing else ''}; "
                f"this plugin supports sglang=={SGLANG_VERSION}"
            )
