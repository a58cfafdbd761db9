"""Where simulate finds the parts of the model built for a spec, and how it swaps in serving kernels.

The per-rank model (``rank_model``) is transformers' own model built on meta; simulate replaces its
MLA attention, routed experts and linear mixers with kernels that record what a serving runtime runs.
These find those modules (by the spec's class names, or the experts' stacked weights) and the stack's
parts (``module_paths``), each with a located error naming what was looked for and what is there.
"""

from __future__ import annotations

from torch import nn

from ....errors import KadaptError
from ....spec.model import Spec
from ....structure.model import ModelStructure


def find_modules(
    spec: Spec, root: nn.Module, where: str, section: str, key: str, name: str
) -> list[tuple[str, nn.Module]]:
    """Every module under ``root`` whose class is named ``name`` (non-empty, or a located error)."""
    found = [(path, m) for path, m in root.named_modules() if path and type(m).__name__ == name]
    if not found:
        seen = ", ".join(sorted({type(m).__name__ for m in root.modules()}))
        raise KadaptError(
            f"{section}.{key} = {name!r} matches no module in {where} of the model built for spec "
            f"{spec.name}; the classes there are: {seen}",
            location=spec.locate(f"{section}.{key}"),
        )
    return found


def stacked_experts(root: nn.Module, experts: int) -> list[tuple[str, nn.Module]]:
    """Modules holding stacked expert weights (``[num_experts, out, in]`` parameters of their own)."""
    return [
        (path, m)
        for path, m in root.named_modules()
        if path and any(p.dim() == 3 and p.shape[0] == experts for p in m.parameters(recurse=False))
    ]


def swap(root: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` where ``path`` (relative to ``root``) is: the serving kernel in the built model's place."""
    parent, _, child = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def stack_child(spec: Spec, lm: nn.Module, key: str, *, optional: bool = False) -> nn.Module | None:
    """The stack part ``key`` (``module_paths``: ``final_norm``, ``rotary_embedding``) of the text model;
    an ``optional`` one may be absent (a NoPE / SSM stack has no rotary embedding); None where the spec
    says the stack has none (``final_norm: null``)."""
    parts = spec.stack_parts()
    if key in parts.stated and parts.stated[key] is None:
        return None
    try:
        module = lm.get_submodule(str(parts.path(key)))
    except AttributeError:
        module = None
    if module is None and optional and key not in parts.stated:
        return None
    if not isinstance(module, nn.Module):
        raise KadaptError(parts.missing(lm, key), location=parts.where(key))
    return module


def experts_of(spec: Spec, layer: nn.Module, where: str, s: ModelStructure) -> list[tuple[nn.Module, str]]:
    """(parent, path) of every routed-experts module in an MoE layer: inside the spec's
    ``moe.moe_class`` blocks, of class ``moe.experts_class`` when the spec names one, else the
    modules holding the stacked ``[num_experts, ...]`` expert weights."""
    assert s.moe is not None
    moe = spec.moe or {}
    roots = (
        find_modules(spec, layer, where, "moe", "moe_class", moe["moe_class"])
        if moe.get("moe_class")
        else [("", layer)]
    )
    found: list[tuple[nn.Module, str]] = []
    for _, root in roots:
        if moe.get("experts_class"):
            matches = find_modules(spec, root, where, "moe", "experts_class", moe["experts_class"])
        else:
            matches = stacked_experts(root, s.moe.num_experts)
            if not matches:
                lists = [
                    type(m).__name__
                    for m in root.modules()
                    if isinstance(m, nn.ModuleList) and len(m) == s.moe.num_experts
                ]
                detail = " (its experts are a per-expert module list)" if lists else ""
                raise KadaptError(
                    f"no module in {where} of the model built for spec {spec.name} holds the "
                    f"{s.moe.num_experts} routed experts as stacked weights{detail}; simulate prices an "
                    "experts module called as transformers' (hidden_states, top_k_index, top_k_weights): "
                    "name its class under moe.experts_class",
                    location=spec.locate("moe" if spec.moe else "metadata"),
                )
        found += [(root, path) for path, _ in matches]
    return found
