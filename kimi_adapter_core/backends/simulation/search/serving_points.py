"""Published end-to-end serving measurements (``tables/published/serving_points.yaml``), read and checked.

Each point is one public benchmark run of one server: a model, a device and count, a framework and its
version, the server's layout, N concurrent requests of a prompt and output length, and what the
benchmark client measured (output tokens/s of the whole server, mean and median TTFT and TPOT). They
are kadapt's untouched test: no cost table was fitted on them, ``benchmarks/bench_simulation.py --only
serving`` prices each with ``kadapt simulate --concurrency`` and prints the ratio.

Separate from the bench so that a test can hold every point to the schema (a typo in a key, a missing
source or certainty note, a layout that does not match the device count fails loudly, naming the point)
without importing the pricing machinery.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from packaging.version import InvalidVersion, Version

from ....errors import KadaptError
from ..model.parallel import Parallel
from .benchmark_run import RandomPrompts

POINTS_FILE = Path(__file__).parents[1] / "tables" / "published" / "serving_points.yaml"
FRAMEWORKS = ("trtllm", "sglang", "vllm")
_KEYS = {
    "id",
    "source",
    "model",
    "device",
    "devices",
    "framework",
    "framework_version",
    "layout",
    "kv_dtype",
    "workload",
    "concurrency",
    "measured_concurrency",
    "measured",
    "certainty",
    "engine",
    "step_tokens",
}
_MEASURED = ("output_tok_s", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms")
_WORKLOAD = ("dataset", "requests", "total_input_tokens", "total_output_tokens")


@dataclass(frozen=True)
class ServingPoint:
    """One published measurement; ``isl`` / ``osl`` are the run's mean lengths (its token totals over
    its requests: benchmark clients draw lengths per request unless told not to)."""

    id: str
    url: str
    title: str
    spec: str  # specs/<spec>.yaml
    checkpoint: str
    device: str  # a kadapt device profile
    devices: int
    framework: str
    version: str
    parallel: Parallel  # the layout kadapt prices
    layout_stated: str
    layout_assumed: bool  # ``parallel`` is not the stated layout (see the point's certainty note)
    moe_tp: int  # the routed-expert sharding (expert TP x EP = devices), as stated or as priced
    moe_ep: int
    kv_dtype: str
    isl: int
    osl: int
    concurrency: int
    output_tok_s: float  # the whole server's
    mean_ttft_ms: float
    median_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    certainty: str
    cuda_graphs: bool = True  # the engine replayed its decode step as a CUDA graph (``engine``; default)
    engine_source: str = ""  # where the engine's source says how it ran the step ("": not read)
    # the step budget per DP group the server ran with (a stated flag, its release's default) where it is
    # not ``frameworks.yaml``'s default
    step_tokens: int | None = None
    # the run's requests as its client drew them (bench_serving's random dataset), or None where the
    # lengths cannot be drawn again (a dataset file's prompts): priced as the steady state then
    prompts: RandomPrompts | None = None
    # the client's mean requests in flight over the run (bench_serving's ``concurrency``), where published
    measured_concurrency: float | None = None

    @property
    def release(self) -> str:
        """The framework release the point ran, as ``--framework-version`` takes it (the version's
        first word: ``0.17.post1.dev (PyTorch backend, ...)`` ran 0.17.post1.dev)."""
        return self.version.split()[0]

    @property
    def output_tok_s_per_device(self) -> float:
        return self.output_tok_s / self.devices


def _need(entry: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = entry.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) or value == "":
        raise KadaptError(f"{where}: {key} missing or not a {kind} (got {value!r})")
    return value


def _engine(entry: dict[str, Any], where: str) -> tuple[bool, str]:
    """A point's ``engine`` fact: whether its decode step ran as a CUDA graph and where the engine's
    source says so; (True, "") when the point states none."""
    engine = entry.get("engine")
    if engine is None:
        return True, ""
    if not isinstance(engine, dict) or set(engine) != {"cuda_graphs", "source"}:
        raise KadaptError(f"{where}: engine must be a mapping of cuda_graphs and source (got {engine!r})")
    if not isinstance(engine["cuda_graphs"], bool):
        raise KadaptError(
            f"{where}: engine.cuda_graphs must be true or false (got {engine['cuda_graphs']!r})"
        )
    return engine["cuda_graphs"], _need(engine, "source", str, f"{where} engine")


def _step_tokens(entry: dict[str, Any], where: str) -> int | None:
    """A point's ``step_tokens`` fact: the step budget per DP group the server ran with where that is
    not the framework's current default (``frameworks.yaml``): a stated launch flag, or the default of
    its release, with where it is stated or the release's source says so; None when the point states
    none."""
    step = entry.get("step_tokens")
    if step is None:
        return None
    if not isinstance(step, dict) or set(step) != {"per_dp_group", "source"}:
        raise KadaptError(f"{where}: step_tokens must be a mapping of per_dp_group and source (got {step!r})")
    _need(step, "source", str, f"{where} step_tokens")
    tokens = _need(step, "per_dp_group", int, f"{where} step_tokens")
    if tokens < 1:
        raise KadaptError(f"{where}: step_tokens.per_dp_group must be >= 1 (got {tokens})")
    return tokens


def _prompts(workload: dict[str, Any], where: str) -> RandomPrompts | None:
    """A random-dataset point's ``range_ratio`` and ``seed`` (both required there, refused elsewhere):
    the client's draws of its requests' lengths."""
    keys = {"range_ratio", "seed"} & set(workload)
    if workload["dataset"] != "random":
        if keys:
            raise KadaptError(f"{where}: workload {sorted(keys)} belong to the random dataset only")
        return None
    ratio, seed = workload.get("range_ratio"), workload.get("seed")
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 <= ratio <= 1:
        raise KadaptError(f"{where}: workload.range_ratio must be a number in [0, 1] (got {ratio!r})")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise KadaptError(f"{where}: workload.seed must be an integer in [0, 2**32) (got {seed!r})")
    isl, osl = (_need(workload, k, int, f"{where} workload") for k in ("isl_nominal", "osl_nominal"))
    return RandomPrompts(isl, osl, workload["requests"], float(ratio), seed)


def _measured_concurrency(entry: dict[str, Any], where: str) -> float | None:
    """The published mean requests in flight (null where the source's column is not usable)."""
    value = entry.get("measured_concurrency")
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise KadaptError(f"{where}: measured_concurrency must be a number > 0 or null (got {value!r})")
    return float(value)


def _point(entry: dict[str, Any], index: int, file: str) -> ServingPoint:
    where = f"{file}: point {index} ({entry.get('id', '?')})"
    unknown = set(entry) - _KEYS
    if unknown:
        raise KadaptError(f"{where}: unknown keys {sorted(unknown)}")
    source, model = _need(entry, "source", dict, where), _need(entry, "model", dict, where)
    layout, workload = _need(entry, "layout", dict, where), _need(entry, "workload", dict, where)
    measured = _need(entry, "measured", dict, where)
    for key in ("url", "title"):
        _need(source, key, str, f"{where} source")
    if not str(source["url"]).startswith("https://"):
        raise KadaptError(f"{where}: source.url must be an https address")
    for key in _WORKLOAD:
        _need(workload, key, (str, int), f"{where} workload")
    for key in _MEASURED:
        if _need(measured, key, (int, float), f"{where} measured") <= 0:
            raise KadaptError(f"{where}: measured.{key} must be > 0")
    framework = _need(entry, "framework", str, where)
    if framework not in FRAMEWORKS:
        raise KadaptError(f"{where}: framework {framework!r} not in {FRAMEWORKS}")
    sizes = (_need(layout, k, int, f"{where} layout") for k in ("tp", "dp", "ep"))
    par = Parallel(*sizes, moe_tp=int(layout.get("moe_tp", 1)))  # priced with the stated expert TP
    devices = _need(entry, "devices", int, where)
    if par.devices != devices:
        raise KadaptError(f"{where}: layout tp x dp = {par.devices} but devices = {devices}")
    moe_tp, moe_ep = int(layout.get("moe_tp", 1)), int(layout.get("moe_ep", par.ep))
    if "moe_tp" in layout and moe_tp * moe_ep != devices:
        raise KadaptError(f"{where}: layout moe_tp x moe_ep must be {devices} devices")
    if par.ep != moe_ep and not layout.get("assumed"):
        raise KadaptError(f"{where}: layout ep is not the stated MoE's: mark it assumed")
    cuda_graphs, engine_source = _engine(entry, where)
    version = str(_need(entry, "framework_version", (str, int, float), where))
    try:
        Version(version.split()[0])
    except InvalidVersion:
        raise KadaptError(
            f"{where}: framework_version must start with a release version (got {version!r})"
        ) from None
    requests = workload["requests"]
    isl = round(workload["total_input_tokens"] / requests)
    osl = round(workload["total_output_tokens"] / requests)
    return ServingPoint(
        id=_need(entry, "id", str, where),
        url=source["url"],
        title=source["title"],
        spec=_need(model, "spec", str, f"{where} model"),
        checkpoint=_need(model, "checkpoint", str, f"{where} model"),
        device=_need(entry, "device", str, where),
        devices=devices,
        framework=framework,
        version=version,
        parallel=par,
        layout_stated=_need(layout, "stated", str, f"{where} layout"),
        layout_assumed=bool(layout.get("assumed", False)),
        moe_tp=moe_tp if "moe_tp" in layout else devices // par.ep,
        moe_ep=moe_ep,
        kv_dtype=_need(entry, "kv_dtype", str, where),
        isl=isl,
        osl=osl,
        concurrency=_need(entry, "concurrency", int, where),
        output_tok_s=float(measured["output_tok_s"]),
        mean_ttft_ms=float(measured["mean_ttft_ms"]),
        median_ttft_ms=float(measured["median_ttft_ms"]),
        mean_tpot_ms=float(measured["mean_tpot_ms"]),
        median_tpot_ms=float(measured["median_tpot_ms"]),
        certainty=_need(entry, "certainty", str, where),
        cuda_graphs=cuda_graphs,
        engine_source=engine_source,
        step_tokens=_step_tokens(entry, where),
        prompts=_prompts(workload, where),
        measured_concurrency=_measured_concurrency(entry, where),
    )


def load_points(path: Path = POINTS_FILE) -> tuple[ServingPoint, ...]:
    """Every point of ``path``, checked (``KadaptError`` naming the point and key otherwise)."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise KadaptError(f"{path.name}: expected a mapping with a list under 'points'")
    points = tuple(_point(entry, i, path.name) for i, entry in enumerate(data["points"]))
    seen: set[str] = set()
    for p in points:
        if p.id in seen:
            raise KadaptError(f"{path.name}: point id {p.id!r} appears twice")
        seen.add(p.id)
    return points


@cache
def serving_points() -> tuple[ServingPoint, ...]:
    """The shipped points (``published/serving_points.yaml``), read once."""
    return load_points()
