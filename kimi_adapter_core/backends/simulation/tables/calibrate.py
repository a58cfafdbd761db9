"""Derive kernel-efficiency tables (``kernels/*.yaml``) from AIConfigurator's measured kernel tables.

Run: ``python -m kimi_adapter_core.backends.simulation.tables.calibrate`` (every shipped table) or
``... --system h200_sxm --framework sglang [--out PATH]`` (one). Needs the ``measured`` extra
(``aiconfigurator-core``, Apache-2.0, whose parquet tables hold NVIDIA's measured kernel latencies).
The simulator never imports this module: it reads the YAML it writes.

One table per AIConfigurator system and serving framework (``<system>_<framework>.yaml``). Each curve
comes from the NEWEST version of that framework that measured the kernel - not the version with the
most rows: an old SGLang's int4 Marlin MoE kernel is ~4.7x slower than the current one, and a curve
fitted to it priced Kimi-K2.5's experts 4x too slow. Within that version the kernel with the most
rows at the selected shapes is taken (ties: the later name, which picks the CUDA-graph all-reduce
lane over the eager one). Where the framework measured no such kernel on the system (TensorRT-LLM
has no int4 MoE) the other frameworks are tried in ``FRAMEWORKS`` order; vLLM measured its MLA only
as a whole module, and its MLA curves come from those rows (``mla_module_curves``). Every curve
records what it came from in its ``source`` (system/op/framework/version/file and the kernel), so
the choice is visible in the table.

Every efficiency is the fraction of kadapt's *own* roofline bound a measured kernel reached:
``eff = ideal / (measured - op_overhead)`` with ``ideal = max(flops / peak, bytes / hbm_bw)`` computed
exactly as ``cost.py`` computes it for the same op (same FLOP and byte formulas, bf16 activations,
the weight's packed bytes), on the kadapt profile of the measuring device (``SYSTEMS``), so pricing
``ideal / eff + op_overhead`` reproduces the measurement on that device. Each grid point is the
median over the table's shapes at that point (model-sized N, K only: 256 to 16384), which keeps one
odd kernel from setting the curve. Rows faster than 3 op overheads are dropped (their time is launch
cost, not work). ``row_filter`` lets a caller fit on part of the data (the held-out experiment in
``benchmarks/bench_simulation.py``).

This module assembles a table from the fits and writes it (``calibrate``, ``render``, the command
line); the rest of the calibration is one module per concern: ``calibrate_rows`` (which measured rows
a curve is fitted on), ``calibrate_fit`` (grids, medians, efficiencies, per-shape fits),
``calibrate_gemm``, ``calibrate_experts``, ``calibrate_attention``, ``calibrate_mla_module`` (vLLM's
MLA measured as a module, and SGLang's under DP attention) and ``calibrate_all_reduce``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from ....atomic import atomic_write_text
from .calibrate_all_reduce import all_reduce_curve
from .calibrate_attention import attention_curves
from .calibrate_experts import moe_curves
from .calibrate_gemm import gemm_curves
from .calibrate_mla_module import mla_module_curves, wide_ep_module_curves
from .calibrate_rows import FRAMEWORKS, RowFilter, _all_rows, _read_table, _tables
from .device import get_device
from .kernels import KERNELS_DIR

# AIConfigurator system -> the kadapt device profile measured there (its peaks set the bound)
SYSTEMS = {"h100_sxm": "h100", "h200_sxm": "h200", "b200_sxm": "b200", "gb200": "gb200"}


def calibrate(system: str, framework: str, row_filter: RowFilter = _all_rows) -> dict[str, Any]:
    """The kernel table of ``framework`` on AIConfigurator's ``system``, fitted on the rows
    ``row_filter`` keeps (all of them for a shipped table). Every fit keeps its curves per measured
    shape: besides pricing the shape they were measured at, they price the shapes around them - an
    EP size not measured from the expert curves at the EP sizes around it, a head count not measured
    from the attention curves and module floors at the head counts around it
    (``curves.measured_across``) - so a held-out fit (the benchmark's) needs them too."""
    from importlib.metadata import version

    device = get_device(SYSTEMS[system])
    peak = dict(device.peak_flops)
    bw = device.hbm_bandwidth
    root = _tables(system)
    try:
        grouped, imbalance = moe_curves(root, framework, peak, bw, row_filter)
        gemm = gemm_curves(root, framework, peak, bw, row_filter)
        attention = attention_curves(root, framework, peak, bw, row_filter)
        module = mla_module_curves(root, framework, peak, bw, row_filter, gemm)
        wide = wide_ep_module_curves(root, framework, peak, bw, row_filter, gemm)
        all_reduce = all_reduce_curve(root, framework, lambda n: device.link_for(n).bandwidth)
    finally:
        _read_table.cache_clear()  # the next table reads other files: hold none of these
    floor: dict[str, Any] = {}
    if module is not None:  # the framework's own MLA, measured as a module, replaces a borrowed kernel
        attention["prefill"]["mla"], attention["decode"]["mla"], floor = module
    if wide is not None:  # its MLA module under DP attention prices the wide-EP layouts' MLA
        for phase, shapes in zip(("prefill", "decode"), wide[:2], strict=True):
            mla = attention[phase]["mla"]  # first: the per-cache-dtype fallbacks stay last
            mla["shapes"] = [*shapes, *mla.get("shapes", ())]
        floor |= wide[2]
    table = {
        "name": f"{system}_{framework}",
        "device": device.name,
        "source": (
            "derived by kimi_adapter_core/backends/simulation/tables/calibrate.py from "
            "NVIDIA AIConfigurator "
            f"(aiconfigurator-core {version('aiconfigurator-core')}, Apache-2.0) measured tables "
            f"systems/data/{system}: each curve from the newest {framework} version that measured the "
            f"kernel (another framework's where {framework} measured none), named in the curve's source; "
            f"each value is the median, over the table's shapes at that grid point, of kadapt's roofline "
            f"bound on the {device.name} profile / (measured latency - 2 us)"
        ),
        "gemm": gemm[0],
        "gemm_memory": gemm[1],
        "gemm_floor": gemm[2],
        "grouped_gemm": grouped,
        "routing": {"power_law": imbalance},
        "attention": attention,
        "all_reduce": all_reduce,
    }
    return table | ({"module_floor": floor} if floor else {})


def shipped() -> list[tuple[str, str]]:
    """Every (system, framework) whose table ships in ``kernels/``."""
    return [(system, framework) for system in SYSTEMS for framework in FRAMEWORKS]


# libyaml's emitter writes the tables' text byte for byte as the pure-Python one does (checked on every
# shipped table) at ~2.5x its speed; the representer, which sets every scalar's text, is PyYAML's either way
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def render(table: dict[str, Any]) -> str:
    """The YAML text of a generated table, as shipped."""
    header = (
        "# Generated by `python -m kimi_adapter_core.backends.simulation.tables.calibrate`; "
        "do not edit by hand.\n"
    )
    dumper = type("NoAliases", (_DUMPER,), {"ignore_aliases": lambda *_: True})
    return header + yaml.dump(table, Dumper=dumper, sort_keys=False, width=120, default_flow_style=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=sorted(SYSTEMS), help="one AIConfigurator system (default: all)")
    parser.add_argument("--framework", choices=FRAMEWORKS, help="one serving framework (default: all)")
    parser.add_argument("--out", type=Path, help="where to write a single table (default: kernels/NAME.yaml)")
    options = parser.parse_args()
    todo = [
        (system, framework)
        for system, framework in shipped()
        if options.system in (None, system) and options.framework in (None, framework)
    ]
    if options.out and len(todo) != 1:
        parser.error("--out needs one --system and one --framework")
    for system, framework in todo:
        out = options.out or KERNELS_DIR / f"{system}_{framework}.yaml"
        atomic_write_text(out, render(calibrate(system, framework)))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
