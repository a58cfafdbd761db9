"""``--verify`` is a proof: a graph that drops any part of the model's math fails it.

Each test injects one defect into the *exported* graph only (the tiny meta model that ``pipeline.run``
traces, or the options it traces with), then runs ``verify``: the reference, transformers on the same
weights, is untouched, so the saved files must disagree with it. The defects are the ones a verify on
transformers' initial values could not see: a dropped bias (biases start at 0), a dropped norm scale
(norm weights start at 1), a sliding window on a full-attention layer (a tiny stack of 3 layers had
no full layer of a 3:1 pattern). Every test first shows the same family passes undamaged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from fixtures.spec_files import SMALL_FAMILY, write_family_spec, write_qwen3_three_to_one
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

from kimi_adapter_core.backends.extraction import options_from_spec, tiny_model, verify
from kimi_adapter_core.backends.extraction.equivalence import roundtrip
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]


def llama_with_biases(tmp_path: Path) -> Any:
    """The shipped Llama spec on a config whose attention and MLP projections carry biases."""
    shutil.copy(REPO / "specs" / "llama.yaml", tmp_path / "llama.yaml")
    (tmp_path / "llama").mkdir()
    config = json.loads((REPO / "specs" / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(
        json.dumps({**config, "attention_bias": True, "mlp_bias": True})
    )
    return load_spec(tmp_path / "llama.yaml")


def qwen3_three_to_one(tmp_path: Path) -> Any:
    return load_spec(write_qwen3_three_to_one(tmp_path))


@contextlib.contextmanager
def exported_with(mutate: Callable[[torch.nn.Module, Any], Any]) -> Iterator[None]:
    """``pipeline.run`` inside ``verify`` exports ``mutate(meta_model, options)`` (the options it returns,
    if any); the CPU model the reference runs is never touched."""
    real_run = roundtrip.run

    def run(spec: Any, model: torch.nn.Module, options: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            changed = mutate(model, options)
            if isinstance(changed, contextlib.AbstractContextManager):
                stack.enter_context(changed)
            elif changed is not None:
                options = changed
            return real_run(spec, model, options, **kwargs)

    roundtrip.run = run
    try:
        yield
    finally:
        roundtrip.run = real_run


def verified(spec: Any, tmp_path: Path) -> Any:
    options = options_from_spec(spec, output_dir=tmp_path / "out")
    return verify(spec, dataclasses.replace(options, verify_dtypes=("float32",)), echo=lambda line: None)


def failed_checks(report: Any) -> set[str]:
    return {check.name for check in report.checks if not check.passed}


def test_a_dropped_bias_fails_verify(tmp_path: Path) -> None:
    spec = llama_with_biases(tmp_path)
    assert verified(spec, tmp_path).passed

    def drop_o_proj_bias(model: torch.nn.Module, options: Any) -> None:
        for layer in model.model.layers:
            layer.self_attn.o_proj.bias = None

    with exported_with(drop_o_proj_bias):
        report = verified(spec, tmp_path)
    assert not report.passed and "prefill logits" in failed_checks(report)


def test_a_dropped_norm_scale_fails_verify(tmp_path: Path) -> None:
    spec = load_spec(REPO / "specs" / "llama.yaml")

    @contextlib.contextmanager
    def unscaled_norms(model: torch.nn.Module, options: Any) -> Iterator[None]:
        def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:  # RMSNorm without its weight
            variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
            return (hidden_states * torch.rsqrt(variance + self.variance_epsilon)).to(hidden_states.dtype)

        original = modeling_llama.LlamaRMSNorm.forward
        modeling_llama.LlamaRMSNorm.forward = forward
        try:
            yield
        finally:
            modeling_llama.LlamaRMSNorm.forward = original

    with exported_with(unscaled_norms):
        report = verified(spec, tmp_path)
    assert not report.passed and "prefill logits" in failed_checks(report)


def test_a_window_on_a_full_layer_fails_verify(tmp_path: Path) -> None:
    """The tiny Qwen3 keeps a whole 3:1 period (4 layers, one full); giving the full layer the window
    changes what its queries see once the prompt is longer than the window."""
    spec = qwen3_three_to_one(tmp_path)
    clean = verified(spec, tmp_path)
    assert clean.passed, clean.render()
    assert modeling_qwen3.Qwen3DecoderLayer  # the family under test is transformers' own

    def window_everywhere(model: torch.nn.Module, options: Any) -> Any:
        structure = options.structure
        window = next(layer.window for layer in structure.layers if layer.window)
        assert any(layer.window is None for layer in structure.layers), "the tiny stack has a full layer"
        layers = tuple(
            dataclasses.replace(layer, attention="sliding", window=window) for layer in structure.layers
        )
        return dataclasses.replace(options, structure=dataclasses.replace(structure, layers=layers))

    with exported_with(window_everywhere):
        report = verified(spec, tmp_path)
    assert not report.passed and failed_checks(report) & {
        "prefill logits",
        "decode logits",
        "greedy generation",
    }


def test_the_tiny_stack_holds_a_whole_layer_pattern(tmp_path: Path) -> None:
    from kimi_adapter_core.structure.of_spec import structure_of_raw

    spec = qwen3_three_to_one(tmp_path)
    structure = structure_of_raw(spec, json.loads(spec.source.config.read_text()))
    assert tiny_model.tiny_layer_count(structure) == 4
    overrides = tiny_model.tiny_overrides(spec, options_from_spec(spec, output_dir=tmp_path / "out"))
    assert overrides["num_hidden_layers"] == 4 and overrides["layer_types"][-1] == "full_attention"


def test_constants_are_randomised_but_computed_buffers_are_not() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                         attention_bias=True))  # fmt: skip
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    changed = set(tiny_model.randomize_constants(model))
    assert {
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.bias",
    } <= changed
    assert not any("weight" in name and "proj" in name for name in changed)  # random already
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)
    assert (
        model.model.norm.weight.std() > 0.05
        and model.model.layers[0].self_attn.q_proj.bias.abs().mean() > 0.01
    )


def test_a_dropped_logit_scale_fails_verify(tmp_path: Path) -> None:
    """Cohere multiplies its logits by logit_scale after the LM head; a graph without it fails."""
    spec = load_spec(write_family_spec(tmp_path, "cohere", SMALL_FAMILY))
    assert verified(spec, tmp_path).passed

    def without_outside_math(model: torch.nn.Module, options: Any) -> Any:
        assert options.structure.outside_ops("logits") == (("mul", 0.0625),)
        return dataclasses.replace(options, structure=dataclasses.replace(options.structure, outside=()))

    with exported_with(without_outside_math):
        report = verified(spec, tmp_path)
    assert not report.passed and "prefill logits" in failed_checks(report)


def batched_verify(spec: Any, tmp_path: Path, **cache: Any) -> Any:
    options = options_from_spec(spec, output_dir=tmp_path / "out", batch=3, **cache)
    return verify(spec, dataclasses.replace(options, verify_dtypes=("float32",)), echo=lambda line: None)


def test_one_position_for_the_whole_batch_fails_the_ragged_check(tmp_path: Path) -> None:
    """The decode graph before ragged batches wrote every row's token at row 0's position: a batch of
    equal-length prompts cannot see it, the ragged check must."""
    from kimi_adapter_core.backends.extraction.runtime import abi as runtime

    spec = load_spec(REPO / "specs" / "mistral.yaml")  # sliding windows too
    clean = batched_verify(spec, tmp_path)
    assert clean.passed, clean.render()
    assert any(check.name == "ragged batch" for check in clean.checks)
    real = runtime.write_rows

    @contextlib.contextmanager
    def first_row_position(model: torch.nn.Module, options: Any) -> Iterator[None]:
        runtime.write_rows = lambda cache, new, position: real(cache, new, position[:1].expand_as(position))
        try:
            yield
        finally:
            runtime.write_rows = real

    with exported_with(first_row_position):
        report = batched_verify(spec, tmp_path)
    assert failed_checks(report) == {"ragged batch"}


def test_blocks_read_in_pool_order_fail_the_paged_check(tmp_path: Path) -> None:
    """A paged graph that reads the pool's blocks in physical order instead of the block table's passes
    nothing once the rows' blocks are out of order."""
    from kimi_adapter_core.backends.extraction.runtime import abi as runtime

    spec = load_spec(REPO / "specs" / "deepseek_v3.yaml")  # MLA latent blocks
    clean = batched_verify(spec, tmp_path, kv_cache="paged", block_size=4)
    assert clean.passed, clean.render()
    real = runtime.paged_view

    @contextlib.contextmanager
    def pool_order(model: torch.nn.Module, options: Any) -> Iterator[None]:
        runtime.paged_view = lambda pool, table: real(pool, table.sort(dim=1).values)
        try:
            yield
        finally:
            runtime.paged_view = real

    with exported_with(pool_order):
        report = batched_verify(spec, tmp_path, kv_cache="paged", block_size=4)
    assert {"greedy generation", "ragged batch"} <= failed_checks(report)
