"""Before anything is exported: the ABI wrappers compute what the model's own forward computes.

The wrappers call the embedding, the decoder layers, the final norm (``embed_tokens`` and ``norm``, or
where the spec's ``module_paths`` put them) and ``lm_head`` themselves. Whatever a
family does outside them (an embedding normaliser, a logit scale, soft-capping, a second rotary
embedding) would be lost without a trace, and no config key has to announce it. So before exporting,
kadapt runs both on a tiny random model of the spec's architecture (the ``--verify`` model, every
constant randomised, float32, a prompt longer than the tiny sliding window): the prefill wrapper's
logits against ``model(input_ids).logits``. A difference refuses the export and says where it enters:
at the embeddings (what reaches the first decoder layer is not ``embed_tokens(ids)``), at the head
(``lm_head(norm(h))`` of the last layer's output is not the model's logits) or inside the stack.

It is cheap (a tiny CPU model, one prefill each way) and family-blind: it needs no table of what
families do, which is what makes a model type kadapt has never seen safe to try.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .... import upstream
from ....errors import Refusal
from ....spec.model import Spec
from ....structure.derive import derive_structure
from ..ir.stack import probed_stack
from ..options import ExtractionOptions
from ..runtime import abi as runtime

PROMPT_LEN = 12  # longer than the tiny sliding window (4), so windowed layers see a difference
TOLERANCE = 1e-4  # relative to the largest logit: the same float32 math in another order


def _head_transforms(model: nn.Module, spec: Spec) -> list[str]:
    """The causal LM's children with weights, other than its language model and LM head, that its forward
    calls (``self.<name>(``): a module it applies between the stack and the LM head (ModernBERT-decoder's
    prediction head ``lm_head``, before its ``decoder``), each with its class name."""
    own = {spec.module_paths[key].split(".")[0] for key in ("language_model", "lm_head")}
    try:
        source = inspect.getsource(inspect.unwrap(type(model).forward))
    except (OSError, TypeError):
        return []
    return [
        f"{name} ({type(child).__name__})"
        for name, child in model.named_children()
        if name not in own and any(True for _ in child.parameters()) and f"self.{name}(" in source
    ]


def _close(ours: torch.Tensor, reference: torch.Tensor) -> bool:
    scale = max(1.0, reference.abs().max().item())
    return ours.shape == reference.shape and (ours - reference).abs().max().item() <= TOLERANCE * scale


def _ratio(ours: torch.Tensor, reference: torch.Tensor) -> str:
    """``reference / ours`` as a number when it is one constant factor, else a description."""
    mask = ours.abs() > 1e-6
    ratios = reference[mask] / ours[mask]
    if ratios.numel() and (ratios.max() - ratios.min()).abs() <= 1e-3 * ratios.abs().max():
        return f"x{ratios.mean().item():.6g}"
    return f"max |diff| {(reference - ours).abs().max().item():.3g}, not one constant factor"


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one intra-op thread: a thread pool's spin-waits cost hundreds of ms
    per forward of a 3-layer model as soon as the other core is busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_whole_model(spec: Spec, options: ExtractionOptions) -> None:
    """Refuse (``outside-layers``, or ``stack-differs``) when the wrappers would not compute the model's
    logits."""
    with one_thread():
        _check(spec, options)


def _check(spec: Spec, options: ExtractionOptions) -> None:
    from ....loading import load_config, load_model, submodule
    from ..tiny_model import randomize_constants, tiny_overrides

    config = load_config(spec, backend="extraction", overrides=tiny_overrides(spec, options))
    torch.manual_seed(0)
    model = load_model(spec, device="cpu", config=config, dtype=torch.float32).eval()
    randomize_constants(model)
    language_model = submodule(model, spec, "language_model")
    lm_head = submodule(model, spec, "lm_head")
    structure = derive_structure(language_model.config, spec)
    parts = spec.stack_parts()
    layers = runtime.stack_layers(language_model, parts.stated)
    probed = probed_stack(language_model, parts)
    wrapper = runtime.PrefillWrapper.from_language_model(
        language_model,
        lm_head,
        kv_layout=options.kv_layout or structure.attention.default_kv_layout,
        cache_keyword=upstream.decoder_protocol(probed, structure.layer_kinds).cache_keyword,
        mla_attention=options.mla_attention,
        layer_kinds=structure.layer_kinds,
        windows=structure.windows,
        chunks=structure.chunks,
        embedding_ops=structure.outside_ops("embeddings"),
        logit_ops=structure.outside_ops("logits"),
        rope_layer_types=upstream.rope_layer_types(probed),
        parts=parts.stated,
    )
    ids = torch.randint(3, structure.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(3))
    _, mask, positions = runtime.prefill_inputs(
        batch=1, prefill_len=PROMPT_LEN, dtype=torch.float32, device="cpu"
    )
    seen: dict[str, torch.Tensor] = {}

    def first_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["first"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

    def last_output(module: nn.Module, args: Any, output: Any) -> None:
        seen["last"] = (output[0] if isinstance(output, tuple) else output).detach().clone()

    hooks = [
        layers[0].register_forward_pre_hook(first_input, with_kwargs=True),
        layers[-1].register_forward_hook(last_output),
    ]
    try:
        with torch.no_grad():
            reference = model(input_ids=ids).logits
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        try:
            ours = wrapper(ids, mask, positions)[0]
        except Exception as exc:  # noqa: BLE001 - what the model's own forward ran, the wrappers cannot
            raise Refusal(
                "stack-differs",
                f"the prefill wrapper cannot run {type(model).__name__}'s decoder stack the way its own "
                f"forward does (tiny random model of this architecture): {type(exc).__name__}: {exc}",
                location=spec.locate("gate"),
            ) from exc
        if _close(ours, reference):
            return
        embed = runtime.stack_part(language_model, "embeddings", parts.stated)
        norm = runtime.stack_part(language_model, "final_norm", parts.stated)
        table = runtime.stack_part(language_model, "position_embeddings", parts.stated)
        embeddings = runtime.add_learned_positions(
            runtime.apply_ops(embed(ids), structure.outside_ops("embeddings")), table, positions
        )
        embedding_norm = runtime.stack_part(language_model, "embedding_norm", parts.stated)
        if embedding_norm is not None:  # as the wrappers apply it (BLOOM, ModernBERT-decoder)
            embeddings = embedding_norm(embeddings)
        last = norm(seen["last"]) if norm is not None else seen["last"]  # None: a post-norm stack
        head = runtime.apply_ops(lm_head(last), structure.outside_ops("logits"))
    name = type(model).__name__
    code = "outside-layers"
    if not _close(embeddings, seen["first"]):
        where = (
            f"the embeddings: {name}'s forward hands the first decoder layer "
            f"{parts.path('embeddings')}(input_ids){' plus its position embeddings' if table else ''} "
            f"{_ratio(embeddings, seen['first'])}"
        )
    elif not _close(head, reference):
        norm_path = parts.path("final_norm")
        where = f"the head: {name}'s logits are lm_head({norm_path}(hidden)) {_ratio(head, reference)}"
        between = _head_transforms(model, spec)
        if between:
            where += (
                f"; its forward also calls {', '.join(between)} on the final hidden states before "
                f"{spec.module_paths['lm_head']} (module_paths.lm_head), and no spec field names a "
                "module between the final norm and the LM head"
            )
    else:
        code = "stack-differs"
        where = f"the decoder stack: {name}'s layers give other hidden states when its own forward calls them"
    raise Refusal(
        code,
        f"{name} computes something the prefill/decode wrappers do not, at {where} (tiny random model of "
        f"this architecture, max |logit diff| {(ours - reference).abs().max().item():.3g}); kadapt refuses "
        "to export what it cannot reproduce",
        location=spec.locate("gate"),
    )
