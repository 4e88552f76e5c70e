"""Tensors derived from parameters (a packed copy of a weight, a gathered slice of the LM head), kept
until a source changes: the one mechanism behind every such cache in the package.

A source "changes" when its storage does (`.data = ...`, `load_state_dict` into new tensors, `.to()`,
deepcopy) or it is written in place (an optimizer step bumps `_version`), so training in place, loading
new weights and copying a module all rebuild on next use; nothing has to be invalidated by hand.
"""
from __future__ import annotations

from typing import Callable, Generic, Sequence, TypeVar

import torch

T = TypeVar("T")


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor (made under torch.inference_mode) keeps no version counter
        return -2


def source_key(sources: Sequence[torch.Tensor | None], extra: tuple = ()) -> tuple:
    """What identifies the sources' current values: storage address and in-place version of each."""
    return tuple((-1, -1) if t is None else (t.data_ptr(), _version(t)) for t in sources) + extra


class DerivedCache(Generic[T]):
    """One value built from some tensors, rebuilt when any of them (or `extra`) changed since.

    The check runs on every `get` (e.g. each Linear call of a decoding step), so it reads only the
    sources' storage pointers and versions. Under torch.compile it cannot run (see get): traced code
    uses the value last built eagerly, so a weight changed after tracing reaches compiled calls at the
    next eager `get` (inference never changes weights between steps)."""

    __slots__ = ("_key", "_value")

    def __init__(self):
        self._key: tuple | None = None
        self._value: T | None = None

    def get(self, sources: Sequence[torch.Tensor | None], build: Callable[[], T], extra: tuple = ()) -> T:
        if torch.compiler.is_compiling():
            # Traced code cannot read the key (dynamo breaks the graph at its data-pointer comparison): it uses
            # the value last built, which the compiled graph reads through this attribute on every call, so
            # an eager call's rebuild (after a weight change) reaches it too; with none built yet the build
            # is traced into the graph. (Packed Linear layers pack eagerly in pack_cpu, before any step.)
            return self._value if self._key is not None else build()
        key = source_key(sources, extra)
        if key != self._key:
            self._value = build()
            self._key = key
        return self._value

    def clear(self) -> None:
        self._key, self._value = None, None

    def __deepcopy__(self, memo):  # a copied module has new storages: never carry the value across
        return DerivedCache()
