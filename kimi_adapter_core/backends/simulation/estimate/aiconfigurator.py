"""Bridge to NVIDIA AIConfigurator (``aiconfigurator-core``, the optional ``measured`` extra).

Two uses, both through the package's public engine surface (``EngineHandle.compile`` and
``evaluate_ops_json``: AIConfigurator's per-op Python call is private and its distribution is being
renamed, so nothing else is touched):

- ``reference.reference_step``: AIConfigurator's own estimate of one step for one of its models - the
  total and every op, each op also sorted into a component (attention, experts, communication,
  other) - which the benchmark and the accuracy tests compare kadapt with.
- ``measured.MeasuredPricer``: the ``--cost-model measured`` back end: each kadapt GEMM, attention,
  routed-expert and communication op (TP all-reduce / all-gather, EP dispatch / combine) is turned
  into AIConfigurator's op description and looked up in its measured tables for the system; ``None``
  where it has no such op or table (the caller falls back to the roofline for that op).

This module is what both share: the lazy import (without the package ``require()`` raises a
``KadaptError`` naming the extra), the kadapt device -> AIConfigurator system map, and the tables
and engine of one system and framework (``_database``, ``_database_handle``, ``_gpus_per_node``).
One read goes past the engine: the balanced expert rows of one shape, from the table its MoE op loads
(as its own ``legacy_moe_compute_coverage`` reads them), held to the calibration's rule on broken EP
sizes once per shape (``broken_moe_eps``) for the measured cost model.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from ....errors import KadaptError
from ..tables.calibrate_rows import broken_ep_sizes

EXTRA = "measured"
PACKAGE = "aiconfigurator-core"
# kadapt device profile -> AIConfigurator system (only systems it ships measured tables for)
# kadapt's B200 and GB200 profiles are AIConfigurator's b200_sxm and gb200 (8 and 4 GPUs per node in
# its system files); all five carry trtllm 1.3.0rc20, sglang 0.5.14 and vllm 0.24.0 tables (a100_sxm:
# trtllm 1.0.0, sglang 0.5.10, vllm 0.14.0)
SYSTEMS = {
    "h200": "h200_sxm",
    "h100": "h100_sxm",
    "a100": "a100_sxm",
    "b200": "b200_sxm",
    "gb200": "gb200",
}
FRAMEWORKS = ("trtllm", "sglang", "vllm")
# GPUs per node in each system's file (``node.num_gpus_per_node``, the same for every framework): the
# node the measured collectives ran in. Copied here so that the torch-free sweep can say when a layout
# spans more GPUs than the data behind its kernel table (``search/topology.py``) without the extra;
# a test holds it to the installed package's system files.
GPUS_PER_NODE = {"h200_sxm": 8, "h100_sxm": 8, "a100_sxm": 8, "b200_sxm": 8, "gb200": 4}


def require() -> Any:
    """The ``aiconfigurator_core`` engine module, or a one-line error naming the extra to install."""
    try:
        from aiconfigurator_core.sdk import engine
    except ImportError as exc:
        raise KadaptError(
            f"--cost-model measured needs NVIDIA AIConfigurator's tables: pip install 'kadapt[{EXTRA}]' "
            f"(or {PACKAGE}==0.12.0); it is not installed ({exc})"
        ) from exc
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    return engine


def available() -> bool:
    try:
        require()
    except KadaptError:
        return False
    return True


def system_for(device_name: str) -> str:
    system = SYSTEMS.get(device_name)
    if system is None:
        raise KadaptError(
            f"--cost-model measured has no AIConfigurator tables for device {device_name!r} "
            f"(measured systems: {', '.join(f'{k} ({v})' for k, v in SYSTEMS.items())})"
        )
    return system


@cache
def _database(system: str, framework: str) -> Any:
    """AIConfigurator's newest tables for one system and framework."""
    require()
    from aiconfigurator_core.sdk import perf_database

    version = perf_database.get_latest_database_version(system, framework)
    database = perf_database.get_database(system, framework, version) if version else None
    if database is None:
        raise KadaptError(f"AIConfigurator has no {framework} tables for {system}")
    return database


@cache
def _database_handle(system: str, framework: str) -> Any:
    """An AIConfigurator engine bound to one system's tables (no model: ad-hoc op lists only)."""
    return require().EngineHandle.for_database(_database(system, framework))


def _gpus_per_node(system: str, framework: str) -> int:
    return int(_database(system, framework).system_spec["node"]["num_gpus_per_node"])


@cache
def broken_moe_eps(
    system: str, framework: str, quant: str, shape: tuple[int, int, int, int, int]
) -> frozenset[int]:
    """The EP sizes of one routed-expert shape (``_balanced_moe_rows``' key) whose balanced rows the
    calibration's rule calls a broken measurement (``calibrate_rows.broken_ep_sizes``); judged once per
    shape, not at every op priced."""
    rows = _balanced_moe_rows(system, framework, quant, shape)
    return frozenset(broken.ep for broken in broken_ep_sizes(rows))


def _balanced_moe_rows(
    system: str, framework: str, quant: str, shape: tuple[int, int, int, int, int]
) -> dict[int, dict[int, float]]:
    """AIConfigurator's balanced routed-expert rows of one shape (``shape``: top-k, experts, hidden,
    whole expert width, expert-TP size) on ``quant``, as its MoE op prices from them: EP size ->
    tokens -> ms. Empty where the table holds no such shape, or is laid out otherwise than read here
    (a release that moved it: the rows are then priced as measured)."""
    try:
        from aiconfigurator_core.sdk.operations.moe import MoE

        database = _database(system, framework)
        MoE.load_data(database)
        by_quant = {getattr(mode, "name", mode): rows for mode, rows in database._moe_data.items()}
        top_k, experts, hidden, width, moe_tp = shape
        by_ep = by_quant[quant]["balanced"][top_k][experts][hidden][width][moe_tp]
        return {
            int(ep): {int(tokens): float(row["latency"]) for tokens, row in by_tokens.items()}
            for ep, by_tokens in by_ep.items()
        }
    except (ImportError, AttributeError, KeyError, TypeError, ValueError):
        return {}
