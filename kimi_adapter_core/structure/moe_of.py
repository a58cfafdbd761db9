"""The routed experts a config declares and which layers hold them (``moe`` vs ``dense`` MLPs).

Read from ``config_keys.yaml``'s fact keys, the spec's ``architecture`` (``router``, ``dense_layers``)
and the older ``moe.routing`` section; a scoring function kadapt does not know is refused, located.
"""

from __future__ import annotations

from ..errors import KadaptError, Refusal
from ..spec.model import Spec
from .model import SCORING_FUNCS, Moe
from .reader import Reader, locate, tables


def moe_of(read: Reader, spec: Spec | None) -> Moe | None:
    """The routed experts the config declares (None: a dense stack, or a switch that turns them off),
    with their routing as the spec states it, else the config's keys."""
    switched_off = any(read.raw(key) is False for key in tables()["moe_switches"])
    experts = 0 if switched_off else int(read.get("num_experts", 0) or 0)
    if experts <= 0:
        if spec is not None and spec.moe:
            raise KadaptError(
                f"the spec has a `moe` section but {read.where} declares no routed experts "
                f"(looked for: {', '.join(read.candidates['num_experts'])})",
                location=spec.locate("moe"),
            )
        return None
    top_k = int(read.require("top_k"))
    width = int(read.get("expert_intermediate_size") or read.require("intermediate_size"))
    shared = int(read.get("num_shared_experts", 0) or 0)
    shared_width = read.get("shared_expert_intermediate_size")
    if shared_width:  # Qwen2-MoE style: one shared expert of its own width
        shared, shared_total = max(shared, 1), int(shared_width)
    else:
        shared_total = shared * width
    router = dict((spec.architecture or {}).get("router") or {}) if spec else {}
    routing = dict((spec.moe or {}).get("routing") or {}) if spec else {}
    # routing has one source: the spec's statement, else the config's key, else nothing (no default)
    scoring = router.get("scoring") or routing.get("scoring_func") or read.get("scoring_func")
    if scoring is not None and scoring not in SCORING_FUNCS:
        raise Refusal(
            "routing",
            f"{read.where}: router scoring {scoring!r} is not one kadapt knows; "
            f"valid: {', '.join(SCORING_FUNCS)}",
            location=locate(spec, "architecture.router.scoring"),
        )
    normalize = router.get("normalize_top_k")
    if normalize is None:
        normalize = read.get("norm_topk_prob")
    return Moe(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=width,
        num_shared_experts=shared,
        shared_intermediate_size=shared_total,
        scoring=scoring,
        normalize_top_k=None if normalize is None else bool(normalize),
        routed_scaling_factor=float(read.get("routed_scaling_factor", 1.0)),
        expert_groups=int(read.get("expert_groups", 1) or 1),
        top_k_groups=int(read.get("top_k_groups", 1) or 1),
        hash_layers=hash_layers(read),
    )


def hash_layers(read: Reader) -> tuple[int, ...]:
    """The MoE layers whose router picks the experts by token id (``mlp_layer_types`` of a
    ``hash_routed_mlp_types`` entry: DeepSeek-V4's ``hash_moe``, ``tid2eid[input_ids]``)."""
    types = read.get("mlp_layer_types") or ()
    return tuple(i for i, kind in enumerate(types) if kind in tables()["hash_routed_mlp_types"])


def moe_layer_kinds(read: Reader, spec: Spec | None, num_layers: int, moe: Moe | None) -> list[str]:
    """Each layer's MLP, ``dense`` or ``moe``: the spec's ``dense_layers``, else the config's per-layer
    list, MoE layer list, period or first dense layers and step."""
    if moe is None:
        return ["dense"] * num_layers
    stated = (spec.architecture or {}).get("dense_layers") if spec else None
    if stated is not None:
        bad = [i for i in stated if not 0 <= i < num_layers]
        if bad:
            raise KadaptError(
                f"architecture.dense_layers names layers {bad} outside 0..{num_layers - 1}",
                location=locate(spec, "architecture.dense_layers"),
            )
        dense = set(stated)
    else:
        types = read.get("mlp_layer_types")  # one 'dense' / 'sparse' per layer (Kimi-Linear, GLM-5)
        if types is not None:
            return ["dense" if i < len(types) and types[i] == "dense" else "moe" for i in range(num_layers)]
        moe_listed = read.get("moe_layer_list")  # Llama-4's moe_layers: the MoE layers, the rest dense
        if moe_listed is not None:
            sparse = set(moe_listed)
            return ["moe" if i in sparse else "dense" for i in range(num_layers)]
        period = read.get("moe_layer_period")  # Jamba: layer i is MoE iff i % period == offset
        if period:
            offset = int(read.get("moe_layer_offset", 0) or 0)
            return ["moe" if i % int(period) == offset else "dense" for i in range(num_layers)]
        first = int(read.get("first_dense_layers", 0) or 0)
        listed = set(read.get("dense_layer_list", []) or [])
        step = int(read.get("moe_layer_step", 1) or 1)
        dense = {i for i in range(num_layers) if i < first or i in listed or (i + 1) % step}
    return ["dense" if i in dense else "moe" for i in range(num_layers)]
