"""Kernel-efficiency tables: the achieved fraction of the roofline bound per op kind, dtype and shape.

One flat compute efficiency cannot price a decode GEMM (a few tokens: bandwidth-bound, ~50-80% of
HBM), a 4,096-token fp8-block GEMM (~40% of the FP8 peak) and a power-law-routed fp8 grouped expert
GEMM (~16%) at once. A device profile names its tables (``kernels: h200_sxm``) kept as data in
``kernels/*.yaml``, generated from measured kernel tables by ``calibrate.py`` (each file and each
curve cites its source). Kernels differ by serving framework (SGLang's Triton MoE is not TensorRT-LLM's
CUTLASS one), so a name has one table per framework, ``<name>_<framework>.yaml``, and the framework a
simulation serves with picks it (``table_for``); a name without per-framework tables (``atlas_a3``)
is one table for every framework. A table records the device profile it was measured on
(``device``): pricing another device with it carries the measured time above the bound over as a
time on the same die (same peaks), else rescales measured efficiencies by that device's peaks and
bandwidth (``cost._priced_time``), which ``cost.price`` says in the op's source.

A curve maps one shape variable to an efficiency, the median over every shape measured, with the
same fit per measured shape under ``shapes``; how an op's shape picks its curve and how a curve
interpolates is ``curves`` (``Curve``, ``measured_at``, ``measured_across``). This module owns the
tables: their file format (``KERNELS_SCHEMA``), loading (a ``base`` table's curves included) and the
queries per op kind (``KernelTable``).
A device without a table keeps the flat ``compute.efficiency`` / ``memory.efficiency``.

Curves and the op kinds they price:
- ``gemm.<dtype>`` by M (tokens): the compute efficiency of dense matmuls; ``gemm_memory.<dtype>`` by
  bytes moved: their memory efficiency (a small weight streams at a fraction of HBM bandwidth).
  dtypes bf16, fp8 (per-tensor), fp8_block, and whatever else a table measures (a missing dtype falls
  back: int8 -> fp8, w4a8_mxfp4 -> w4a16 -> bf16, w4a16_mxfp4 -> w4a16, w4a8 -> fp8; a fallback computed
  in bf16 prices the op at the bf16 peak, ``KernelTable.grouped_compute``).
- ``gemm_floor.<dtype>`` by M: the fixed cost of one standalone GEMM call (``latency_us``: the
  median latency of the measured calls whose work takes under 2 us at the peaks), which replaces the
  device's op overhead; the ``gemm`` / ``gemm_memory`` efficiencies are fitted net of it. vLLM's
  fp8-block GEMM rows take 0.085 / 0.18 / 0.30 ms per call on H200 / B200 / GB200 whatever the shape
  (0.27 / 0.53 ms at M = 1 on Blackwell); no efficiency of the bound prices a flat cost.
- ``grouped_gemm.<dtype>`` by token-expert pairs per local expert: the routed experts, with the
  fixed cost of the whole routed-expert pipeline (``overhead_us``: permute, two GEMMs, unpermute).
- ``routing.power_law.<dtype>`` by the same: the slowdown of power-law over balanced routing (on the
  time above the pipeline floor; a shape's ``floor_factor`` scales the floor where its power-law rows
  are faster than the floor itself).
- ``attention.prefill.{gqa,mla}`` by new tokens per sequence; ``attention.decode.{gqa,mla}`` by the
  KV bytes one call reads.
- ``all_reduce`` by message bytes, with its own latency: the TP all-reduces inside one node; its
  ``shapes`` (match: ``group``, the GPUs) are the smaller groups measured, each with its latency as
  ``overhead_us``.
- ``module_floor.<kind>`` per measured shape only, by tokens: the time a module measured whole spends
  besides its core kernel (vLLM's MLA module, ``mla`` in decode and ``mla_prefill`` in prefill;
  SGLang's under DP attention, ``wide_ep_generation_mla`` / ``wide_ep_context_mla``: projections,
  norms, rope, launches), which ``cost.fold_modules`` adds to the core kernel while the module's
  other kernels are priced 0 (a head count not measured: from those around it), but for the
  projections its ``outside`` names (SGLang's module runs without the q_a + kv_a downscale).
- ``all_to_all``: EP dispatch and combine as the measured kernels move tokens (one row per token and
  expert it is routed to): a fixed latency by EP group size plus the rows' bytes at a measured
  fraction of the link bandwidth by tokens per rank, for groups up to the largest measured.

A table may name a ``base`` table: the curves it does not measure itself are the base's (the Atlas A3
table measures the all-to-all and borrows the Hopper kernel curves, and says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ....errors import KadaptError
from .curves import EXPERT_WIDTH, Curve, Match, Shape, _matched, measured_at
from .plausible import RoutingCheck, checked

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
# the generated tables hold a curve per measured shape (thousands of lines): libyaml's safe loader
# reads one ~10x faster than the pure-Python one, which it falls back to where libyaml is missing
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_CURVE_PROPERTIES: dict[str, Any] = {
    "efficiency": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
    "factor": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}},
    "latency_us": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}},
    "floor_factor": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
    "source": {"type": "string"},
    "overhead_us": {"type": "number", "minimum": 0},
}
_AXIS = {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}}
_SHAPE_CURVE = {  # a curve fitted on the rows of one shape only: ``match`` names it by op attributes
    "type": "object",
    "required": ["match"],
    "properties": {
        **_CURVE_PROPERTIES,
        "match": {
            "type": "object",
            "minProperties": 1,
            "additionalProperties": {"type": ["number", "string"]},
        },
    },
    "additionalProperties": _AXIS,
}
_CURVE = {
    "type": "object",
    "minProperties": 2,
    "properties": {**_CURVE_PROPERTIES, "shapes": {"type": "array", "items": _SHAPE_CURVE}},
    "additionalProperties": _AXIS,
}
_CURVES = {"type": "object", "additionalProperties": _CURVE}
_FLOORS = {  # per module kind: its floor at each measured shape only (no median: a module is its shape)
    "type": "object",
    "additionalProperties": {
        "type": "object",
        "required": ["source", "shapes"],
        "additionalProperties": False,
        "properties": {
            "source": {"type": "string"},
            "shapes": {"type": "array", "items": _SHAPE_CURVE},
            # the module's projections (leaf names) its measurement does not hold: priced as traced
            "outside": {"type": "array", "items": {"type": "string", "minLength": 1}},
        },
    },
}
_PHASES = {  # one list per all-to-all phase
    "type": "object",
    "required": ["dispatch", "combine"],
    "additionalProperties": False,
    "properties": {
        "dispatch": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}},
        "combine": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}},
    },
}
KERNELS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["name", "source"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string"},
        "source": {"type": "string", "minLength": 1},
        "device": {"type": "string", "minLength": 1},
        "gemm": _CURVES,
        "gemm_memory": _CURVES,
        "gemm_floor": _CURVES,
        "grouped_gemm": _CURVES,
        "routing": {"type": "object", "additionalProperties": _CURVES},
        "attention": {"type": "object", "additionalProperties": _CURVES},
        "module_floor": _FLOORS,
        "base": {"type": "string", "pattern": "^[A-Za-z0-9_.-]+$"},
        "all_to_all": {
            "type": "object",
            "required": ["source", "devices", "latency_us", "tokens", "efficiency"],
            "additionalProperties": False,
            "properties": {
                "source": {"type": "string", "minLength": 1},
                "devices": _AXIS,
                "latency_us": _PHASES,
                "tokens": _AXIS,
                "efficiency": _PHASES,
            },
        },
        "all_reduce": {
            "type": "object",
            "required": ["latency_us", "bytes", "efficiency"],
            "properties": {
                "latency_us": {"type": "number", "minimum": 0},
                "bytes": _AXIS,
                "efficiency": _CURVE_PROPERTIES["efficiency"],
                "source": {"type": "string"},
                "shapes": {"type": "array", "items": _SHAPE_CURVE},
            },
            "additionalProperties": False,
        },
    },
}

_VALIDATOR = jsonschema.Draft202012Validator(KERNELS_SCHEMA)
# a dtype the table did not measure is priced with the nearest one it did
_FALLBACK = {
    "int8": "fp8",
    "fp8": "fp8_block",
    "fp8_block": "fp8",
    # DeepSeek-V4's FP4 experts where no FP4 x FP8 row was measured (Hopper: no FP4 tensor cores).
    # SGLang serves that checkpoint on Hopper with FlashInfer's SM90 CUTLASS mixed-input MoE, 4-bit
    # weights with a scale per 32 times bf16 activations (AIConfigurator's ``w4a16_mxfp4_cutlass``,
    # which it has no rows of and calls distinct from gpt-oss's Triton MXFP4 path, ``w4a16_mxfp4``):
    # the group-scaled int4 x bf16 kernels measured on the fine-grained shapes (Kimi-K2.5's) price it.
    # gpt-oss's MXFP4 rows (its shapes, 0.15-0.35 of HBM bandwidth at one pair per expert) priced an
    # H200 decode step's experts (TP8 EP8, 64 tokens) at 7.0-22.9 ms against 5.7-6.4 on these
    "w4a8_mxfp4": "w4a16",
    "w4a16_mxfp4": "w4a16",  # a table without MXFP4 rows: the int4 weight-only kernel's 4-bit reads
    "w4a16": "bf16",
    "w4a8": "fp8",
    "fp32": "bf16",
}

# a dtype whose fallback multiplies in another unit -> the peak key of that unit
_FALLBACK_UNIT = {"w4a8_mxfp4": "bf16"}

# a routed-expert op not measured prices from its model shape's curves at the EP sizes around it,
# else from the curves of the other model widths measured at its EP size
EXPERT_ACROSS = ("ep", EXPERT_WIDTH)


def _curve(body: dict[str, Any], where: str, value: str = "efficiency") -> Curve:
    skip = ("efficiency", "factor", "latency_us", "floor_factor", "shapes")
    axes = [k for k, v in body.items() if k not in skip and isinstance(v, list)]
    if len(axes) != 1 or value not in body or len(body[axes[0]]) != len(body[value]) or not body[value]:
        raise KadaptError(
            f"kernel table curve {where} needs one shape axis and a {value} list of equal length"
        )
    xs = [float(x) for x in body[axes[0]]]
    if xs != sorted(xs):
        raise KadaptError(f"kernel table curve {where}: the {axes[0]} axis must increase")
    floor = tuple(float(y) for y in body.get("floor_factor", ()))
    if floor and len(floor) != len(xs):
        raise KadaptError(f"kernel table curve {where}: floor_factor needs one value per {axes[0]} point")
    shapes = tuple(_shaped(shaped, where, value) for shaped in body.get("shapes", ()))
    overhead = float(body.get("overhead_us", 0.0)) * 1e-6
    return Curve(tuple(xs), tuple(float(y) for y in body[value]), overhead, floor, shapes)


@dataclass(frozen=True)
class AllToAll:
    """Measured EP dispatch / combine: ``latency(group) + rows x row bytes / (link bw x efficiency)``."""

    max_devices: int  # the largest EP group measured; larger ones keep the roofline
    latency: dict[str, Curve]  # phase -> seconds by EP group size
    efficiency: dict[str, Curve]  # phase -> fraction of the link bandwidth by tokens per rank
    source: str

    def covers(self, group: int) -> bool:
        return group <= self.max_devices

    def transfer(self, phase: str, tokens: float, row_bytes: float, link_bandwidth: float) -> float:
        """Seconds moving one ``phase``'s rows: ``row_bytes`` = top-k x bytes per token (one row per
        expert a token is routed to, as the measured kernels move them)."""
        return tokens * row_bytes / (link_bandwidth * self.efficiency[phase](max(tokens, 1.0)))


@dataclass(frozen=True)
class KernelTable:
    name: str
    source: str
    path: Path
    gemm: dict[str, Curve]  # compute efficiency by M
    gemm_memory: dict[str, Curve]  # memory efficiency by bytes moved
    grouped: dict[str, Curve]
    imbalance: dict[str, Curve]  # power-law / balanced latency, per grouped dtype
    prefill: dict[str, Curve]  # gqa | mla
    decode: dict[str, Curve]
    all_reduce: tuple[float, Curve] | None  # (latency s, efficiency by bytes)
    all_to_all: AllToAll | None = None
    gemm_floor: dict[str, Curve] = field(default_factory=dict)  # seconds per standalone call by M
    # module kind -> its measured floor (seconds by tokens) per shape: the time of a module measured
    # whole that its attention kernel does not account for (``cost.fold_modules``)
    module_floor: dict[str, tuple[tuple[Match, Curve], ...]] = field(default_factory=dict)
    # module kind -> the projections inside the traced module its measurement does not hold
    module_outside: dict[str, tuple[str, ...]] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)  # section -> the table that measured it
    device: str | None = None  # the device profile this table's own curves were measured on
    devices: dict[str, str | None] = field(default_factory=dict)  # section -> the base's device
    # grouped dtype -> its routing curve as the file holds it, where per-shape curves were left out
    routing_checks: dict[str, RoutingCheck] = field(default_factory=dict)

    def origin(self, section: str) -> str:
        """Name of the table whose measurements a section's curves are (a base's when borrowed)."""
        return self.origins.get(section, self.name)

    def measured_on(self, section: str) -> str | None:
        """The device profile a section's curves were measured on (None: not recorded)."""
        return self.devices[section] if section in self.devices else self.device

    @staticmethod
    def _picked(curves: dict[str, Curve], dtype: str) -> str:
        """The dtype whose curve prices ``dtype``: itself, else its nearest fallback measured."""
        seen = set()
        while dtype not in curves and dtype in _FALLBACK and dtype not in seen:
            seen.add(dtype)
            dtype = _FALLBACK[dtype]
        return dtype if dtype in curves else "bf16"

    @classmethod
    def _pick(cls, curves: dict[str, Curve], dtype: str) -> Curve | None:
        return curves.get(cls._picked(curves, dtype))

    def grouped_compute(self, dtype: str, compute: str) -> str:
        """The peak (``compute`` key) the grouped-GEMM curve pricing ``dtype`` was fitted against:
        ``compute`` unless the curve is a fallback's computed in bf16 (DeepSeek-V4's FP8-activation
        FP4 experts on Hopper run 4-bit x bf16, at half the FP8 peak)."""
        unit = _FALLBACK_UNIT.get(dtype)
        return unit if unit is not None and self._picked(self.grouped, dtype) != dtype else compute

    def gemm_eff(self, dtype: str, m: float, nbytes: float) -> tuple[float, float] | None:
        """(compute efficiency at M, memory efficiency at ``nbytes`` moved)."""
        compute, memory = self._pick(self.gemm, dtype), self._pick(self.gemm_memory, dtype)
        return (compute(m), memory(nbytes)) if compute and memory else None

    def gemm_fixed(self, dtype: str, m: float) -> float:
        """The fixed cost in seconds of one standalone GEMM call at M (0: the device's op overhead)."""
        curve = self._pick(self.gemm_floor, dtype) if self.gemm_floor else None
        return curve(m) if curve else 0.0

    def grouped_eff(
        self, dtype: str, pairs_per_expert: float, shape: Shape | None = None
    ) -> tuple[float, float] | None:
        """(efficiency, fixed cost in seconds), from the curve measured at ``shape`` (the experts'
        ``hidden``, ``width``, ``experts``, ``top_k``, ``ep``) where there is one, else from the
        model shape's curves at the EP sizes around it (``measured_across``): at the same pairs per
        expert the efficiency falls steeply with EP (vLLM on H100, Qwen3's shape, bf16, 256 pairs
        per expert: 0.62, 0.42, 0.18, 0.05 at EP 1, 4, 16, 64), which the median over every shape
        does not follow; a model shape measured at no EP size, from the other model widths measured
        at its EP size (``EXPERT_WIDTH``, log-linear in one expert's weights: at a fixed EP size and
        pairs per expert the efficiency moves smoothly with the width, H200 / SGLang, fp8 block,
        EP8, 16 pairs per expert: 0.62, 0.63, 0.70, 0.74, 0.76 at 12.6, 18.9, 25.2, 37.7, 66.1 M
        weights per expert)."""
        curve = self._pick(self.grouped, dtype)
        if curve is None:
            return None
        curve = curve.at(shape, *EXPERT_ACROSS)
        return curve(pairs_per_expert), curve.overhead

    def imbalance_factor(self, dtype: str, pairs_per_expert: float, shape: Shape | None = None) -> float:
        """Power-law routing's factor on the grouped GEMMs' time above the pipeline floor (across EP
        sizes as ``grouped_eff``)."""
        curve = self._pick(self.imbalance, dtype)
        return curve.at(shape, *EXPERT_ACROSS)(pairs_per_expert) if curve else 1.0

    def imbalance_floor(self, dtype: str, pairs_per_expert: float, shape: Shape | None = None) -> float:
        """Power-law routing's scale of the pipeline floor (below 1 where its measured rows are faster
        than the floor: the measured rank was routed few of the tokens' experts)."""
        curve = self._pick(self.imbalance, dtype)
        return curve.at(shape, *EXPERT_ACROSS).floor_factor(pairs_per_expert) if curve else 1.0

    def imbalance_note(self, dtype: str, pairs_per_expert: float, shape: Shape | None = None) -> str:
        """What the op's source says where a per-shape routing curve outside the plausible band
        (``plausible``) would have priced it: the factor it would have taken, the band, and the
        factor it takes from the next more general curve ("" where none was left out there)."""
        curve = self._pick(self.imbalance, dtype)
        picked = next((key for key, found in self.imbalance.items() if found is curve), None)
        check = self.routing_checks.get(picked) if picked else None
        if check is None or curve is None:
            return ""
        was = check.raw.at(shape, *EXPERT_ACROSS)(pairs_per_expert)
        return check.note(was, curve.at(shape, *EXPERT_ACROSS)(pairs_per_expert))

    def attention_curve(self, decode: bool, kind: str, shape: Shape | None = None) -> Curve | None:
        """The attention curve of ``kind`` in that phase, measured at ``shape`` (``heads`` per rank,
        and ``kv_heads`` for GQA) where there is one, else from the curves measured at the head
        counts around it with every other attribute equal (``measured_across``): at a fixed KV head
        count, batch and length the efficiency grows smoothly with the query heads (B200 / SGLang,
        GQA prefill, 1 KV head, one 1,024-token sequence: 0.032, 0.046, 0.063 at 6, 8, 12 heads),
        where the median over every shape measured (0.287 there) is set by larger batches and head
        counts."""
        curve = (self.decode if decode else self.prefill).get(kind)
        return curve.at(shape, "heads") if curve else None

    def attention_eff(self, decode: bool, kind: str, x: float, shape: Shape | None = None) -> float | None:
        curve = self.attention_curve(decode, kind, shape)
        return curve(x) if curve else None

    def floor_at(self, kind: str, shape: Shape) -> Curve | None:
        """The measured floor (seconds by tokens) of a ``kind`` module of ``shape`` (None: unmeasured)."""
        return measured_at(self.module_floor.get(kind, ()), shape)


