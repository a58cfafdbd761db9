"""What both a plan and a simulation print: the units, the text table and the memory per device.

Separate so that ``plan`` and ``simulation`` lay out their tables and memory figures one way
(the same columns, the same JSON keys) without importing each other.
"""

from __future__ import annotations

from typing import Any

from ..estimate.planner import Memory

GB = 1e9
MIB = 2**20


def text_table(headers: list[str], rows: list[list[str]], text_columns: int = 1) -> str:
    """Left-align the first ``text_columns`` columns, right-align the (numeric) rest."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))

    def cell(i: int, text: str) -> str:
        return text.ljust(widths[i]) if i < text_columns else text.rjust(widths[i])

    body = ["  ".join(cell(i, text) for i, text in enumerate(r)) for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


def memory_json(mem: Memory) -> dict[str, Any]:
    return {
        "weights_bytes": mem.weights,
        "kv_cache_bytes": mem.kv_cache,
        "activation_bytes": mem.activations,
        "vision_cache_bytes": mem.vision_cache,
        "used_bytes": mem.used,
        "capacity_bytes": mem.capacity,
        "free_bytes": mem.free,
    }


def memory_text(mem: Memory) -> list[str]:
    out = [
        f"  weights/device      {mem.weights / GB:10.2f} GB",
        f"  KV cache/device     {mem.kv_cache / GB:10.2f} GB",
        f"  activations/device  {mem.activations / GB:10.2f} GB",
    ]
    if mem.vision_cache:
        out.append(f"  vision cache/device {mem.vision_cache / GB:10.2f} GB")
    if mem.capacity is not None and mem.free is not None:
        out += [
            f"  capacity            {mem.capacity / GB:10.2f} GB",
            f"  free                {mem.free / GB:10.2f} GB",
        ]
    return out
