"""One trace of the per-rank model read in any weight mode: how a sweep tags and re-formats weights.

A trace tags every format the policy hands out (``Tagger``: its ``compute`` key carries an index,
``<compute>#<index>``, so each matmul names the weight it read) and every op lists the weights it
read with their element counts (``Op.weights``). Any mode is then exact arithmetic on the same
trace (``reformat``): each weight's bytes re-formatted, each matmul's compute key and kernel family
set from its weight; the sweep fuses the result again (``Sweep.in_mode``).

Separate from ``sweep`` because it is the one place that knows how a format is tagged and read
back; the sweep only asks which weight a kernel read and what that weight is in another mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..model.quant import WeightFormat
from ..model.tracer import Op

Key = tuple[str, str]  # (parameter group name, checkpoint name) of one weight
_TAG = "#"


@dataclass(frozen=True)
class _TaggedFormat(WeightFormat):
    """A format whose ``compute`` key names its weight (``<compute>#<index>``); everything the tracer
    and the simulator derive from the format (kernel family, 8-bit dispatch) is the untagged one's,
    so a tagged trace merges and records exactly what an untagged one does."""

    untagged: WeightFormat | None = None

    @property
    def kernel(self) -> str:
        assert self.untagged is not None
        return kernel_family(self.untagged)

    @property
    def eight_bit_activations(self) -> bool:
        assert self.untagged is not None
        return self.untagged.eight_bit_activations


def kernel_family(fmt: WeightFormat) -> str:
    """The kernel family a matmul on ``fmt`` runs (what projection merging and the tables key on)."""
    return str(getattr(fmt, "kernel", fmt.compute))


class Tagger:
    """A weight policy whose formats name their weight (``_TaggedFormat``: ``<compute>#<index>``)."""

    def __init__(self, policy: Callable[..., WeightFormat]) -> None:
        self.policy = policy
        self.keys: list[Key] = []
        self.formats: list[WeightFormat] = []  # the tagged formats handed out, by index
        self.groups: dict[Key, Any] = {}

    def __call__(self, group: Any, name: str) -> WeightFormat:
        fmt, key = self.policy(group, name), (group.name, name)
        self.groups[key] = group
        self.keys.append(key)
        self.formats.append(tagged(fmt, len(self.keys) - 1))
        return self.formats[-1]

    def named(self, compute: str) -> tuple[Key | None, WeightFormat | None]:
        """The weight a kernel with this compute key read, and its tagged format."""
        index = tag_index(compute)
        if index is None:
            return None, None
        return self.keys[index], self.formats[index]


def tagged(fmt: WeightFormat, index: int) -> _TaggedFormat:
    return _TaggedFormat(**{**vars(fmt), "compute": f"{fmt.compute}{_TAG}{index}", "untagged": fmt})


def tag_index(compute: str) -> int | None:
    base, tag, index = compute.rpartition(_TAG)
    return int(index) if tag and base and index.isdigit() else None


def untag(op: Op) -> Op:
    """``op`` as an untagged trace records it."""
    return op if tag_index(op.compute) is None else replace(op, compute=op.compute.rpartition(_TAG)[0])


def reformat(op: Op, convert: Callable[[WeightFormat], WeightFormat]) -> Op:
    """``op`` as a trace with each weight's format ``convert``ed records it: the bytes it reads of
    each weight, and for a matmul the compute key and kernel family of its (first) weight."""
    if not op.weights:
        return op
    swapped = {tid: (fmt, convert(fmt), n) for tid, fmt, n in op.weights}
    inputs = [
        (tid, swapped[tid][2] * swapped[tid][1].bytes_per_param if tid in swapped else b)
        for tid, b in op.inputs
    ]
    nbytes = op.bytes + sum(b for _, b in inputs) - sum(b for _, b in op.inputs)
    weights = [(tid, swapped[tid][1], n) for tid, _, n in op.weights]
    if op.kind != "matmul":
        return replace(op, bytes=nbytes, inputs=inputs, weights=weights)
    first = weights[0][1]
    attrs = {**op.attrs, "kernel": kernel_family(first)}
    return replace(op, bytes=nbytes, inputs=inputs, weights=weights, compute=first.compute, attrs=attrs)


@dataclass
class TaggedTrace:
    """One tagged trace of the per-rank model (its ops before fusion) and the tagger that named its
    weights. Re-formatted and fused, it is what a trace in any weight mode records (``Sweep.in_mode``)."""

    ops: list[Op]
    tagger: Tagger