def parse_kernels(data: Any, path: Path) -> KernelTable:
    try:
        _VALIDATOR.validate(data)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise KadaptError(f"kernel table {path} is invalid at {where}: {exc.message}") from exc

    def curves(section: dict[str, Any] | None, where: str, value: str = "efficiency") -> dict[str, Curve]:
        return {k: _curve(v, f"{where}.{k}", value) for k, v in (section or {}).items()}

    base = _base(data["base"], path) if data.get("base") else None
    attention = data.get("attention") or {}
    factors = curves((data.get("routing") or {}).get("power_law"), "routing.power_law", "factor")
    screened = {dtype: checked(curve) for dtype, curve in factors.items()}
    ar = data.get("all_reduce")

    origins: dict[str, str] = {}
    devices: dict[str, str | None] = {}

    def borrow(name: str) -> None:
        assert base is not None
        origins[name], devices[name] = base.origin(name), base.measured_on(name)

    def inherit(own: dict[str, Curve], name: str) -> dict[str, Curve]:
        if base is not None and not own:
            borrow(name)
        return {**(getattr(base, name) if base else {}), **own}

    if base is not None:
        for name in ("all_reduce", "all_to_all"):
            if not data.get(name):
                borrow(name)
    return KernelTable(
        name=data["name"],
        source=data["source"] + (f"; other curves from kernel table {base.name}" if base else ""),
        path=path,
        gemm=inherit(curves(data.get("gemm"), "gemm"), "gemm"),
        gemm_memory=inherit(curves(data.get("gemm_memory"), "gemm_memory"), "gemm_memory"),
        gemm_floor=inherit(_seconds(data.get("gemm_floor"), "gemm_floor"), "gemm_floor"),
        grouped=inherit(curves(data.get("grouped_gemm"), "grouped_gemm"), "grouped"),
        imbalance=inherit({dtype: kept for dtype, (kept, _) in screened.items()}, "imbalance"),
        prefill=inherit(curves(attention.get("prefill"), "attention.prefill"), "prefill"),
        decode=inherit(curves(attention.get("decode"), "attention.decode"), "decode"),
        all_reduce=(ar["latency_us"] * 1e-6, _curve(ar, "all_reduce")) if ar else (base and base.all_reduce),
        all_to_all=_all_to_all(data["all_to_all"]) if data.get("all_to_all") else (base and base.all_to_all),
        module_floor={
            kind: _floors(body, f"module_floor.{kind}")
            for kind, body in (data.get("module_floor") or {}).items()
        }
        or (base.module_floor if base else {}),
        module_outside={
            kind: tuple(body.get("outside", ())) for kind, body in (data.get("module_floor") or {}).items()
        }
        or (base.module_outside if base else {}),
        origins=origins,
        device=data.get("device"),
        devices=devices,
        routing_checks={dtype: check for dtype, (_, check) in screened.items() if check}
        or (base.routing_checks if base and not factors else {}),
    )


