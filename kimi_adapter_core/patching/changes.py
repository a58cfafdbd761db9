"""Reversible changes to class or module attributes, taken back correctly in any order.

Every change kadapt makes to one attribute (``owner.attr``) is a *layer* in that attribute's stack,
kept in a process-wide registry (guarded by its own lock). Each layer remembers what it sits on:
the value it replaced, whether that value lived in ``owner.__dict__`` or existed at all, and the
function a gate dispatches to when the call is not its spec's (a callable gate reads it through its
one-slot ``__kadapt_cell__``, a ``GatedAttribute`` through ``original``).

Undoing a layer unlinks it wherever it sits:

- a layer *below* the top hands what it sat on to the layer above it (that gate is re-pointed), so
  the attribute keeps showing the top patch and, once every layer is gone, is exactly what it was
  before kadapt touched it;
- the *top* layer puts back what it sat on (restoring the original, or deleting an attribute that
  was inherited or missing).

So two specs patching ``DeepseekV3Attention.expand_kv`` may exit in either order and the original
always comes back. If foreign code replaced the attribute after us, undo leaves its value in place
and only re-points any gate in its chain that still dispatches to ours.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from .gate import GatedAttribute

_LOCK = threading.RLock()
# (id(owner), attr) -> layers, bottom first. Layers hold their owner, so the id stays valid.
_STACKS: dict[tuple[int, str], list[Change]] = {}
_MISSING = object()


@dataclass(eq=False)  # identity semantics: a layer is found in its stack by ``is``
class Change:
    owner: Any  # class or module
    attr: str
    new: Any  # what we stored (function, staticmethod, descriptor, injected symbol)
    previous: Any  # what was stored before (None if nothing was)
    had_own: bool  # previous lived in owner.__dict__ (else: inherited or missing)
    previous_exists: bool = True
    new_fn: Any = None  # the gate function behind ``new`` (callable patches only)
    previous_fn: Any = None  # the function the gate dispatches to when not claimed
    installed: bool = False

    @property
    def _key(self) -> tuple[int, str]:
        return (id(self.owner), self.attr)

    def install(self) -> Change:
        with _LOCK:
            setattr(self.owner, self.attr, self.new)
            _STACKS.setdefault(self._key, []).append(self)
            self.installed = True
        return self

    def undo(self) -> None:
        """Take this layer out of its attribute's stack, wherever it sits (idempotent)."""
        with _LOCK:
            if not self.installed:
                return
            self.installed = False
            layers = _STACKS.get(self._key, [])
            index = next((i for i, layer in enumerate(layers) if layer is self), None)
            if index is not None:
                del layers[index]
                if not layers:
                    _STACKS.pop(self._key, None)
                if index < len(layers):  # a layer above us: it now sits on what we sat on
                    layers[index].rebase(self)
                    return
            current = vars(self.owner).get(self.attr, _MISSING)
            if current is self.new:
                if self.had_own and self.previous_exists:
                    setattr(self.owner, self.attr, self.previous)
                else:
                    delattr(self.owner, self.attr)
                return
            self._relink(current)

    def rebase(self, lower: Change) -> None:
        """``lower`` (directly beneath us) is gone: sit on what it sat on, and dispatch there."""
        self.previous, self.had_own = lower.previous, lower.had_own
        self.previous_exists = lower.previous_exists
        below_fn = lower.previous_fn
        if below_fn is None and lower.previous_exists:
            below_fn = getattr(lower.previous, "__func__", lower.previous)
        self.previous_fn = below_fn
        cell = getattr(getattr(self.new_fn, "__func__", self.new_fn), "__kadapt_cell__", None)
        if cell is not None and below_fn is not None:
            cell[0] = below_fn
        if isinstance(self.new, GatedAttribute):
            self.new.original, self.new.has_original = lower.previous, lower.previous_exists

    def _relink(self, node: Any) -> None:
        """Foreign code replaced the attribute after us: point any gate that dispatches to ours at
        our original instead of tearing the foreign value off; else leave it alone."""
        for _ in range(64):  # bounded: a cycle here would be a bug, never an endless loop
            if node is _MISSING:
                return
            fn = getattr(node, "__func__", node)
            cell = getattr(fn, "__kadapt_cell__", None)
            if cell is not None:
                if cell[0] is self.new_fn:
                    cell[0] = self.previous_fn
                    return
                node = cell[0]
            elif isinstance(node, GatedAttribute):
                if node.original is self.new:
                    node.original, node.has_original = self.previous, self.previous_exists
                    return
                node = node.original
            else:
                return


def layered(owner: Any, attr: str) -> bool:
    """True while some installed kadapt change holds ``owner.attr``."""
    with _LOCK:
        return bool(_STACKS.get((id(owner), attr)))
