"""What an extraction produced, for people (``render``) and tools (``to_dict``)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

_MARK = re.compile(r" \(process \d+\)$")


def process_mark(number: int) -> str:
    """What ``forked`` appends to the steps its ``number``-th child ran: ``" (process 2)"``."""
    return f" (process {number})"


@dataclass(frozen=True)
class GraphStats:
    kind: str
    path: Path
    nodes: int
    inputs: int
    outputs: int
    weights: int
    parameters: int  # elements of all weights the graph reads
    ops: Counter[str]
    bytes: int
    traced_layers: int
    layers: int

    def to_dict(self, top: int) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "nodes": self.nodes,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "weights": self.weights,
            "parameters": self.parameters,
            "bytes": self.bytes,
            "layers": self.layers,
            "traced_layers": self.traced_layers,
            "top_ops": dict(self.ops.most_common(top)),
        }


@dataclass(frozen=True)
class CacheUse:
    """The extraction cache's part in a run: restored from it, stored in it, or why neither."""

    key: str | None  # None when the run's inputs cannot be keyed
    hit: bool = False
    stored: bool = False
    reason: str | None = None  # why it was not stored (or not even looked up)
    first_seconds: float | None = None  # on a hit: how long the run that stored it took to extract

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def render(self) -> str:
        key = f"key {self.key[:12]}" if self.key else ""
        if self.hit:
            return f"restored ({key}; extracting took {self.first_seconds or 0:.1f} s)"
        if self.stored:
            return f"stored ({key})"
        return f"not stored: {self.reason}"


@dataclass
class ExtractionSummary:
    model_name: str
    kv_layout: str
    sizes: dict[str, int]
    mla_attention: str = "reexpand"
    attention_label: str = ""
    graphs: dict[str, GraphStats] = field(default_factory=dict)
    kv_mapping: Path | None = None
    kv_mapping_bytes: int = 0
    weight_map: Path | None = None
    weight_map_bytes: int = 0
    vision: str | None = None  # the image ABI of the vision graph, when one was exported
    notes: list[str] = field(default_factory=list)  # what the run left out and why
    steps: list[tuple[str, float]] = field(default_factory=list)
    top_ops: int = 12
    cache: CacheUse | None = None  # what the extraction cache did for this run (CLI runs only)

    @property
    def seconds(self) -> float:
        """The run's own time: steps its export processes ran (``forked``; this process waited for
        them, and that wait is a step of its own) do not add to it."""
        return sum(seconds for name, seconds in self.steps if not _MARK.search(name))

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "kv_layout": self.kv_layout,
            "mla_attention": self.mla_attention,
            **self.sizes,
            "graphs": {kind: stats.to_dict(self.top_ops) for kind, stats in self.graphs.items()},
            "kv_mapping": {"path": str(self.kv_mapping), "bytes": self.kv_mapping_bytes},
            "weight_map": {"path": str(self.weight_map), "bytes": self.weight_map_bytes},
            **({"vision": self.vision} if self.vision is not None else {}),
            **({"notes": self.notes} if self.notes else {}),
            "steps": [{"step": name, "seconds": round(seconds, 3)} for name, seconds in self.steps],
            "seconds": round(self.seconds, 3),
            **({"cache": self.cache.to_dict()} if self.cache is not None else {}),
        }

    @property
    def artifacts(self) -> list[Path]:
        """Every file the run wrote, graphs first."""
        files = [stats.path for stats in self.graphs.values()]
        return files + [p for p in (self.kv_mapping, self.weight_map) if p is not None]

    def moved_to(self, directory: Path) -> ExtractionSummary:
        """The same run with its files in ``directory`` (``job.held.Held``: written in a hidden folder,
        renamed into the output folder once verified)."""
        return replace(
            self,
            graphs={kind: replace(g, path=directory / g.path.name) for kind, g in self.graphs.items()},
            kv_mapping=directory / self.kv_mapping.name if self.kv_mapping is not None else None,
            weight_map=directory / self.weight_map.name if self.weight_map is not None else None,
        )

    def to_record(self) -> dict[str, Any]:
        """Everything but the cache's part, losslessly as JSON data, with file names instead of
        paths: ``from_record`` rebuilds it for files restored into another directory."""
        return {
            "model_name": self.model_name,
            "kv_layout": self.kv_layout,
            "sizes": self.sizes,
            "mla_attention": self.mla_attention,
            "attention_label": self.attention_label,
            "graphs": {
                kind: {**asdict(stats), "path": stats.path.name, "ops": dict(stats.ops)}
                for kind, stats in self.graphs.items()
            },
            "kv_mapping": [self.kv_mapping.name, self.kv_mapping_bytes] if self.kv_mapping else None,
            "weight_map": [self.weight_map.name, self.weight_map_bytes] if self.weight_map else None,
            "vision": self.vision,
            "notes": self.notes,
            "steps": self.steps,
            "top_ops": self.top_ops,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any], directory: Path) -> ExtractionSummary:
        """The summary ``to_record`` stored, its files in ``directory``."""
        kv_mapping, weight_map = record["kv_mapping"], record["weight_map"]
        return cls(
            model_name=record["model_name"],
            kv_layout=record["kv_layout"],
            sizes=dict(record["sizes"]),
            mla_attention=record["mla_attention"],
            attention_label=record["attention_label"],
            graphs={
                kind: GraphStats(**{**stats, "path": directory / stats["path"], "ops": Counter(stats["ops"])})
                for kind, stats in record["graphs"].items()
            },
            kv_mapping=directory / kv_mapping[0] if kv_mapping else None,
            kv_mapping_bytes=kv_mapping[1] if kv_mapping else 0,
            weight_map=directory / weight_map[0] if weight_map else None,
            weight_map_bytes=weight_map[1] if weight_map else 0,
            vision=record["vision"],
            notes=list(record["notes"]),
            steps=[(name, seconds) for name, seconds in record["steps"]],
            top_ops=record["top_ops"],
        )

    def render(self) -> str:
        sizes = ", ".join(f"{k} {v}" for k, v in self.sizes.items())
        verb = "restored" if self.cache is not None and self.cache.hit else "extracted"  # not traced again
        lines = [f"{verb} {self.model_name} ({self.attention_label}; {sizes}) in {self.seconds:.1f} s"]
        width = max([8, *map(len, self.graphs)])  # prefill_mm is wider than the other kinds
        for kind, stats in self.graphs.items():
            traced = f", {stats.traced_layers} traced" if stats.traced_layers != stats.layers else ""
            lines.append(
                f"  {kind:<{width}} {stats.nodes:>7,} nodes  {stats.inputs} inputs  {stats.outputs} outputs  "
                f"{stats.weights:,} weights ({stats.parameters / 1e9:.2f} B params)  "
                f"{_size(stats.bytes)}  {stats.layers} layers{traced}  -> {stats.path}"
            )
            ops = ", ".join(f"{op.split('.')[1]} {n}" for op, n in stats.ops.most_common(self.top_ops))
            lines.append(f"{'':{width + 3}}ops: {ops}")
        if self.vision is not None:
            lines.append(f"  image    {self.vision}")
        if self.kv_mapping is not None:
            lines.append(f"  kv map   {_size(self.kv_mapping_bytes)}  -> {self.kv_mapping}")
        if self.weight_map is not None:
            lines.append(f"  weights  {_size(self.weight_map_bytes)}  -> {self.weight_map}")
        if self.cache is not None:
            lines.append(f"  cache    {self.cache.render()}")
        lines.append("  time: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.steps))
        return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"
