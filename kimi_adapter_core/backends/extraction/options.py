"""What one extraction run produces and where: sizes, KV layout, names, output files.

Torch-free on purpose: ``kadapt apply`` resolves and checks options (sizes, output directory) before
it spends seconds importing torch and building the model, so bad input fails fast and leaves no files.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import KadaptError
from ...spec.model import MergedPrefillAbi, Spec
from ...structure.kv_layout import resolve_kv_layout
from ...structure.model import ALL_KV_LAYOUTS, ModelStructure
from ...vision.options import VisionOptions, vision_options
from .compressed_options import check_compressed
from .names import DECODE_FIXED, MERGED_FIXED, PREFILL_FIXED, GraphNames, read_graph_names, state_roles
from .paged import PagedOptions, paged_options
from .runtime.symbolic import SYMBOLS as DYNAMIC_SIZES
from .runtime.symbolic import DimRange
from .step_options import StepOptions, serving_options

MLA_ATTENTIONS = ("reexpand", "absorbed")
DTYPES = ("bfloat16", "float16", "float32", "float64")
MERGED = "prefill_mm"  # graph kind (and file name part) of the multimodal prefill


@dataclass(frozen=True)
class MergedPrefillOptions:
    """The multimodal prefill graph (``abi.vision.merged_prefill``): its names and prompt length."""

    names: GraphNames  # fixed inputs [ids, features, mask, positions], prefill outputs
    prefill_len: int  # prompt length, image placeholders included
    where: str | None = None  # spec location of abi.vision.merged_prefill
    # bound from the model before export (``bind_merged_prefill``)
    image_token_id: int | None = None  # the config's placeholder token
    feature_rows: int | None = None  # image tokens of the vision ABI: rows of the features input

    @property
    def feature_input(self) -> str:
        return self.names.fixed_inputs[1]


def merged_prefill_options(
    spec: Spec, merged: MergedPrefillAbi, *, max_cache_len: int
) -> tuple[MergedPrefillOptions | None, str | None]:
    """``abi.vision.merged_prefill`` read without torch: ``(options, None)``, or ``(None, why)`` when
    ``max_cache_len`` cannot hold the merged prompt.

    The spec's own sizes are checked when it is loaded (``semantic``: the prompt fits the spec's cache and
    holds the image tokens), so only an explicitly smaller cache (``--max-cache-len``) gets here: a
    text-only deployment the spec did not describe, for which the merged graph is left out and the run
    says so. The image tokens are checked again at export, from the encoder's own merge kernel.
    """
    where = "abi.vision.merged_prefill"
    names = read_graph_names(merged, MERGED_FIXED, decode=False, where=where, spec=spec)
    assert spec.abi is not None
    length = merged.prefill_len if merged.prefill_len is not None else spec.abi.prefill_len
    if length > max_cache_len:
        return None, (
            f"multimodal prefill ({where}, {length} tokens) not exported: max_cache_len {max_cache_len} "
            "cannot hold its prompt"
        )
    return MergedPrefillOptions(names, length, spec.locate(where)), None


def spec_paged(spec: Spec) -> PagedOptions | None:
    """The paged cache ``spec.abi`` declares, at the spec's own sizes (what ``generate`` renders)."""
    assert spec.abi is not None
    return paged_options(
        spec.abi.kv_cache,
        batch=spec.abi.batch,
        max_cache_len=spec.abi.max_cache_len,
        decode_inputs=abi_graph_names(spec)[1].inputs(1),
        where=lambda field: spec.locate("abi.kv_cache"),
    )


