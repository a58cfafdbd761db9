"""One reversible change to a class or module attribute, and how to take it back.

Changes normally unwind last-in first-out. When another session stacked its own gate on top of
ours and is still active, taking ours back re-links that gate to our original instead of tearing
its patch off (each gate reads its original through a one-slot ``__kadapt_cell__``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .gate import GatedAttribute


@dataclass
class Change:
    owner: Any  # class or module
    attr: str
    new: Any  # what we stored (function, staticmethod, descriptor, injected symbol)
    previous: Any  # what was stored before (None if nothing was)
    had_own: bool  # previous lived in owner.__dict__ (else: inherited or missing)
    previous_exists: bool = True
    new_fn: Any = None  # the gate function behind ``new`` (callable patches only)
    previous_fn: Any = None  # the function the gate dispatches to when not claimed

    def install(self) -> Change:
        setattr(self.owner, self.attr, self.new)
        return self

    def undo(self) -> None:
        current = vars(self.owner).get(self.attr)
        if current is self.new:
            if self.had_own:
                setattr(self.owner, self.attr, self.previous)
            else:
                delattr(self.owner, self.attr)
            return
        self._relink(current)

    def _relink(self, node: Any) -> None:
        """Find the gate stacked on ours and point it at our original; else leave it alone."""
        for _ in range(64):  # bounded: a cycle here would be a bug, never an endless loop
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
