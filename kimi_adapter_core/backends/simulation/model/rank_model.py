"""Build the per-rank text model through the spec on the meta device and trace one step of it.

Tracing every layer of a huge model for every ``simulate`` call is slow and pointless: the layers
of one kind are identical. So this builds the spec's own model - ``applied(spec)`` for backend
``simulation`` (shims, bridges, gated patches), ``load_config`` with the text sub-config resized to
ONE rank, then ``load_model`` on meta - and takes from it what one step runs: the embedding, the
rotary embedding, the first decoder layer of each MLP kind in the model (dense and/or MoE, from the
``ModelStructure``; ``module_paths.language_layers``), the final norm and the lm_head. They run at
the deployment's shapes under a ``Recorder`` that tags each layer's ops with the number of layers
of its kind. The per-rank sizes and the layers kept are ``rank_config``'s.

The kernels a serving runtime runs replace the eager Hugging Face code (``serving_kernels``): the
attention core (``AttentionKernel`` behind transformers' attention interface for MHA/GQA/MQA, the
spec's ``mla.attention_class`` swapped for ``RankMLA``) and the routed experts (the
``moe.experts_class`` module, else the one holding the stacked expert weights, swapped for
``RoutedExperts``) and, in a hybrid stack's linear layers, the mixer (a gated DeltaNet swapped for
``RankGatedDeltaNet``: ``linear_kernels``; KDA, Mamba2, Mamba1, a short convolution and lightning
attention for ``RankKDA`` / ``RankMamba2`` / ``RankMamba1`` / ``RankShortConv`` / ``RankLightning``:
``ssm_kernels``). The collectives around them are recorded here: 2 TP
all-reduces per layer, vocab-parallel embedding all-reduce and logits all-gather (EP dispatch +
combine are the routed experts' own), and the all-reduce of a norm's statistics when a norm spans a
whole TP-split projection (``SplitNorm``: OLMoE's q_norm / k_norm). A linear sized for the whole of a
TP-split input runs on the rank's row-parallel slice (``SplitRows``: Helium's o_proj).

``RankModel`` keeps the built model: what a step changes (recorder, deployment, weight formats) is
bound per trace, so a sweep builds it once per TP size and traces it at every shape and weight mode.

The whole model is built, a vision tower included (at its shipped size: ~0.1 s on meta), because
that is what ``load_model`` builds for the spec: the model class, remote code rules, the gate claim
and ``module_paths`` then all work exactly as for ``kadapt apply``, with no second code path.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .... import upstream
from ....checkpoint.dtypes import cast_to_abi_dtype
from ....errors import KadaptError, Refusal
from ....loading import applied, load_config, load_model, submodule
from ....spec.model import Spec
from ....structure.model import ModelStructure
from ....structure.of_spec import text_config_key
from ....structure.residual_streams import STREAM_HEAD
from .arch import read_config
from .deployment import Deployment
from .head_width import refuse_hidden_derived_heads
from .inputs import ModelInputs
from .layer_calls import (
    carried_to,
    handed_on,
    hidden_of,
    mask_of,
    per_layer_inputs,
    positions_of,
    rope_for,
)
from .linear_kernels import RankLinearMixer
from .mla_kernels import RankMLA
from .module_swaps import experts_of, find_modules, stack_child, swap
from .parallel import Parallel, heads_per_rank
from .quant import NATIVE
from .rank_config import BACKEND, LayerKind, check_rank_shapes, check_sizes, layer_kinds, rank_overrides
from .serving_kernels import AttentionKernel, RoutedExperts
from .split_norm import SplitNorm, split_norms
from .split_rows import SplitRows, split_rows
from .ssm_kernels import SIMULATED_MIXERS, linear_mixers, rank_mixer
from .tracer import Recorder

ATTENTION_IMPLEMENTATION = "kadapt_simulation"  # registered with transformers while a trace runs


@dataclass
class TracedLayer:
    kind: LayerKind
    module: nn.Module
    rope_type: str | None = None  # its layer type, for a rotary embedding that takes one (Gemma-3)
    roped: bool = True  # False: its type has no frequencies in that embedding (LFM3's conv layers)


@dataclass
class RankParts:
    """What one step of the per-rank model runs, taken from the model built for the spec."""

    embed_tokens: nn.Module
    rotary: nn.Module | None  # None: a stack without rope (NoPE, SSM): the layers get no position embeddings
    layers: list[TracedLayer]  # the first layer of each kind, in model order
    norm: nn.Module
    lm_head: nn.Module
    eh_proj: nn.Module | None
    attention: list[RankMLA] = field(default_factory=list)  # the swapped MLA modules
    experts: list[RoutedExperts] = field(default_factory=list)  # the swapped routed experts
    linear: list[RankLinearMixer] = field(default_factory=list)  # the swapped linear-attention mixers
    norms: list[SplitNorm] = field(default_factory=list)  # the traced layers' norms, split when TP does
    rows: list[SplitRows] = field(default_factory=list)  # their linears, row-split when sized for all TP
    configs: list[Any] = field(default_factory=list)  # configs of the traced layers' attention
    names: dict[int, str] = field(default_factory=dict)  # id(parameter) -> its name in the built model
    tables: dict[int, str] = field(default_factory=dict)  # id(integer buffer) -> its name, likewise
    # hyper-connections' head, merging the residual streams before the final norm (None: one stream)
    stream_head: nn.Module | None = None

    def layer(self, kind: str) -> nn.Module | None:
        return next((t.module for t in self.layers if t.kind.kind == kind), None)

    def named(self) -> Iterator[tuple[str, nn.Module]]:
        """The parts under the names the op table uses (``moe_layer.self_attn.q_a_proj``, ...)."""
        yield "embed_tokens", self.embed_tokens
        if self.rotary is not None:
            yield "rotary", self.rotary
        for traced in self.layers:
            yield traced.kind.name, traced.module
        if self.stream_head is not None:
            yield STREAM_HEAD, self.stream_head
        yield "norm", self.norm
        yield "lm_head", self.lm_head
        if self.eh_proj is not None:
            yield "eh_proj", self.eh_proj

    def bind(self, rec: Recorder, dep: Deployment, inputs: ModelInputs) -> None:
        """Point the swapped serving kernels at ``rec`` and ``dep`` and tag every weight with the format
        ``inputs`` gives its checkpoint name (the weight mode): the next forward records one step of
        ``dep`` in that mode. Nothing of the built model changes, so it can be bound again."""
        if self.experts:
            routed = next(g for g in inputs.groups if g.name == "routed_experts")
            fmt = inputs.policy(routed, routed.checkpoint_name)
            for experts in self.experts:
                experts.bind(rec, dep, fmt)
        for mla in self.attention:
            mla.bind(rec, dep)
        for mixer in self.linear:
            mixer.bind(rec, dep)
        for split in [*self.norms, *self.rows]:
            split.bind(rec)
        group_of = inputs.group_of()
        for _, part in self.named():
            for param in part.parameters():
                checkpoint = inputs.naming.checkpoint(self.names.get(id(param), ""))
                group = group_of.get(checkpoint)
                rec.mark_weight(param, inputs.policy(group, checkpoint) if group else NATIVE["bf16"])
            for table in part.buffers():  # a lookup table the checkpoint stores (DeepSeek-V4's tid2eid):
                checkpoint = inputs.naming.checkpoint(self.tables.get(id(table), ""))  # reads its rows only
                if (group := group_of.get(checkpoint)) is not None:
                    rec.mark_weight(table, inputs.policy(group, checkpoint))


def _build(spec: Spec, inputs: ModelInputs, dep: Deployment) -> tuple[RankParts, list[str]]:
    """Build the per-rank model for ``spec`` at ``dep``'s TP size (with an MTP block if it drafts) on
    meta and swap in the serving kernels (bound to nothing yet: ``RankParts.bind``). Must run inside
    ``applied(spec, backend="simulation")``."""
    linear = inputs.arch.structure.linear
    if linear is not None and linear.kind not in SIMULATED_MIXERS:
        raise Refusal(
            "hybrid",
            f"spec {spec.name}: its {linear.describe()} layers have no serving kernel simulate can price "
            f"(it prices {', '.join(SIMULATED_MIXERS)} mixers); plan sizes the model and its states",
            location=spec.locate("gate"),
        )
    s = inputs.arch.structure
    if dep.mtp and s.residual_streams is not None:
        raise Refusal(
            "outside-layers",
            f"spec {spec.name}: --mtp drafts through a DeepSeek-style MTP block on the final hidden "
            f"state, and this model keeps {s.residual_streams.describe()}: its MTP block takes and "
            "mixes the streams, which simulate does not model; simulate it without --mtp",
            location=spec.locate("gate"),
        )
    raw = read_config(spec)
    key = text_config_key(spec, isinstance(raw.get("text_config"), dict))
    raw_text = raw[key] if key else raw
    overrides = without_derived(rank_overrides(key, s, dep, raw_text), raw_text.get("model_type"), key)
    config = load_config(spec, backend=BACKEND, overrides=overrides)
    notes = check_sizes(spec, key, getattr(config, key) if key else config, raw_text, overrides, s)
    model = load_model(spec, device="meta", config=config)
    lm = submodule(model, spec, "language_model")
    layers = submodule(model, spec, "language_layers")
    lm_head = submodule(model, spec, "lm_head")
    layers_path = spec.module_paths["language_layers"]
    kinds = layer_kinds(s)
    rope_types = upstream.rope_layer_types(lm)
    parts = RankParts(
        lm.get_input_embeddings(),
        stack_child(spec, lm, "rotary_embedding", optional=True),
        [_traced(kind, layers[kind.index], rope_types) for kind in kinds],
        stack_child(spec, lm, "final_norm") or nn.Identity(),  # a post-norm stack applies none
        lm_head,
        nn.Linear(2 * s.hidden_size, s.hidden_size, bias=False) if dep.mtp else None,
        stream_head=lm.get_submodule(STREAM_HEAD) if s.residual_streams is not None else None,
    )
    # bf16 as a checkpoint loads: fp32 where transformers keeps it (the router's correction bias);
    # computed buffers (rotary inv_freq) keep their dtype
    cast_to_abi_dtype(model, [part for _, part in parts.named()], torch.bfloat16)
    parts.names = {id(t): n for n, t in model.named_parameters()}  # before any swap: the model's own names
    parts.tables = {id(t): n for n, t in model.named_buffers() if not t.is_floating_point()}

    unbound = Recorder()  # every swapped kernel is bound to the trace's recorder before it runs
    for traced in parts.layers:
        where = f"{layers_path}.{traced.kind.index}"
        if traced.kind.kind == "moe":
            experts = RoutedExperts(s, unbound, _UNBOUND, NATIVE["bf16"])
            for root, path in experts_of(spec, traced.module, where, s):
                swap(root, path, experts)
            parts.experts.append(experts)
        if traced.kind.linear:  # a hybrid layer's mixer too, beside its attention (priced below)
            parts.linear += _swap_linear(spec, traced.module, where, dep.parallel.tp)
        if not traced.kind.attends:  # a linear mixer or an MLP alone: no attention to price
            continue
        if s.attention.is_mla:
            attention_class = (spec.mla or {}).get("attention_class")
            if not attention_class:
                raise KadaptError(
                    f"spec {spec.name} has no mla.attention_class: simulate swaps the MLA attention module "
                    "for its serving kernel and finds it by the class name the spec declares",
                    location=spec.locate("mla" if spec.mla else "metadata"),
                )
            for path, inner in find_modules(
                spec, traced.module, where, "mla", "attention_class", attention_class
            ):
                mla = RankMLA(inner, unbound, _UNBOUND, traced.kind)
                _check_mla_shape(mla, traced.kind, s, dep.parallel.tp)
                swap(traced.module, path, mla)
                parts.attention.append(mla)
        else:
            configs = {id(m.config): m.config for m in traced.module.modules() if hasattr(m, "config")}
            parts.configs += [c for c in configs.values() if hasattr(c, "_attn_implementation")]
    kernels: list[nn.Module] = [*parts.experts, *parts.attention, *parts.linear]
    refuse_hidden_derived_heads(
        spec, [(t.kind.name, t.module) for t in parts.layers if t.kind.attends], s, dep.parallel.tp
    )
    for traced in parts.layers:
        parts.norms += split_norms(traced.module, kernels, dep.parallel.tp, parts.names)
        parts.rows += split_rows(traced.module, kernels, dep.parallel.tp, parts.names)
    return parts, notes


def without_derived(overrides: dict[str, Any], model_type: Any, key: str | None) -> dict[str, Any]:
    """``overrides`` less a head width the model type's config class derives itself (a read-only
    ``head_dim`` property: Falcon's ``hidden_size / num_attention_heads``), which it refuses to be
    given; at a TP where that derivation is not the model's head width, ``refuse_hidden_derived_heads``
    refuses. Other read-only properties take their value through ``__init__`` (Nemotron-H's layer count)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    head_dim = getattr(config_class, "head_dim", None)
    if not (isinstance(head_dim, property) and head_dim.fset is None):
        return overrides
    path = f"{key}.head_dim" if key else "head_dim"
    return {name: value for name, value in overrides.items() if name != path}


_UNBOUND = Deployment(Parallel(), 1, 1, 0, True)  # placeholder shapes until a trace binds its own


def _check_mla_shape(mla: RankMLA, kind: LayerKind, s: ModelStructure, tp: int) -> None:
    """The traced MLA module of ``kind`` has that kind's own shape at ``tp`` (a layer with its own query
    heads, latent rank or nope width, dots3's sliding layers, is priced as itself, not as the stack's)."""
    a = kind.attention(s)
    want = (heads_per_rank(a, tp), a.kv_lora_rank, a.qk_nope_head_dim)
    if (mla.heads, mla.rank, mla.nope) != want:
        raise KadaptError(
            f"the per-rank MLA of layer {kind.index} runs {mla.heads} heads, latent rank {mla.rank}, nope "
            f"width {mla.nope}, not the {want[0]}, {want[1]}, {want[2]} its structure gives at TP {tp}: its "
            "config class did not build the per-rank sizes kadapt wrote (the layer's per_layer_config)"
        )


def _traced(kind: LayerKind, layer: nn.Module, rope_types: tuple[str | None, ...] | None) -> TracedLayer:
    """A layer traced for ``kind``, with its rotary layer type (``upstream.rope_layer_types``: None for
    one rope for all; an entry None for a layer given none)."""
    if rope_types is None:
        return TracedLayer(kind, layer)
    return TracedLayer(kind, layer, rope_types[kind.index], roped=rope_types[kind.index] is not None)


def _swap_linear(spec: Spec, layer: nn.Module, where: str, tp: int) -> list[RankLinearMixer]:
    """Swap every linear-attention / SSM mixer of a linear layer (gated DeltaNet in ``linear_attn``,
    KDA and lightning attention in ``self_attn``, Mamba2 and Mamba1 in ``mixer`` or ``mamba``, a short
    convolution in ``conv``: found by their attribute names, ``ssm_kernels.KINDS``) for its serving
    kernels (unbound)."""
    found = linear_mixers(layer)
    if not found:
        seen = ", ".join(sorted({type(m).__name__ for m in layer.modules()}))
        raise KadaptError(
            f"{where} of the model built for spec {spec.name} is a linear-attention layer, but none of its "
            "modules is a mixer simulate can price: a gated DeltaNet (conv1d, norm, out_proj, A_log, dt_bias "
            "and the in projections of Qwen3-Next or Qwen3.5), a KDA (q/k/v_proj, conv1d, forget_gate, "
            "b_proj, o_norm, o_proj), a Mamba2 mixer (in_proj, conv1d, norm, out_proj, A_log, dt_bias, D), "
            "a Mamba1 mixer (in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj), a gated short "
            "convolution (in_proj, conv, out_proj) or a lightning attention (qkv_proj, output_gate, norm, "
            "out_proj, slope_rate); "
            f"the classes there are: {seen}"
        )
    swapped = []
    for path, inner in found:
        mixer = rank_mixer(inner, Recorder(), _UNBOUND, tp)
        swap(layer, path, mixer)
        swapped.append(mixer)
    return swapped


def build_rank(
    spec: Spec, inputs: ModelInputs, dep: Deployment, rec: Recorder
) -> tuple[RankParts, list[str]]:
    """Build the per-rank model for ``spec`` on meta, swap in the serving kernels and bind them to
    ``rec`` and ``dep``. Must run inside ``applied(spec, backend="simulation")``."""
    parts, notes = _build(spec, inputs, dep)
    parts.bind(rec, dep, inputs)
    return parts, notes


class RankModel:
    """The per-rank model of ``spec`` at one TP size, built once and traced at any batch, context,
    phase and weight mode (a sweep traces it dozens of times; building is about half of a trace).

    What a step changes is bound per trace (``RankParts.bind``: the recorder, the deployment, the
    weight formats) and the hooks a trace registers are removed after it, so a trace on a reused
    model records exactly what a trace on a fresh one does (``tests/test_sweep.py``)."""

    def __init__(self, spec: Spec, inputs: ModelInputs, dep: Deployment) -> None:
        self.spec, self.tp, self.mtp = spec, dep.parallel.tp, bool(dep.mtp)
        self.s = inputs.arch.structure
        with applied(spec, backend=BACKEND), torch.device("meta"):
            self.parts, self.notes = _build(spec, inputs, dep)

    def serves(self, dep: Deployment) -> bool:
        return dep.parallel.tp == self.tp and bool(dep.mtp) == self.mtp

    def trace(self, inputs: ModelInputs, dep: Deployment) -> Recorder:
        """Run one step of ``dep`` with the weights in ``inputs``' formats; the recorder holds every op."""
        if not self.serves(dep):
            raise KadaptError(f"the per-rank model for TP {self.tp} cannot trace TP {dep.parallel.tp}")
        s, model, rec, par = self.s, self.parts, Recorder(), dep.parallel
        with applied(self.spec, backend=BACKEND), torch.device("meta"):
            model.bind(rec, dep, inputs)
            b, q = dep.batch_per_rank, dep.tokens_per_query
            input_ids = torch.zeros(b, q, dtype=torch.long)
            positions = torch.arange(dep.context_len, dep.context_len + q).unsqueeze(0).expand(b, q)
            hidden_bytes = b * q * s.hidden_size * 2
            _all_reduce = {"collective": "all_reduce", "bytes": hidden_bytes, "group": par.tp}

            def tp_all_reduces(count: int) -> Any:
                """After the attention's o_proj and after the MLP's down projection (a one-sublayer
                block: after its one part)."""

                def hook(_module: nn.Module, _args: Any, _out: Any) -> None:
                    for _ in range(count):
                        rec.analytic("tp_all_reduce", "comm", comm=_all_reduce)

                return hook

            handles = []
            if par.tp > 1:  # registered before the recorder's hooks: recorded under the layer's name
                handles += [
                    t.module.register_forward_hook(tp_all_reduces(t.kind.sublayers)) for t in model.layers
                ]
            for name, part in model.named():
                handles += rec.hook(part, name)
            kinds = {id(m): t.kind for t in model.layers for m in t.module.modules()}
            kernel = AttentionKernel(rec, dep, s, kinds)
            try:
                with (
                    upstream.attention_kernel(ATTENTION_IMPLEMENTATION, kernel, model.configs),
                    rec,
                    torch.no_grad(),
                ):
                    _step(model, rec, dep, s, input_ids, positions, _all_reduce)
            except KadaptError:
                raise
            except Exception as error:  # noqa: BLE001 - the family's code at a shape it cannot run
                # where: the op that raised (a shape), else the innermost module running (its own code)
                where = rec.failure(error) or (f"{rec.module} ({type(error).__name__})" if rec.module else "")
                if not where:
                    raise
                text = str(error).strip()
                raise KadaptError(
                    f"simulate cannot run the per-rank model of spec {self.spec.name} at TP {self.tp}: "
                    f"{where} failed: {text.splitlines()[0] if text else repr(error)}"
                ) from error
            finally:
                for handle in handles:
                    handle.remove()
        if not s.attention.is_mla:
            attending = [t for t in model.layers if t.kind.attends]
            missed = [t.kind.name for t in attending if t.kind.name not in kernel.called]
            if missed:
                raise KadaptError(
                    f"the attention of {', '.join(missed)} never called transformers' attention interface "
                    f"(config._attn_implementation); simulate prices {s.attention.kind.upper()} attention "
                    "through it and cannot price this model's attention"
                )
        return rec


def _step(
    model: RankParts,
    rec: Recorder,
    dep: Deployment,
    s: ModelStructure,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    all_reduce: dict[str, Any],
) -> None:
    """One step: embedding, the traced layers (each standing for its kind), the last norm and logits,
    and the MTP drafts."""
    par, vocab = dep.parallel, s.vocab_size
    hidden = embedded = model.embed_tokens(input_ids)
    if par.tp > 1:
        rec.analytic("tp_all_reduce(vocab_parallel_embedding)", "comm", comm=all_reduce)
    per_layer_inputs(rec, s, input_ids.numel())
    # one (cos, sin) per rotary kind the traced layers use (Gemma-3: local and global frequencies)
    rope = {
        t: rope_for(model.rotary, hidden, positions, t) if model.rotary is not None else None
        for t in dict.fromkeys(traced.rope_type for traced in model.layers if traced.roped)
    }
    streams = s.residual_streams
    if streams is not None:  # after the rope, which the model computes from the embeddings
        hidden = hidden.unsqueeze(2).expand(-1, -1, streams.count, -1).contiguous()
    carried: dict[str, Any] = {}  # what a traced layer hands the next (GLM-5's, HY-V4's DSA top-k)
    for traced in model.layers:
        embeddings = rope[traced.rope_type] if traced.roped else None
        with rec.scope(traced.kind.scope, len(traced.kind.layers)):
            # a KV-sharing layer reads its producer's keys and values of the whole context
            length = dep.context_len + hidden.shape[1]
            kwargs = {
                **positions_of(traced.module, embeddings, positions),
                **upstream.stack_inputs(
                    traced.module, hidden, traced.kind.mixer, length, traced.kind.index, embedded
                ),
                **carried_to(traced.module, carried),
                **mask_of(traced.module, hidden),
            }
            out = traced.module(hidden, **kwargs)
            hidden, carried = hidden_of(out), handed_on(out)
    if model.stream_head is not None:
        hidden = model.stream_head(hidden)
    last = model.norm(hidden if dep.decode else hidden[:, -1:, :])  # prefill: last token's logits
    _logits(model, rec, last, par.tp, vocab)
    if dep.mtp and model.eh_proj is not None:
        block = model.layers[-1].module  # the kind of the model's last layer
        with rec.scope("mtp", dep.mtp):  # one DeepSeek-style MTP block per drafted token
            draft_in = hidden[:, -1:, :]
            draft = model.eh_proj(torch.cat([draft_in, model.embed_tokens(input_ids[:, -1:])], dim=-1))
            cos, sin = rope[model.layers[-1].rope_type]
            at_last = positions_of(block, (cos[:, -1:], sin[:, -1:]), positions[:, -1:])
            draft = hidden_of(block(draft, **at_last))
            _logits(model, rec, model.norm(draft), par.tp, vocab)


def trace_rank(spec: Spec, inputs: ModelInputs, dep: Deployment) -> tuple[Recorder, list[str]]:
    """Build the per-rank model and run one step of it on meta; the recorder holds every op."""
    check_rank_shapes(inputs.arch.structure, dep.parallel.tp)
    with applied(spec, backend=BACKEND):  # one session for the build and the trace
        model = RankModel(spec, inputs, dep)
        return model.trace(inputs, dep), list(model.notes)


def _logits(model: RankParts, rec: Recorder, hidden: torch.Tensor, tp: int, vocab: int) -> None:
    model.lm_head(hidden)
    if tp > 1:
        tokens = hidden.shape[0] * hidden.shape[1]
        rec.analytic(
            "tp_all_gather(logits)",
            "comm",
            comm={"collective": "all_gather", "bytes": tokens * vocab * 2, "group": tp},
        )
