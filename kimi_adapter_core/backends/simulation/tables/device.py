"""Device profiles as data: YAML files validated by a small JSON Schema.

Shipped profiles live in ``devices/``. Users add their own without touching the package: a file given
with ``--device-file``, or any ``*.yaml`` in ``~/.config/kadapt/devices`` or in the directories listed
in ``$KADAPT_DEVICE_PATH`` (user files shadow shipped ones of the same name). Every section carries a
``source`` string so a reader can check where each number came from. ``kernels: NAME`` names a
kernel-efficiency table (``kernels/NAME.yaml``, see ``kernels.py``) that replaces the flat efficiencies
by measured ones per op kind, dtype and shape. An optional ``ep_low_latency`` section prices the EP
dispatch / combine of decode steps as DeepEP's low-latency kernels run them (``cost.py``): a latency
floor per call by EP size plus the rows' bytes at a measured fraction of each interconnect level.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ....errors import KadaptError, UsageError
from .curves import Curve

SHIPPED_DIR = Path(__file__).resolve().parent / "devices"
USER_DIR = Path("~/.config/kadapt/devices").expanduser()

_SOURCE = {"type": "string", "minLength": 1}
_POSITIVE = {"type": "number", "exclusiveMinimum": 0}
_FRACTION = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
_PHASES = ("dispatch", "combine")


def _per_phase(value: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": list(_PHASES),
        "properties": dict.fromkeys(_PHASES, value),
    }


DEVICE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["name", "memory", "compute", "op_overhead_us", "interconnect"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]+$"},
        "aliases": {"type": "array", "items": {"type": "string"}},
        "description": {"type": "string"},
        "kernels": {"type": "string", "pattern": "^[A-Za-z0-9_.-]+$"},
        "memory": {
            "type": "object",
            "additionalProperties": False,
            "required": ["size_gb", "bandwidth_gbps", "efficiency", "source"],
            "properties": {
                "size_gb": _POSITIVE,
                "bandwidth_gbps": _POSITIVE,
                "efficiency": _FRACTION,
                "source": _SOURCE,
            },
        },
        "compute": {
            "type": "object",
            "additionalProperties": False,
            "required": ["tflops", "efficiency", "source"],
            "properties": {
                "tflops": {
                    "type": "object",
                    "required": ["bf16", "vector"],
                    "propertyNames": {"enum": ["bf16", "fp16", "fp8", "int8", "int4", "fp32", "vector"]},
                    "additionalProperties": _POSITIVE,
                },
                "efficiency": _FRACTION,
                "source": _SOURCE,
            },
        },
        "op_overhead_us": {
            "type": "object",
            "additionalProperties": False,
            "required": ["value", "source"],
            "properties": {"value": {"type": "number", "minimum": 0}, "source": _SOURCE},
        },
        "ep_low_latency": {
            "type": "object",
            "additionalProperties": False,
            "required": ["devices", "latency_us", "efficiency", "source"],
            "properties": {
                "devices": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 2}},
                "latency_us": _per_phase({"type": "array", "minItems": 1, "items": _POSITIVE}),
                "efficiency": _per_phase({"type": "object", "additionalProperties": _FRACTION}),
                "source": _SOURCE,
            },
        },
        "interconnect": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "max_devices", "bandwidth_gbps", "latency_us", "efficiency", "source"],
                "properties": {
                    "name": {"type": "string"},
                    "max_devices": {"type": "integer", "minimum": 2},
                    "bandwidth_gbps": _POSITIVE,
                    "latency_us": {"type": "number", "minimum": 0},
                    "efficiency": _FRACTION,
                    "source": _SOURCE,
                },
            },
        },
    },
}


@dataclass(frozen=True)
class Link:
    name: str
    max_devices: int
    bandwidth: float  # bytes/s, one direction, per device
    latency: float  # seconds per collective
    efficiency: float


@dataclass(frozen=True)
class LowLatencyEP:
    """DeepEP's low-latency dispatch / combine on this device: a fixed cost per call by EP size (the
    kernel's signalling round trips, measured at a near-empty payload) and the fraction of each
    interconnect level's bandwidth its rows reach, per phase (combine reduces as it receives)."""

    latency: dict[str, Curve]  # phase -> seconds by EP group size (log-linear, flat past the ends)
    efficiency: dict[str, dict[str, float]]  # phase -> interconnect name -> fraction of its bandwidth
    source: str


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    memory_bytes: float
    hbm_bandwidth: float  # bytes/s
    memory_efficiency: float
    peak_flops: dict[str, float]  # flop/s by compute dtype
    compute_efficiency: float
    op_overhead: float  # seconds per kernel
    links: tuple[Link, ...]  # narrowest group first
    path: Path
    kernels: str | None = None  # kernel-efficiency table (kernels/<name>.yaml); None: flat efficiencies
    ep_low_latency: LowLatencyEP | None = None  # decode all-to-all as DeepEP LL; None: the roofline

    def peak(self, dtype: str) -> float:
        """Peak for ``dtype``; a dtype the device lacks runs at the next wider one (int4 → int8 → bf16)."""
        for candidate in {
            "int4": ("int4", "int8", "bf16"),
            "int8": ("int8", "bf16"),
            "fp8": ("fp8", "bf16"),
        }.get(dtype, (dtype, "bf16")):
            if candidate in self.peak_flops:
                return self.peak_flops[candidate]
        return self.peak_flops["bf16"]

    def link_for(self, group: int) -> Link:
        """The narrowest interconnect level that spans ``group`` devices."""
        for link in self.links:
            if group <= link.max_devices:
                return link
        raise KadaptError(
            f"device {self.name} has no interconnect level spanning {group} devices "
            f"(widest: {self.links[-1].max_devices})"
        )


