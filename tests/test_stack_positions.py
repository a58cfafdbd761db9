"""Positions that reach the layers other than by a rotary embedding (issue 37, second slice): learned
absolute position embeddings the spec names (``module_paths.position_embeddings``: GPT-2's ``wpe``, OPT's
``embed_positions`` past its offset), a norm over the embeddings (``module_paths.embedding_norm``:
BLOOM's ``word_embeddings_layernorm``) and BLOOM's and MPT's ALiBi biases, built once per call with the
stack's own builder (``runtime.AlibiBias``; MPT's attention under the ``mpt_attention_forward`` builtin).

Proven on tiny random models of transformers' own classes against unpatched transformers: a ragged
batch prefilled by the wrappers and decoded for several steps, each row at its own position, gives
every row the logits ``generate`` gives that row alone; the matrix spec writes the fields a user writes,
``validate`` reads them, ``validate --resolve`` points at the missing key, and plan sizes the table and
the norm. The rows themselves (export, ``--verify`` ragged and paged) are the family matrix's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.ragged import ragged_greedy
from transformers import AutoConfig, AutoModelForCausalLM

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction.equivalence.reference import reference_run
from kimi_adapter_core.backends.extraction.ir.stack import Backbone, check_positions
from kimi_adapter_core.backends.extraction.runtime import abi
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.builtins import registry
from kimi_adapter_core.builtins.mpt import mpt_attention_forward
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import GUIDE_PATCHES, buildable_config, module_paths, write_spec
from kimi_adapter_core.loading import applied
from kimi_adapter_core.patching import pins
from kimi_adapter_core.patching.gate import claim_model
from kimi_adapter_core.patching.targets import import_module, parse_target, resolve_in
from kimi_adapter_core.resolve import resolve_diagnostics
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.spec.loader import check_spec
from kimi_adapter_core.spec.model import Pin, StackParts

CAPACITY = 32  # the static cache's positions
STEPS = 4  # decode steps after the prefill


def tiny(model_type: str, **over: Any) -> torch.nn.Module:
    """The family matrix's tiny config of ``model_type`` (``over`` on top), random weights, eager."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**tiny_config(model_type), **over})
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).eval()


def matrix_spec(folder: Path, model_type: str, *, drop: tuple[str, ...] = (), **paths: str) -> Path:
    """The spec the family matrix writes for ``model_type`` (``paths`` over its module paths, without
    the keys ``drop`` names)."""
    found = buildable_config(model_type)
    assert not isinstance(found, str), found
    config, model = found
    merged = {**module_paths(model), **paths}
    return write_spec(folder, model_type, config, {k: v for k, v in merged.items() if k not in drop})


@pytest.mark.parametrize(
    ("model_type", "parts"),
    [
        ("gpt2", {"layers": "h", "embeddings": "wte", "final_norm": "ln_f", "position_embeddings": "wpe"}),
        ("opt", {"final_norm": "final_layer_norm", "position_embeddings": "embed_positions"}),
        (
            "bloom",
            {
                "layers": "h",
                "embeddings": "word_embeddings",
                "final_norm": "ln_f",
                "embedding_norm": "word_embeddings_layernorm",
            },
        ),
        (
            "trocr",
            {
                "final_norm": None,
                "position_embeddings": "embed_positions",
                "embedding_norm": "layernorm_embedding",
            },
        ),
    ],
)
def test_the_matrix_spec_names_the_position_table_and_the_embedding_norm(
    tmp_path: Path, model_type: str, parts: dict[str, str]
) -> None:
    """The default spec builder writes ``module_paths.position_embeddings`` / ``embedding_norm`` (fields a
    user writes; plain ``validate`` reads them), and ``final_norm: null`` for a stack with no norm at all
    (TrOCR's post-norm layers); the stack's parts are read from them."""
    path = matrix_spec(tmp_path, model_type)
    assert not check_spec(path).diagnostics
    assert dict(load_spec(path).stack_parts().stated) == parts


def test_validate_rejects_a_position_table_path_that_is_no_module_path(tmp_path: Path) -> None:
    path = matrix_spec(tmp_path, "gpt2", position_embeddings="wpe/0")
    found = [(d.breadcrumb, d.message) for d in check_spec(path).diagnostics]
    assert [b for b, _ in found] == ["module_paths.position_embeddings"], found
    assert "'wpe/0': expected a dotted attribute path" in found[0][1]


def test_resolve_points_at_the_position_table_a_spec_does_not_name(tmp_path: Path) -> None:
    """``validate --resolve`` refuses a GPT-2 spec without ``position_embeddings`` where apply would,
    saying which key to set; with it the spec resolves."""
    bare = matrix_spec(tmp_path, "gpt2", drop=("position_embeddings",))
    found = [d.message for d in resolve_diagnostics(load_spec(bare), bare)]
    assert any("set module_paths.position_embeddings: wpe" in m for m in found), found
    named = matrix_spec(tmp_path / "named", "gpt2")
    assert resolve_diagnostics(load_spec(named), named) == []


def test_a_module_of_the_positions_alone_passes_where_a_table_would() -> None:
    """XGLM's positions are sinusoidal, computed by a module from the positions alone
    (``forward(position_ids)``): the wrappers call it (``test_stack_inputs`` proves the rows); what is
    neither (CPM-Ant's relative bias) is refused there."""
    model = tiny("xglm")
    parts = StackParts({"position_embeddings": "embed_positions"}, {"position_embeddings": "spec:9:1"})
    check_positions(Backbone(model, model.model, model.lm_head, parts))
    positions = torch.tensor([[0, 5, 7]])
    table = model.model.embed_positions
    assert torch.equal(abi.add_learned_positions(torch.zeros(1, 3, 1), table, positions), table(positions))


