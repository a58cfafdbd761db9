"""Typed, read-only view of a validated adapter spec.

The YAML is validated against the JSON Schema first (``schema/adapter-spec.v1.json``); these dataclasses
are built only from documents that passed, so they do no validation of their own. Every entry keeps the
``where`` path of the node it came from: later stages point back at the spec line (``Spec.locate``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BACKENDS = ("extraction", "simulation")
LAYER = "{layer}"  # the per-layer placeholder in ABI tensor names (``present.{layer}.key``)

Location = tuple[int, int]  # 1-based (line, column)


@dataclass(frozen=True)
class Gate:
    model_type: str
    sub_configs: dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class HubSource:
    repo: str
    revision: str


@dataclass(frozen=True)
class Source:
    config: Path | None  # absolute path of the shipped config file, resolved against the spec
    hub: HubSource | None
    trust_remote_code: bool


@dataclass(frozen=True)
class EnvironmentShim:
    id: str
    why: str
    kind: str  # "inject_symbol"
    target: str  # "module:attr"
    impl: str
    where: str


@dataclass(frozen=True)
class ConfigBridge:
    id: str
    why: str
    op: str  # rename | copy | derive | set_default | set | rewrite
    source: str | None  # "from" in YAML
    dest: str | None  # "to" in YAML
    path: str | None
    value: Any
    has_value: bool
    fallback: Any
    has_fallback: bool
    when: dict[str, Any]
    backends: tuple[str, ...]
    where: str


@dataclass(frozen=True)
class Pin:
    """One upstream source a patch was reviewed against: its signature and/or source sha256 and, in a
    per-release pin (a list under ``pin:``), the transformers release it came from (None: the
    one-source form, which names no release)."""

    signature: str | None
    source_sha256: str | None
    release: str | None = None


@dataclass(frozen=True)
class Patch:
    id: str
    why: str
    target: str  # "module:Class.attr" or "remote:module:Class.attr"
    kind: str  # replace | wrap | adapt_return | set_attribute | meta_stub
    impl: str | None  # "builtin:name" or "package.module:callable"
    options: dict[str, Any]
    value: Any
    pins: tuple[Pin, ...]  # the sources it was reviewed against, any of which it applies to; () unpinned
    backends: tuple[str, ...]
    where: str

    @property
    def is_remote(self) -> bool:
        return self.target.startswith("remote:")


@dataclass(frozen=True)
class QuantScheme:
    id: str
    why: str
    modules: str
    bits: int
    group_size: int
    packed_dtype: str
    scale_dtype: str


@dataclass(frozen=True)
class GraphAbi:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class MergedPrefillAbi:
    """``abi.vision.merged_prefill``: a prefill graph whose image placeholder tokens take the vision
    graph's features (inputs ``[ids, features, mask, positions]``, outputs like ``abi.prefill``)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    prefill_len: int | None = None  # prompt length, placeholders included; None: abi.prefill_len


