"""ReBaseShared DB's twin pairs: each adapted request's adapter-free twin (scheduler process)."""

from __future__ import annotations

import weakref
from typing import Optional


class TwinPairs:
    """ReBaseShared DB (``double_batch``): each adapted request's adapter-free twin, and the
    adapted requests whose finished output is held until their twin finishes. Kept only as
    long as the requests live: a twin holds its adapted request, not the other way round."""

    def __init__(self):
        self._primary: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # twin -> adapted req
        self._twin: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapted req -> ref(twin)
        self._held: weakref.WeakSet = weakref.WeakSet()
        # either request -> [lo, hi): the positions it computed itself (``wrote``)
        self._own: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def pair(self, primary, twin) -> None:
        self._primary[twin] = primary
        self._twin[primary] = weakref.ref(twin)

    def primary_of(self, twin):
        """The adapted request of a twin (None: ``twin`` is no twin)."""
        return self._primary.get(twin)

    def twin_of(self, primary):
        """The twin of an adapted request (None: none, or gone)."""
        ref = self._twin.get(primary)
        return None if ref is None else ref()

    def paired(self, req) -> bool:
        return req in self._primary or req in self._twin

    def hold(self, primary, held: bool = True) -> None:
        if held:
            self._held.add(primary)
        else:
            self._held.discard(primary)

    def held(self, primary) -> bool:
        return primary in self._held

    def __len__(self) -> int:
        """Twins alive now."""
        return len(self._primary)

    def wrote(self, req, lo: int, hi: int) -> None:
        """A forward wrote ``req``'s KV at positions ``[lo, hi)``: its computed span grows, or
        starts again when ``lo`` does not continue it (the first forward, a retracted request)."""
        own = self._own.get(req)
        self._own[req] = (own[0], hi) if own is not None and own[1] == lo else (lo, hi)

    def own(self, req) -> Optional[tuple[int, int]]:
        """Positions ``[lo, hi)`` ``req`` computed itself (None: none yet)."""
        return self._own.get(req)