def _wrappers(spec: Spec, model: torch.nn.Module) -> tuple[abi.PrefillWrapper, abi.DecodeWrapper]:
    paths, parts = spec.module_paths, spec.stack_parts()
    stack = model.get_submodule(paths["language_model"])
    keyword = upstream.cache_keyword(abi.stack_layers(stack, parts.stated)[0])
    built = {"kv_layout": "heads", "cache_keyword": keyword, "parts": parts.stated}
    head = model.get_submodule(paths["lm_head"])
    return (
        abi.PrefillWrapper.from_language_model(stack, head, **built),
        abi.DecodeWrapper.from_language_model(stack, head, **built),
    )


@pytest.mark.parametrize("model_type", ["gpt2", "opt", "bloom", "mpt", "trocr"])
def test_ragged_rows_decode_as_transformers_generates_each_row(tmp_path: Path, model_type: str) -> None:
    """Learned positions (GPT-2; OPT past its table's offset; TrOCR's, normed, into post-norm layers and
    no final norm) and ALiBi (BLOOM's ``alibi``; MPT's ``position_bias``, under the matrix spec's
    ``mpt_attention_forward`` patch): rows of 9, 6 and 3
    tokens right-padded into one prefill, then ``STEPS`` greedy decode steps over the static cache,
    each row at its own position: every row's logits at every step are those of unpatched
    transformers' ``generate`` on that row alone."""
    spec = load_spec(matrix_spec(tmp_path, model_type))
    model = tiny(model_type)
    with applied(spec, backend="extraction"):
        claim_model(model, spec.name)  # the spec's patches reach the modules it loaded (this one)
        steps, prompt, lengths = _ragged_decode(spec, model, model_type)
    for row, length in enumerate(lengths.tolist()):
        _, _, expected = reference_run(model, prompt[row : row + 1, :length], STEPS)
        for ours, theirs in zip(steps, expected, strict=True):
            assert (ours[row] - theirs[0]).abs().max() <= 1e-4, (model_type, row)


def _ragged_decode(
    spec: Spec, model: torch.nn.Module, model_type: str
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Each step's logits ``[rows, vocab]`` of the wrappers over a ragged batch, its prompt and lengths."""
    prefill, decode = _wrappers(spec, model)
    assert (prefill.position_embeddings is not None) == (model_type in ("gpt2", "opt", "trocr"))
    assert (prefill.norm is None) == (model_type == "trocr")
    keyword = {"bloom": "alibi", "mpt": "position_bias"}.get(model_type)
    assert (prefill.alibi.keyword if prefill.alibi is not None else None) == keyword
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, model.config.vocab_size, (3, 9), generator=generator)
    lengths = torch.tensor([9, 6, 3])
    steps = ragged_greedy(prefill, decode, prompt, lengths, CAPACITY, STEPS)
    return steps, prompt, lengths


def test_plan_sizes_the_position_table_and_the_embedding_norm(tmp_path: Path) -> None:
    """The learned table is parameters ``[max_positions, hidden]`` under the model's own name, the
    embedding norm a hidden-wide weight; a stack without them has neither."""

    def sizes(model_type: str) -> dict[str, tuple[int, ...]]:
        spec = load_spec(matrix_spec(tmp_path / model_type, model_type))
        groups = model_inputs(spec, None).groups
        return {name: g.shape_of(name) for g in groups for name, _ in g.tensors()}

    gpt2, bloom = sizes("gpt2"), sizes("bloom")
    assert gpt2["transformer.wpe.weight"] == tuple(tiny("gpt2").transformer.wpe.weight.shape)
    assert bloom["transformer.word_embeddings_layernorm.weight"] == (64,)
    assert not any("wpe" in name or "embed_positions" in name for name in bloom)


def test_mpts_guide_patch_is_pinned_to_the_installed_source() -> None:
    (patch,) = GUIDE_PATCHES["mpt"]
    assert patch["impl"].removeprefix("builtin:") in registry.BUILTINS
    ref = parse_target(patch["target"])
    assert pins.drift(Pin(**patch["pin"]), resolve_in(ref, import_module(ref)).function()) == []


def test_mpts_attention_builtin_is_upstreams_with_an_additive_mask() -> None:
    """On the model's own inputs (a boolean mask, no cache) the builtin is upstream's attention, bit for
    bit; with the ABI's additive mask of the same keys it gives the same output."""
    model = tiny("mpt")
    attention = model.transformer.blocks[0].attn
    hidden = torch.randn(2, 5, model.config.d_model, generator=torch.Generator().manual_seed(2))
    bias = model.transformer.build_mpt_alibi_tensor(model.config.n_heads, model.config.max_seq_len)
    hidden_keys = torch.ones(5, 5, dtype=torch.bool).triu(1).expand(2, 1, 5, 5)
    with torch.no_grad():
        theirs = attention(hidden, position_bias=bias, attention_mask=hidden_keys)[0]
        ours = mpt_attention_forward(attention, hidden, bias, attention_mask=hidden_keys)[0]
        additive = torch.zeros(2, 1, 5, 5).masked_fill(hidden_keys, torch.finfo(torch.float32).min)
        added = mpt_attention_forward(attention, hidden, bias, attention_mask=additive)[0]
    assert torch.equal(ours, theirs)
    assert (added - theirs).abs().max() <= 1e-6
