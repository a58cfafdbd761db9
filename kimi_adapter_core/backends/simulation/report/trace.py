"""``kadapt simulate --trace``: a simulated step as a Chrome trace (chrome://tracing, Perfetto).

The step laid out layer by layer in time, compute kernels and collectives on two threads. Separate
from ``simulation`` because it is another format for another reader: a timeline, not a table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .simulation import phase

if TYPE_CHECKING:  # the simulator imports torch; rendering a simulation does not
    from ..estimate.simulator import Simulation


def chrome_trace(sim: Simulation) -> dict[str, Any]:
    """One step laid out layer by layer: compute kernels on thread 0, collectives on thread 1."""
    events: list[dict[str, Any]] = []
    clock = 0.0
    kernels = list(sim.kernels)
    index = 0
    while index < len(kernels):  # consecutive kernels of one scope form a block repeated per layer
        scope, repeat = kernels[index].op.scope, kernels[index].op.repeat
        end = index
        while end < len(kernels) and (kernels[end].op.scope, kernels[end].op.repeat) == (scope, repeat):
            end += 1
        for layer in range(repeat):
            for k in kernels[index:end]:
                events.append(
                    {
                        "name": k.op.name,
                        "cat": k.op.kind,
                        "ph": "X",
                        "pid": 0,
                        "tid": 1 if k.op.kind == "comm" else 0,
                        "ts": clock * 1e6,
                        "dur": k.time * 1e6,
                        "args": {
                            "scope": scope,
                            "layer": layer,
                            "module": k.op.module,
                            "bound": k.bound,
                            "flops": k.op.flops,
                            "bytes": k.op.bytes,
                            "shapes": k.op.shapes,
                        },
                    }
                )
                clock += k.time
        index = end
    meta = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "compute"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "collectives"}},
    ]
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"phase": phase(sim), "device": sim.device.name, "step_time_s": sim.step_time},
    }