def _shaped(shaped: dict[str, Any], where: str, value: str) -> tuple[Match, Curve]:
    """One ``shapes`` entry: its ``match`` (sorted, values as compared) and its curve."""
    match = tuple(sorted((key, _matched(v)) for key, v in shaped["match"].items()))
    return match, _curve(
        {k: v for k, v in shaped.items() if k != "match"}, f"{where} at {shaped['match']}", value
    )


def _in_seconds(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with its ``latency_us`` values in seconds (the tables hold microseconds)."""
    return {**body, "latency_us": [us * 1e-6 for us in body["latency_us"]]}


def _seconds(section: dict[str, Any] | None, where: str) -> dict[str, Curve]:
    """Curves of ``latency_us`` by their axis, in seconds."""
    return {k: _curve(_in_seconds(v), f"{where}.{k}", "latency_us") for k, v in (section or {}).items()}


def _floors(body: dict[str, Any], where: str) -> tuple[tuple[Match, Curve], ...]:
    """A module's floors per measured shape, in seconds by tokens."""
    return tuple(_shaped(_in_seconds(shaped), where, "latency_us") for shaped in body["shapes"])


def _all_to_all(body: dict[str, Any]) -> AllToAll:
    def phases(axis: str, values: str, scale: float) -> dict[str, Curve]:
        return {
            phase: _curve({axis: body[axis], "efficiency": [v * scale for v in body[values][phase]]}, phase)
            for phase in ("dispatch", "combine")
        }

    if any(v > 1 for phase in ("dispatch", "combine") for v in body["efficiency"][phase]):
        raise KadaptError("kernel table all_to_all: an efficiency is a fraction of the link bandwidth (<= 1)")
    return AllToAll(
        max_devices=int(max(body["devices"])),
        latency=phases("devices", "latency_us", 1e-6),
        efficiency=phases("tokens", "efficiency", 1.0),
        source=body["source"],
    )


def _base(name: str, path: Path) -> KernelTable:
    """The base table of the table at ``path``: one level only (a base naming a base could loop)."""
    if _read(name, path.parent).get("base"):
        raise KadaptError(f"kernel table {path}: its base {name!r} names a base of its own (one level only)")
    return load_kernels(name, path.parent)


def _read(name: str, folder: Path) -> Any:
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in folder.glob("*.yaml"))) or "none"
        raise KadaptError(f"unknown kernel table {name!r} (known: {known})")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_LOADER)
    except yaml.YAMLError as exc:
        raise KadaptError(f"kernel table {path} is not valid YAML: {exc}") from exc
    return data if isinstance(data, dict) else {}


@cache
def load_kernels(name: str, folder: Path = KERNELS_DIR) -> KernelTable:
    """The table ``name`` (a file ``<name>.yaml`` next to the device profiles' kernels folder)."""
    path = folder / f"{name}.yaml"
    data = _read(name, folder)
    return parse_kernels(data, path)


def table_for(name: str, framework: str, folder: Path = KERNELS_DIR) -> KernelTable:
    """The table a device naming ``name`` serves with under ``framework``: ``<name>_<framework>``
    where that exists, else ``name`` itself (one table for every framework)."""
    specific = f"{name}_{framework}"
    return load_kernels(specific if (folder / f"{specific}.yaml").is_file() else name, folder)
