"""The Pareto front of two objectives, both maximised (pure Python, no torch).

A sweep trades throughput per device against speed per user: more concurrent queries fill the
devices better but give each query a slower step. The points worth showing are those no other point
beats on both; everything else is dominated. One sort and one pass: O(n log n).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
Objectives = tuple[float, float]


def dominates(a: Objectives, b: Objectives) -> bool:
    """``a`` is at least as good as ``b`` on both objectives and better on one."""
    return a[0] >= b[0] and a[1] >= b[1] and a != b


def pareto_front(points: Sequence[T], key: Callable[[T], Objectives]) -> list[T]:
    """The points of ``points`` that no other point dominates, by decreasing first objective.

    Points with equal objectives are all kept (none dominates another)."""
    ranked = sorted(((key(p), p) for p in points), key=lambda item: (-item[0][0], -item[0][1]))
    front: list[T] = []
    best: Objectives | None = None  # the last kept objectives: highest second objective so far
    for objectives, point in ranked:
        if best is None or objectives[1] > best[1] or objectives == best:
            front.append(point)
            best = objectives
    return front
