"""What an extraction produced, for people (``render``) and tools (``to_dict``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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

    @property
    def seconds(self) -> float:
        return sum(seconds for _, seconds in self.steps)

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
        }

    def render(self) -> str:
        sizes = ", ".join(f"{k} {v}" for k, v in self.sizes.items())
        lines = [f"extracted {self.model_name} ({self.attention_label}; {sizes}) in {self.seconds:.1f} s"]
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
        lines.append("  time: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.steps))
        return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"