@dataclass(frozen=True)
class ExtractionOptions:
    """Everything ``run``/``verify`` need besides the spec and the model."""

    output_dir: Path
    file_prefix: str
    model_name: str
    batch: int
    prefill_len: int
    max_cache_len: int
    dtype: str
    kv_layout: str | None  # None until bound to the model's structure (then its attention's default)
    prefill_names: GraphNames
    decode_names: GraphNames
    weight_renames: tuple[tuple[str, str], ...]
    verify_overrides: dict[str, Any] = field(default_factory=dict)
    verify_prefill_len: int = 8
    verify_max_cache_len: int = 40
    verify_decode_steps: int = 24
    verify_tolerance: float = 1e-4  # float32: fraction of each row's largest |logit| (at least 1)
    # float32 bound of a stack with linear-attention layers, unless the spec states verify.tolerance.
    # transformers' chunked gated-delta scan loses precision in float32 by itself: on the tiny Qwen3-Next
    # verify model (8 layers, 70-token prompt) its own float32 logits are 5.2e-4 x |largest logit| from a
    # float64 run of the same weights (each linear layer adds ~2e-5), and eager vs batched_mm experts
    # alone move them 7e-5. 1e-4 is below that resolution; 1e-3 is above it and far below a defect's
    # effect (a state carried wrong by one step moves logits by > 1e-1: test_hybrid_states).
    verify_tolerance_linear: float = 1e-3
    verify_tolerance_stated: bool = False  # the spec set verify.tolerance: it holds for every stack
    verify_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    # bfloat16/float16 round trip: same greedy tokens as transformers in that dtype, each logit within
    # this many ulps of the dtype at its row's largest |logit| (``tolerance.py``). Measured over 200
    # greedy steps on every shipped family's tiny model: 0 (bit-identical), except tiny DeepSeek-V3 at
    # batch 1, 3 ulps from step 49 (rounding: its tokens stay equal until a near tie). 8 leaves headroom
    # over that; a wrong graph is far outside (one diverged token moves logits by > 100 ulps).
    verify_tolerance_ulps: float = 8
    mla_attention: str = "reexpand"  # reexpand | absorbed (kv_b_proj absorbed; latent layout only)
    stitch: bool = True  # export one layer per kind and replicate it (False: export every layer)
    top_ops: int = 12
    structure: ModelStructure | None = None  # set by ``bind_structure`` once the config is built
    kv_layout_where: str | None = None  # spec location of abi.kv_layout, when the spec chose it
    dynamic_where: str | None = None  # spec location of abi.dynamic, when the spec chose it
    names_where: str | None = None  # spec location of abi.prefill, where the state names are given
    vision: VisionOptions | None = None  # abi.vision: also export the vision encoder + projector
    merged_prefill: MergedPrefillOptions | None = None  # abi.vision.merged_prefill: multimodal prefill
    notes: tuple[str, ...] = ()  # what the run leaves out and why, said before it starts
    dynamic: tuple[str, ...] = ()  # abi.dynamic: sizes that become symbols ranging 1..their value
    paged: PagedOptions | None = None  # abi.kv_cache: paged (None: contiguous per-row caches)
    step: StepOptions | None = None  # abi.step: the packed step graph too (``step_options``)
    # per request, shape and dtype of a linear layer's (conv, recurrent) states, as the layers hand
    # them over (``upstream.LayerProtocol.linear_states``; bound before export; None: no linear layer)
    linear_states: tuple[tuple[tuple[int, ...], str], ...] | None = None

    @property
    def dynamic_ranges(self) -> dict[str, DimRange]:
        """Range of each dynamic size: 1 up to the ABI's value (``{"prefill_len": DimRange(1, 64)}``)."""
        return {name: DimRange(1, getattr(self, name)) for name in DYNAMIC_SIZES if name in self.dynamic}

    def graph_ranges(self, kind: str) -> dict[str, DimRange]:
        """``dynamic_ranges`` as the ``kind`` graph has them: the multimodal prefill's prompt holds at
        least its image placeholders, so its ``prefill_len`` starts at the feature rows."""
        ranges = self.dynamic_ranges
        merged = self.merged_prefill
        if kind == MERGED and merged is not None and "prefill_len" in ranges:
            ranges["prefill_len"] = DimRange(merged.feature_rows or 1, merged.prefill_len)
        return ranges

    @property
    def kv_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Per-token ``((key_heads, key_dim), (value_heads, value_dim))`` of the bound layout."""
        assert self.structure is not None and self.kv_layout is not None, "bind_structure first"
        return self.structure.attention.kv_dims(self.kv_layout)

    @property
    def layer_kv_dims(self) -> tuple[tuple[tuple[int, int], tuple[int, int]], ...] | None:
        """Per layer its KV dims when the layers cache different shapes, else None (``kv_dims`` for all)."""
        assert self.structure is not None and self.kv_layout is not None, "bind_structure first"
        return self.structure.layer_kv_dims(self.kv_layout)

    @property
    def attention_label(self) -> str:
        """``latent KV, reexpand MLA`` / ``heads KV, GQA``: what the graphs attend with."""
        if self.structure is not None and not self.structure.attention.is_mla:
            return f"{self.kv_layout} KV, {self.structure.attention.kind.upper()}"
        return f"{self.kv_layout} KV, {self.mla_attention} MLA"

    @property
    def windows(self) -> tuple[int | None, ...]:
        assert self.structure is not None, "bind_structure first"
        return self.structure.windows

    @property
    def chunks(self) -> tuple[int | None, ...]:
        """Each layer's attention chunk (Llama-4's chunked layers), or None."""
        assert self.structure is not None, "bind_structure first"
        return self.structure.chunks

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind (``names.LAYER_STATES``): ``linear`` for a linear-attention mixer, ``indexed``
        for attention with a DSA indexer, else ``attention``."""
        assert self.structure is not None, "bind_structure first"
        return self.structure.layer_kinds

    @property
    def index_dim(self) -> int | None:
        """The DSA indexer keys' width, or a csa layer's Lightning indexer's (None: neither)."""
        assert self.structure is not None, "bind_structure first"
        indexer = self.structure.indexer or getattr(self.structure.sparse_compressor, "indexer", None)
        return indexer.head_dim if indexer is not None else None

    @property
    def compress_rates(self) -> dict[str, int] | None:
        """Each compressed layer kind's rate (``{"hca": rate, "csa": rate}``; None: no compressed layer)."""
        assert self.structure is not None, "bind_structure first"
        return {kind: c.rate for kind, c in self.structure.compressors.items()} or None

    def state_roles(self, num_layers: int) -> list[str]:
        """The role of each per-layer state tensor of the first ``num_layers`` layers, in ABI order."""
        return [role for _, role in state_roles(self.layer_kinds[:num_layers])]

    def path(self, graph: str) -> Path:
        """Output file of ``graph``: ``prefill``, ``decode``, ``prefill_mm`` (the multimodal prefill),
        ``step`` (the packed step graph), ``vision``, ``kv_mapping``, ``weight_map``."""
        suffix = f"{graph}.json" if graph in ("kv_mapping", "weight_map") else f"{graph}_ir.json"
        return self.output_dir / f"{self.file_prefix}_{suffix}"