@dataclass(frozen=True)
class VisionAbi:
    """``abi.vision``: the vision graph's fixed image ABI (patch grids packed into one call)."""

    projector: str  # module path of the projector; the encoder is module_paths.vision_tower
    grid_thws: tuple[tuple[int, int, int], ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    merge_kernel: tuple[int, int] | None = None  # a claim checked against the vision config
    merged_prefill: MergedPrefillAbi | None = None


@dataclass(frozen=True)
class KvCacheAbi:
    """``abi.kv_cache``: contiguous per-row caches, or a paged block pool with a block-table input."""

    kind: str = "contiguous"  # contiguous | paged
    block_size: int = 16
    num_blocks: int | None = None  # None: batch * max_cache_len / block_size
    block_table: str = "block_table"

    @classmethod
    def from_raw(cls, raw: str | dict[str, Any] | None) -> KvCacheAbi:
        if raw is None or isinstance(raw, str):
            return cls(kind=raw or "contiguous")
        return cls(
            kind=raw["kind"],
            block_size=raw.get("block_size", 16),
            num_blocks=raw.get("num_blocks"),
            block_table=raw.get("block_table", "block_table"),
        )


@dataclass(frozen=True)
class StepAbi:
    """``abi.step``: also export the packed step graph (``runtime/step.py``) over the paged pool: ``tokens``
    packed tokens per call, logits for ``logits`` of them (default: one per request, ``abi.batch``)."""

    tokens: int
    logits: int | None = None
    mtp: bool = False  # also the MTP draft graph (runtime/mtp.py); the step graph returns hidden states
    # decoder layers whose output hidden states the step graph also returns (an EAGLE-3 draft's features)
    aux_layers: tuple[int, ...] = ()

    @classmethod
    def from_raw(cls, raw: dict[str, Any] | None) -> StepAbi | None:
        if raw is None:
            return None
        aux = tuple(raw.get("aux_layers", ()))
        return cls(
            tokens=raw["tokens"], logits=raw.get("logits"), mtp=bool(raw.get("mtp", False)), aux_layers=aux
        )


def paged_size_problems(block_size: int, num_blocks: int | None, max_cache_len: int) -> list[tuple[str, str]]:
    """What is wrong with a paged cache of these sizes, as ``(field of abi.kv_cache, message)``: the one
    rule ``validate`` reports located at each field and ``apply`` raises."""
    per_row = max_cache_len // block_size
    if max_cache_len % block_size:
        message = (
            f"block_size {block_size} does not divide max_cache_len {max_cache_len}: each row's cache is "
            "whole blocks"
        )
        return [("block_size", message)]
    if num_blocks is not None and num_blocks < per_row:
        message = (
            f"num_blocks {num_blocks} cannot hold one row at max_cache_len {max_cache_len} "
            f"({per_row} blocks of {block_size})"
        )
        return [("num_blocks", message)]
    return []


def paged_name_problems(block_table: str, decode_inputs: Iterable[str]) -> list[tuple[str, str]]:
    """The block-table input must not take the name of another decode input (same form as above)."""
    if block_table in decode_inputs:
        return [("block_table", f"block-table input {block_table!r} is already an abi.decode input")]
    return []


@dataclass(frozen=True)
class Abi:
    config: str | None  # sub-config holding the text backbone, None for a flat config
    batch: int
    prefill_len: int
    max_cache_len: int
    dtype: str
    kv_layout: str | None  # heads | latent | expanded; None: the attention kind's default
    prefill: GraphAbi
    decode: GraphAbi
    mla_attention: str = "reexpand"  # reexpand | absorbed (latent layout only)
    vision: VisionAbi | None = None  # the vision graph, for vision-language models that declare it
    dynamic: tuple[str, ...] = ()  # sizes exported as dynamic dimensions (batch, prefill_len)
    kv_cache: KvCacheAbi = KvCacheAbi()
    step: StepAbi | None = None  # abi.step: also export the packed step graph (needs a paged kv_cache)


# The decoder stack's parts the prefill/decode wrappers call, by ``module_paths`` key, at the paths
# (relative to ``module_paths.language_model``) where transformers' decoder models keep them; a spec
# names another path where a family differs (Mamba2: ``embeddings``, ``norm_f``). A stack without a
# rotary embedding (NoPE, SSM) runs without one. Learned absolute position embeddings (GPT-2's ``wpe``,
# OPT's ``embed_positions``) and a norm over the embeddings (BLOOM's ``word_embeddings_layernorm``) have
# no usual name (None): a stack has them only where the spec names them.
STACK_PARTS: dict[str, str | None] = {
    "embeddings": "embed_tokens",
    "final_norm": "norm",
    "rotary_embedding": "rotary_emb",
    "position_embeddings": None,
    "embedding_norm": None,
}
# The layer list is a stack part too (role ``layers``), named by the required ``module_paths.language_layers``
# (from the top-level model, as simulate and plan read it): the wrappers call it at that path relative to
# the language model (GPT-J's ``transformer.h``: ``h``), so a stack that keeps its layers elsewhere needs no
# second key.
LAYERS, LAYERS_KEY, LAYERS_DEFAULT = "layers", "language_layers", "layers"
# Where each decoder layer keeps its attention, relative to the layer (GPT-Neo's ``attn.attention``): the
# module that caches its keys and values under its index; carried with the stack's parts (``stated``), not
# a part of the stack (no default: the runtime's ``MIXER_ATTRIBUTES`` names, ``self_attn`` first)
LAYER_ATTENTION = "layer_attention"
_PART_ROLES = {
    "embeddings": "token embedding",
    "final_norm": "norm after the last decoder layer",
    "rotary_embedding": "rotary embedding",
    "position_embeddings": "learned position embedding",
    "embedding_norm": "norm over the embeddings",
}


@dataclass(frozen=True)
class StackParts:
    """Where the decoder stack keeps the parts the wrappers call: the paths the spec states
    (``stated``, key -> path) over ``STACK_PARTS``' defaults. ``locations`` is the spec line of each key
    (``module_paths`` itself for one left to its default), so a refusal points at the key that fixes it."""

    stated: Mapping[str, str | None] = field(default_factory=dict)  # None: no such part (final_norm)
    locations: Mapping[str, str] = field(default_factory=dict, compare=False)

    def path(self, key: str) -> str | None:
        """The path of part ``key`` (a ``STACK_PARTS`` key, or ``LAYERS``) relative to the language model;
        None for a part without a usual name that the spec does not name (the stack has none)."""
        return self.stated.get(key, LAYERS_DEFAULT if key == LAYERS else STACK_PARTS[key])

    def where(self, key: str) -> str | None:
        return self.locations.get(key)

    def missing(self, stack: Any, key: str) -> str:
        """Why the wrappers cannot call part ``key`` of ``stack`` (a torch module): the path, the
        ``module_paths`` key that would fix it and the children the stack does have."""
        name, has = type(stack).__name__, ", ".join(n for n, _ in stack.named_children()) or "none"
        if key == LAYERS:
            return (
                f"{name} has no {self.path(key)} (module_paths.{LAYERS_KEY}, relative to "
                f"module_paths.language_model); its children: {has}. The prefill/decode wrappers call the "
                f"stack's decoder layer list: set module_paths.{LAYERS_KEY} to where {name} keeps it"
            )
        default = "" if key in self.stated else ", by default"
        return (
            f"{name} has no {self.path(key)} (module_paths.{key}{default}, relative to "
            f"module_paths.language_model); its children: {has}. The prefill/decode wrappers call the "
            f"stack's {_PART_ROLES[key]}: set module_paths.{key} to where {name} keeps it"
        )


@dataclass(frozen=True)
class Spec:
    """One adapter spec. ``raw`` is the validated YAML mapping, kept for generators and docs."""

    path: Path
    raw: dict[str, Any]
    positions: dict[str, Location] = field(repr=False, compare=False)
    name: str
    gate: Gate
    source: Source
    requires: dict[str, str]
    environment: tuple[EnvironmentShim, ...]
    config_bridges: tuple[ConfigBridge, ...]
    patches: tuple[Patch, ...]
    module_paths: dict[str, str]
    architecture: dict[str, Any]
    mla: dict[str, Any]
    moe: dict[str, Any]
    quantization: tuple[QuantScheme, ...]
    abi: Abi | None
    backends: dict[str, dict[str, Any]]
    # warnings, rendered, for each retired form the file was written in (``spec.deprecations``): the
    # spec holds the new form; commands other than ``validate`` print these as notes
    deprecations: tuple[str, ...] = field(default=(), compare=False)

    def locate(self, where: str) -> str:
        """``file:line:col`` of the spec node at breadcrumb path ``where`` (e.g. ``patches[0]``)."""
        line, col = self.positions.get(where, (1, 1))
        return f"{self.path}:{line}:{col}"

    def backend_options(self, backend: str) -> dict[str, Any]:
        return dict(self.backends.get(backend) or {})

    def stack_parts(self) -> StackParts:
        """The decoder stack's parts as ``module_paths`` names them, with transformers' usual names for
        the rest."""
        stated = {key: self.module_paths[key] for key in STACK_PARTS if key in self.module_paths}
        where = {key: f"module_paths.{key}" if key in stated else "module_paths" for key in STACK_PARTS}
        layers = self.layers_in_stack()
        if layers is not None and layers != LAYERS_DEFAULT:  # stated only where it departs: {} as before
            stated[LAYERS] = layers
        where[LAYERS] = f"module_paths.{LAYERS_KEY}"
        if LAYER_ATTENTION in self.module_paths:
            stated[LAYER_ATTENTION] = self.module_paths[LAYER_ATTENTION]
        where[LAYER_ATTENTION] = (
            f"module_paths.{LAYER_ATTENTION}" if LAYER_ATTENTION in stated else "module_paths"
        )
        return StackParts(stated, {key: self.locate(at) for key, at in where.items()})

    def layers_in_stack(self) -> str | None:
        """``module_paths.language_layers`` relative to ``module_paths.language_model`` (GPT-J's
        ``transformer.h``: ``h``); None where it is not inside it (``check_module_paths`` warns)."""
        outer, inner = self.module_paths.get("language_model"), self.module_paths.get(LAYERS_KEY)
        if not (isinstance(outer, str) and isinstance(inner, str) and inner.startswith(f"{outer}.")):
            return None
        return inner[len(outer) + 1 :]

    @property
    def entry_ids(self) -> tuple[str, ...]:
        """Ids of every environment shim, config bridge and patch, in spec order."""
        return tuple(e.id for e in (*self.environment, *self.config_bridges, *self.patches))

    def without(self, ids: Iterable[str]) -> Spec:
        """This spec minus the shims, bridges and patches named by ``ids`` (for ablation).

        Unknown ids are a ``ValueError`` that lists the valid ones.
        """
        drop = set(ids)
        unknown = sorted(drop - set(self.entry_ids))
        if unknown:
            raise ValueError(
                f"no entry {', '.join(unknown)} in spec {self.name}; ids: {', '.join(self.entry_ids)}"
            )
        return dataclasses.replace(
            self,
            environment=tuple(e for e in self.environment if e.id not in drop),
            config_bridges=tuple(b for b in self.config_bridges if b.id not in drop),
            patches=tuple(p for p in self.patches if p.id not in drop),
        )


def _backends(entry: dict[str, Any]) -> tuple[str, ...]:
    return tuple(entry.get("backends") or BACKENDS)


def _pins(raw: dict[str, Any] | list[dict[str, Any]] | None) -> tuple[Pin, ...]:
    """A patch's ``pin:``: one source (a mapping) or one per reviewed release (a list)."""
    if not raw:
        return ()
    listed = raw if isinstance(raw, list) else [raw]
    return tuple(Pin(p.get("signature"), p.get("source_sha256"), p.get("transformers")) for p in listed)


def build_spec(path: Path, raw: dict[str, Any], positions: dict[str, Location]) -> Spec:
    """Build the typed view of a spec that already passed schema validation."""
    gate = raw["gate"]
    src = raw.get("source") or {}
    hub = src.get("hub")
    config_file = src.get("config")
    abi = raw.get("abi")
    return Spec(
        path=path,
        raw=raw,
        positions=positions,
        name=raw["metadata"]["name"],
        gate=Gate(
            model_type=gate["model_type"],
            sub_configs={k: tuple(v) for k, v in (gate.get("sub_configs") or {}).items()},
        ),
        source=Source(
            config=(path.parent / config_file).resolve() if config_file else None,
            hub=HubSource(hub["repo"], hub["revision"]) if hub else None,
            trust_remote_code=bool(src.get("trust_remote_code", False)),
        ),
        requires=dict(raw.get("requires") or {}),
        environment=tuple(
            EnvironmentShim(e["id"], e["why"], e["kind"], e["target"], e["impl"], f"environment[{i}]")
            for i, e in enumerate(raw.get("environment") or [])
        ),
        config_bridges=tuple(
            ConfigBridge(
                id=b["id"],
                why=b["why"],
                op=b["op"],
                source=b.get("from"),
                dest=b.get("to"),
                path=b.get("path"),
                value=b.get("value"),
                has_value="value" in b,
                fallback=b.get("fallback"),
                has_fallback="fallback" in b,
                when=dict(b.get("when") or {}),
                backends=_backends(b),
                where=f"config_bridges[{i}]",
            )
            for i, b in enumerate(raw.get("config_bridges") or [])
        ),
        patches=tuple(
            Patch(
                id=p["id"],
                why=p["why"],
                target=p["target"],
                kind=p["kind"],
                impl=p.get("impl"),
                options=dict(p.get("options") or {}),
                value=p.get("value"),
                pins=_pins(p.get("pin")),
                backends=_backends(p),
                where=f"patches[{i}]",
            )
            for i, p in enumerate(raw.get("patches") or [])
        ),
        module_paths=dict(raw.get("module_paths") or {}),
        architecture=dict(raw.get("architecture") or {}),
        mla=dict(raw.get("mla") or {}),
        moe=dict(raw.get("moe") or {}),
        quantization=tuple(
            QuantScheme(
                q["id"],
                q["why"],
                q["modules"],
                q["bits"],
                q["group_size"],
                q["packed_dtype"],
                q["scale_dtype"],
            )
            for q in raw.get("quantization") or []
        ),
        abi=(
            Abi(
                config=abi.get("config"),
                batch=abi["batch"],
                prefill_len=abi["prefill_len"],
                max_cache_len=abi["max_cache_len"],
                dtype=abi.get("dtype", "bfloat16"),
                kv_layout=abi.get("kv_layout"),
                prefill=GraphAbi(tuple(abi["prefill"]["inputs"]), tuple(abi["prefill"]["outputs"])),
                decode=GraphAbi(tuple(abi["decode"]["inputs"]), tuple(abi["decode"]["outputs"])),
                mla_attention=abi.get("mla_attention", "reexpand"),
                vision=_vision_abi(abi.get("vision")),
                dynamic=tuple(abi.get("dynamic") or ()),
                kv_cache=KvCacheAbi.from_raw(abi.get("kv_cache")),
                step=StepAbi.from_raw(abi.get("step")),
            )
            if abi
            else None
        ),
        backends={k: dict(v or {}) for k, v in (raw.get("backends") or {}).items()},
    )


def _vision_abi(raw: dict[str, Any] | None) -> VisionAbi | None:
    if raw is None:
        return None
    kernel = raw.get("merge_kernel")
    return VisionAbi(
        projector=raw["projector"],
        grid_thws=tuple((t, h, w) for t, h, w in raw["grid_thws"]),
        inputs=tuple(raw["inputs"]),
        outputs=tuple(raw["outputs"]),
        merge_kernel=(kernel[0], kernel[1]) if kernel is not None else None,
        merged_prefill=_merged_prefill_abi(raw.get("merged_prefill")),
    )


def _merged_prefill_abi(raw: dict[str, Any] | None) -> MergedPrefillAbi | None:
    if raw is None:
        return None
    return MergedPrefillAbi(tuple(raw["inputs"]), tuple(raw["outputs"]), raw.get("prefill_len"))