def parse_device(data: Any, path: Path) -> Device:
    """Validate one profile document and build the ``Device``."""
    try:
        jsonschema.validate(data, DEVICE_SCHEMA)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise KadaptError(f"device profile {path} is invalid at {where}: {exc.message}") from exc
    mem, comp = data["memory"], data["compute"]
    links = sorted(
        (
            Link(
                k["name"],
                k["max_devices"],
                k["bandwidth_gbps"] * 1e9,
                k["latency_us"] * 1e-6,
                k["efficiency"],
            )
            for k in data["interconnect"]
        ),
        key=lambda link: link.max_devices,
    )
    return Device(
        name=data["name"],
        description=data.get("description", data["name"]),
        memory_bytes=mem["size_gb"] * 1e9,
        hbm_bandwidth=mem["bandwidth_gbps"] * 1e9,
        memory_efficiency=mem["efficiency"],
        peak_flops={k: v * 1e12 for k, v in comp["tflops"].items()},
        compute_efficiency=comp["efficiency"],
        op_overhead=data["op_overhead_us"]["value"] * 1e-6,
        links=tuple(links),
        path=path,
        kernels=data.get("kernels"),
        ep_low_latency=_low_latency(data["ep_low_latency"], links, path)
        if data.get("ep_low_latency")
        else None,
    )


def _low_latency(body: dict[str, Any], links: list[Link], path: Path) -> LowLatencyEP:
    """The ``ep_low_latency`` section; its efficiencies must name every interconnect level (a level
    without one could not be priced) and nothing else."""
    names, sizes = {link.name for link in links}, [float(d) for d in body["devices"]]
    if sizes != sorted(sizes) or any(len(body["latency_us"][p]) != len(sizes) for p in _PHASES):
        raise KadaptError(
            f"device profile {path}: ep_low_latency needs increasing devices and one latency per size"
        )
    for phase in _PHASES:
        if set(body["efficiency"][phase]) != names:
            raise KadaptError(
                f"device profile {path}: ep_low_latency.efficiency.{phase} must name each interconnect "
                f"level ({', '.join(sorted(names))}), got {', '.join(sorted(body['efficiency'][phase]))}"
            )
    return LowLatencyEP(
        latency={p: Curve(tuple(sizes), tuple(v * 1e-6 for v in body["latency_us"][p])) for p in _PHASES},
        efficiency={p: dict(body["efficiency"][p]) for p in _PHASES},
        source=body["source"],
    )


def load_device_file(path: str | Path) -> Device:
    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KadaptError(f"cannot read device profile {file}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise KadaptError(f"device profile {file} is not valid YAML: {exc}") from exc
    return parse_device(data, file)


def _search_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get("KADAPT_DEVICE_PATH", "").split(os.pathsep) if p]
    return [SHIPPED_DIR, USER_DIR, *extra]  # later directories shadow earlier ones


def known_devices() -> dict[str, Device]:
    """Every profile found, by lower-cased name and alias."""
    found: dict[str, Device] = {}
    for folder in _search_dirs():
        if not folder.is_dir():
            continue
        for file in sorted(folder.glob("*.yaml")):
            stat = file.stat()
            device, aliases = _profile(file, stat.st_mtime_ns, stat.st_size)
            for key in (device.name, *aliases):
                found[key.lower()] = device
    return found


def shipped_device_names() -> list[str]:
    """The names of the device profiles kadapt ships (its ``devices/`` folder), sorted."""
    return sorted(load_device_file(file).name for file in SHIPPED_DIR.glob("*.yaml"))


@lru_cache(maxsize=256)
def _profile(file: Path, _mtime_ns: int, _size: int) -> tuple[Device, tuple[str, ...]]:
    """One profile of the search folders and its aliases, parsed once per version of the file (keyed by
    its modification time and size): every ``get_device`` lists the folders, and validating each
    profile again took ~5 ms per file, 0.1 s per lookup (a calibration makes one per table)."""
    device = load_device_file(file)
    aliases = yaml.safe_load(file.read_text(encoding="utf-8")).get("aliases") or []
    return device, tuple(aliases)


def get_device(name: str | None, device_file: str | Path | None = None) -> Device:
    """Resolve ``--device``/``--device-file``; an unknown name lists the known ones."""
    if device_file is not None:
        return load_device_file(device_file)
    devices = known_devices()
    names = ", ".join(sorted({d.name for d in devices.values()}))
    if not name:
        raise UsageError(f"no device given: use --device NAME (one of: {names}) or --device-file PATH")
    device = devices.get(name.lower())
    if device is None:
        raise UsageError(f"unknown device {name!r}; known devices: {names}")
    return device