def check_dynamic(dynamic: Iterable[str], sizes: dict[str, int], where: str | None) -> tuple[str, ...]:
    """The dynamic sizes, known and each at least 2 (torch.export fixes a dimension traced at size 1)."""
    chosen = tuple(dict.fromkeys(dynamic))
    for name in chosen:
        if name not in DYNAMIC_SIZES:
            raise KadaptError(
                f"dynamic size {name!r} is unknown; valid: {', '.join(DYNAMIC_SIZES)}", location=where
            )
        if sizes[name] < 2:
            raise KadaptError(
                f"dynamic {name} needs {name} >= 2 (the graph covers 1..{name}), got {sizes[name]}",
                location=where,
            )
    return tuple(name for name in DYNAMIC_SIZES if name in chosen)


def abi_graph_names(spec: Spec) -> tuple[GraphNames, GraphNames]:
    """Prefill and decode names from ``spec.abi`` (KadaptError at the entry when roles do not fit)."""
    assert spec.abi is not None
    return (
        read_graph_names(spec.abi.prefill, PREFILL_FIXED, decode=False, where="abi.prefill", spec=spec),
        read_graph_names(spec.abi.decode, DECODE_FIXED, decode=True, where="abi.decode", spec=spec),
    )


def _positive(name: str, value: Any, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        kind = "a non-negative" if allow_zero else "a positive"
        raise KadaptError(f"{name} must be {kind} integer, got {value!r}")
    return value


def check_writable(directory: Path) -> None:
    """Fail now, not after a minute of export, if ``directory`` cannot receive the output files."""
    existing = directory
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise KadaptError(f"output directory {directory} is not a directory ({existing} is a file)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise KadaptError(f"output directory {directory} is not writable: {exc.strerror or exc}") from exc


def _confined(spec: Spec, relative: str) -> Path:
    """A spec-given output directory, which must stay inside the working directory.

    A spec is not trusted to choose where files land (``../../etc``); ``--output-dir`` is the user's
    way to write elsewhere.
    """
    cwd = Path.cwd().resolve()
    out = (cwd / relative).resolve()
    if Path(relative).is_absolute() or not out.is_relative_to(cwd):
        raise KadaptError(
            f"backends.extraction.output_dir {relative!r} leaves the working directory {cwd}; a spec may "
            "only name a folder inside it (pass --output-dir to write elsewhere)",
            location=spec.locate("backends.extraction.output_dir"),
        )
    return out


def options_from_spec(
    spec: Spec,
    *,
    output_dir: str | os.PathLike[str] | None = None,
    batch: int | None = None,
    prefill_len: int | None = None,
    max_cache_len: int | None = None,
    kv_layout: str | None = None,
    mla_attention: str | None = None,
    dynamic: Iterable[str] | None = None,
    kv_cache: str | None = None,
    block_size: int | None = None,
    num_blocks: int | None = None,
    step_tokens: int | None = None,
    step_logits: int | None = None,
    step_mtp: bool | None = None,
    step_aux_layers: tuple[int, ...] | None = None,
) -> ExtractionOptions:
    """``spec.abi`` and ``backends.extraction`` defaults with CLI overrides, checked.

    ``kv_cache``/``block_size`` override ``abi.kv_cache``; ``num_blocks``, ``step_tokens``, ``step_logits``,
    ``step_mtp`` and ``step_aux_layers`` the pool size and ``abi.step`` (``step_options.serving_options``)."""
    abi = spec.abi
    if abi is None:
        raise KadaptError(f"spec {spec.name} has no `abi` section: extraction needs the prefill/decode ABI")
    backend = spec.backend_options("extraction")
    sizes = {
        "batch": _positive("batch", abi.batch if batch is None else batch),
        "prefill_len": _positive("prefill_len", abi.prefill_len if prefill_len is None else prefill_len),
        "max_cache_len": _positive(
            "max_cache_len", abi.max_cache_len if max_cache_len is None else max_cache_len
        ),
    }
    if sizes["prefill_len"] > sizes["max_cache_len"]:
        raise KadaptError(
            f"prefill_len {sizes['prefill_len']} does not fit in max_cache_len {sizes['max_cache_len']}: "
            "the prefill KV is placed into the decode cache"
        )
    if abi.dtype not in DTYPES:
        raise KadaptError(f"abi.dtype {abi.dtype!r} is not a floating dtype; valid: {', '.join(DTYPES)}")
    layout = abi.kv_layout if kv_layout is None else kv_layout
    if layout is not None and layout not in ALL_KV_LAYOUTS:
        raise KadaptError(f"unknown kv_layout {layout!r}; valid: {', '.join(ALL_KV_LAYOUTS)}")
    attention = abi.mla_attention if mla_attention is None else mla_attention
    if attention not in MLA_ATTENTIONS:
        raise KadaptError(f"unknown mla_attention {attention!r}; valid: {', '.join(MLA_ATTENTIONS)}")
    if attention == "absorbed" and layout not in (None, "latent"):
        raise KadaptError(
            f"abi.mla_attention 'absorbed' attends over the latent cache and needs abi.kv_layout 'latent', "
            f"got kv_layout {layout!r}",
            location=(
                spec.locate("abi.mla_attention" if "abi.mla_attention" in spec.positions else "abi")
                if mla_attention is None
                else None
            ),
        )
    verify = dict(backend.get("verify") or {})
    verify_prefill = _positive("verify.prefill_len", verify.get("prefill_len", 8))
    verify_cache = _positive("verify.max_cache_len", verify.get("max_cache_len", 40))
    verify_steps = _positive("verify.decode_steps", verify.get("decode_steps", 24), allow_zero=True)
    if verify_prefill + verify_steps > verify_cache:
        raise KadaptError(
            f"verify: prefill_len {verify_prefill} + decode_steps {verify_steps} "
            f"exceed max_cache_len {verify_cache}"
        )
    if output_dir is not None:  # the user's own choice: anywhere
        out = Path(output_dir)
        out = out if out.is_absolute() else Path.cwd() / out
    else:
        out = _confined(spec, str(backend.get("output_dir") or f"out/{spec.name}"))
    check_writable(out)
    cache_abi = abi.kv_cache
    if kv_cache == "contiguous" and block_size is not None:
        raise KadaptError(f"block_size {block_size} needs a paged kv_cache, not contiguous")
    if kv_cache == "contiguous" and (num_blocks is not None or step_tokens is not None):
        raise KadaptError("num_blocks and the step graph need a paged kv_cache, not contiguous")
    if kv_cache is not None or block_size is not None:
        kind = kv_cache or "paged"
        cache_abi = dataclasses.replace(
            cache_abi, kind=kind, block_size=block_size if block_size is not None else cache_abi.block_size
        )
    prefill_names, decode_names = abi_graph_names(spec)
    located = spec.locate("abi.kv_cache") if "abi.kv_cache" in spec.positions else None
    from_cli = kv_cache is not None or block_size is not None  # a size from the command line: not the spec's
    paged = paged_options(
        cache_abi,
        batch=sizes["batch"],
        max_cache_len=sizes["max_cache_len"],
        decode_inputs=decode_names.inputs(1),
        where=lambda field: located if field == "block_table" or not from_cli else None,
    )
    if paged is not None:
        fixed = (*decode_names.fixed_inputs, paged.block_table)
        decode_names = dataclasses.replace(decode_names, fixed_inputs=fixed)
    merged, note = None, None
    if abi.vision is not None and abi.vision.merged_prefill is not None:
        merged, note = merged_prefill_options(
            spec, abi.vision.merged_prefill, max_cache_len=sizes["max_cache_len"]
        )
    serving = serving_options(
        spec,
        batch=sizes["batch"],
        max_cache_len=sizes["max_cache_len"],
        paged=paged,
        decode_names=decode_names,
        num_blocks=num_blocks,
        step_tokens=step_tokens,
        step_logits=step_logits,
        step_mtp=step_mtp,
        step_aux_layers=step_aux_layers,
    )
    return ExtractionOptions(
        output_dir=out,
        file_prefix=str(backend.get("file_prefix") or spec.name),
        model_name=str(backend.get("model_name") or spec.name),
        dtype=abi.dtype,
        kv_layout=layout,
        kv_layout_where=spec.locate("abi.kv_layout") if kv_layout is None and abi.kv_layout else None,
        dynamic_where=spec.locate("abi.dynamic") if dynamic is None and abi.dynamic else None,
        names_where=spec.locate("abi.prefill.outputs"),
        mla_attention=attention,
        prefill_names=prefill_names,
        decode_names=serving.decode_names,
        weight_renames=tuple((r["from"], r["to"]) for r in backend.get("weight_renames") or ()),
        verify_overrides=dict(verify.get("config_overrides") or {}),
        verify_tolerance=float(verify.get("tolerance", 1e-4)),
        verify_tolerance_stated="tolerance" in verify,
        verify_prefill_len=verify_prefill,
        verify_max_cache_len=verify_cache,
        verify_decode_steps=verify_steps,
        vision=vision_options(spec, abi.vision) if abi.vision is not None else None,
        merged_prefill=merged,
        notes=(note,) if note else (),
        dynamic=check_dynamic(
            abi.dynamic if dynamic is None else dynamic,
            sizes,
            spec.locate("abi.dynamic") if dynamic is None and abi.dynamic else None,
        ),
        paged=serving.paged,
        step=serving.step,
        **sizes,
    )


def bind_merged_prefill(
    options: ExtractionOptions, image_token_id: Any, feature_rows: int
) -> ExtractionOptions:
    """``options`` with the multimodal prefill bound to the model: its placeholder token (the config's
    ``image_token_id``) and the image tokens the vision graph yields, checked against the prompt length."""
    merged = options.merged_prefill
    assert merged is not None
    if isinstance(image_token_id, bool) or not isinstance(image_token_id, int) or image_token_id < 0:
        raise KadaptError(
            f"abi.vision.merged_prefill needs the config's image_token_id (the placeholder token), "
            f"got {image_token_id!r}",
            location=merged.where,
        )
    if feature_rows > merged.prefill_len:
        raise KadaptError(
            f"abi.vision.merged_prefill prompt length {merged.prefill_len} is shorter than the "
            f"{feature_rows} image placeholder tokens of the vision graph; set "
            f"abi.vision.merged_prefill.prefill_len to at least {feature_rows}",
            location=merged.where,
        )
    bound = dataclasses.replace(merged, image_token_id=image_token_id, feature_rows=feature_rows)
    return dataclasses.replace(options, merged_prefill=bound)


def bind_structure(options: ExtractionOptions, structure: ModelStructure) -> ExtractionOptions:
    """``options`` for a model of ``structure``: the KV layout defaulted and checked against its attention
    (``resolve_kv_layout``), before any export."""
    layout = resolve_kv_layout(
        structure.attention, options.kv_layout, options.mla_attention, layout_where=options.kv_layout_where
    )
    if structure.linear is not None and "prefill_len" in options.dynamic:
        raise KadaptError(
            "dynamic prefill_len cannot be exported for a stack with linear-attention layers: their prefill "
            "scan runs one step per 64-token chunk (a short convolution pads a prompt shorter than its "
            "window), so the graph's operations depend on the prompt length; "
            "export a static prefill_len (one prefill graph per length you serve)",
            location=options.dynamic_where,
        )
    if structure.linear is not None and not options.prefill_names.has_linear_states:
        raise KadaptError(
            f"the model has {len(structure.linear_layer_ids)} linear-attention layers, whose conv and "
            'recurrent states the graphs return: add "<present conv {layer}>", "<present recurrent '
            '{layer}>" to abi.prefill.outputs and abi.decode.outputs, and "<past conv {layer}>", '
            '"<past recurrent {layer}>" to abi.decode.inputs',
            location=options.names_where,
        )
    compressed = check_compressed(
        structure,
        names_state=options.prefill_names.has_linear_states,
        names_index=options.prefill_names.present_index_src is not None,
        max_cache_len=options.max_cache_len,
        dynamic=options.dynamic,
        names_where=options.names_where,
        dynamic_where=options.dynamic_where,
    )
    if structure.linear is None and not compressed and options.prefill_names.has_linear_states:
        raise KadaptError(
            "the ABI names conv and recurrent states, but the model has no linear-attention layer: keep "
            "only the key and value templates",
            location=options.names_where,
        )
    indexed = structure.indexer is not None
    if indexed != options.prefill_names.has_index_keys:
        raise KadaptError(
            'the model\'s DSA layers return their indexer keys: add "<present index_key {layer}>" to '
            'abi.prefill.outputs and abi.decode.outputs and "<past index_key {layer}>" to abi.decode.inputs'
            if indexed
            else "the ABI names indexer keys, but the model has no DSA (indexed_attention) layer: keep only "
            "the key and value templates",
            location=options.names_where,
        )
    if indexed and options.mla_attention == "absorbed":
        raise KadaptError(
            "mla_attention 'absorbed' replaces the attention's forward, which would drop the DSA indexer "
            "(its top-k selection): use reexpand for a model with indexed_attention layers",
            location=options.names_where,
        )
    return dataclasses.replace(options, kv_layout=layout, structure=structure)
