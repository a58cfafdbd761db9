"""Steps a serving engine runs without CUDA graphs: every launched kernel takes at least the host's
time to launch it (``kadapt simulate --eager``; a published point whose engine ran eager).

A kernel table prices a kernel as a CUDA graph replays it: the GPU runs the kernels back to back and
the only per-kernel cost beyond the work is the kernel's own fixed cost (``op_overhead``, the tables'
floors). An engine that runs its decode step eagerly (TensorRT-LLM 0.17's PyTorch backend with its
default ``use_cuda_graph=False``) launches every kernel from Python: each module's ``forward`` runs,
each op is dispatched and its kernel enqueued. The enqueue is asynchronous, so the host does not wait
for a kernel to finish before it prepares the next one: host and GPU overlap, and the step is not its
device time plus the host's (that would count every launch twice). But the GPU cannot start a kernel
before the host has enqueued it, so a kernel shorter than the host's time per launch leaves the GPU
idle for the rest: each launched kernel occupies at least that time of the step,
``time = max(device time, host time per launch)``.

This is an upper bound of the step of an asynchronous launch queue: while a kernel longer than the
host's time runs, the host runs ahead and enqueues the next ones, which then run back to back at their
device time. The bound charges every kernel at least the host's time anyway; the queue's step is at
least ``max(sum of device times, launches x host time)``. At dstack's TensorRT-LLM decode steps the two
differ by the long kernels' excess over the host time (``benchmarks/eager_launch.py`` prints both).

Every kernel of the step counts as one launch, whatever its time after the step is finished
(``simulator.finish_step``): a shared expert hidden on a second stream still has to be launched by the
same host thread, and a kernel inside a module measured whole is still a kernel of its own. The
trace's fused vector kernels count once each, as a serving engine's fused ones do.

The host time per launch is the one free parameter: ``HOST_US``, chosen on a development split of the
published points that ran eager and scored once on the rest (``benchmarks/eager_launch.py``,
docs/cost_model.md "Steps run without CUDA graphs").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free: the CLI reads HOST_US for its help without importing the tracer
    from .cost import Priced

# host time per launched kernel of an eager step (us): chosen on dstack's TensorRT-LLM 0.17 PyTorch
# backend points at concurrency 4 and 8 on 8 x H200 (development split; ``benchmarks/eager_launch.py``)
HOST_US = 41.5
# what the cost model's source summary names a kernel the host's launch time bounds
HOST_SOURCE = "host launch (eager)"


def eager_step(kernels: Iterable[Priced], host: float) -> list[Priced]:
    """``kernels`` of one finished step as an eager engine runs them: each at least ``host`` seconds
    (its bound ``host`` where the launch, not the kernel, sets its time); ``host`` 0 leaves them as
    priced (a step replayed as a CUDA graph)."""
    if host <= 0:
        return list(kernels)
    return [k if k.time >= host else replace(k, time=host, bound="host") for k in kernels]


def launches(kernels: Iterable[Priced]) -> int:
    """Kernels a step launches (each traced kernel once per layer it stands for)."""
    return sum(k.op.repeat for k in kernels)
