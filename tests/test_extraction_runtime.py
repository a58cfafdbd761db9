"""The embeddable ABI runtime: standalone, eager-equal to transformers, usable by torch_ir.extract_ir."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from fixtures.spec_files import KIMI_SPEC as SPEC

from kimi_adapter_core.backends.extraction import options_from_spec, runtime
from kimi_adapter_core.backends.extraction.roundtrip import tiny_overrides
from kimi_adapter_core.loading import applied, load_config, load_model, submodule


def test_runtime_imports_only_stdlib_and_torch() -> None:
    tree = ast.parse(Path(runtime.__file__).read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {m.split(".")[0] for m in modules} <= {
        "__future__",
        "contextlib",
        "functools",
        "collections",
        "typing",
        "torch",
    }


def test_additive_causal_mask() -> None:
    mask = runtime.additive_causal_mask(torch.tensor([[2, 3]]), 5, torch.bfloat16)
    assert mask.shape == (1, 1, 2, 5) and mask.dtype == torch.bfloat16
    visible = mask == 0
    assert visible[0, 0].tolist() == [[True, True, True, False, False], [True, True, True, True, False]]
    assert mask[0, 0, 0, 4] == torch.finfo(torch.bfloat16).min


def test_kv_shapes_and_prefill_placement() -> None:
    class Config:
        kv_lora_rank, qk_rope_head_dim, num_attention_heads, qk_nope_head_dim, v_head_dim = (
            512,
            64,
            64,
            128,
            128,
        )

    assert runtime.kv_shapes(Config, "latent", 1, 2048) == ((1, 1, 2048, 512), (1, 1, 2048, 64))
    assert runtime.kv_shapes(Config, "expanded", 2, 16) == ((2, 64, 16, 192), (2, 64, 16, 128))
    with pytest.raises(ValueError, match="unknown kv_layout"):
        runtime.kv_shapes(Config, "paged", 1, 1)
    present = torch.arange(6.0).view(1, 1, 3, 2)
    (placed,) = runtime.place_prefill_kv([present], 5)
    assert (
        placed.shape == (1, 1, 5, 2) and torch.equal(placed[:, :, :3], present) and not placed[:, :, 3:].any()
    )


@pytest.fixture(scope="module")
def tiny_cpu() -> torch.nn.Module:
    options = options_from_spec(SPEC, output_dir="/tmp")
    config = load_config(
        SPEC, overrides={**tiny_overrides(SPEC, options), "text_config.num_hidden_layers": 2}
    )
    torch.manual_seed(0)
    with applied(SPEC, backend="extraction"):
        return load_model(SPEC, device="cpu", config=config, dtype=torch.float32).eval()


@pytest.mark.parametrize("kv_layout", ["latent", "expanded"])
def test_wrappers_equal_transformers_forward(tiny_cpu: torch.nn.Module, kv_layout: str) -> None:
    language_model, lm_head = (
        submodule(tiny_cpu, SPEC, "language_model"),
        submodule(tiny_cpu, SPEC, "lm_head"),
    )
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = tiny_cpu(input_ids=ids).logits
        with applied(SPEC, backend="extraction"):
            prefill = runtime.PrefillWrapper.from_language_model(language_model, lm_head, kv_layout=kv_layout)
            decode = runtime.DecodeWrapper.from_language_model(language_model, lm_head, kv_layout=kv_layout)
            _, mask, positions = runtime.prefill_inputs(
                batch=1, prefill_len=5, dtype=torch.float32, device="cpu"
            )
            logits, *present = prefill(ids[:, :5], mask, positions)
            step = runtime.decode_inputs(
                language_model.config,
                batch=1,
                position=5,
                max_cache_len=9,
                kv_layout=kv_layout,
                num_layers=2,
                dtype=torch.float32,
                device="cpu",
            )
            decoded, *updated = decode(ids[:, 5:], *step[1:4], *runtime.place_prefill_kv(present, 9))
    torch.testing.assert_close(logits, expected[:, :5])
    torch.testing.assert_close(decoded, expected[:, 5:])
    key, value = runtime.kv_shapes(language_model.config, kv_layout, 1, 9)
    assert [tuple(t.shape) for t in updated] == [key, value, key, value]
    assert torch.equal(updated[0][:, :, :5], runtime.place_prefill_kv(present, 9)[0][:, :, :5])
    assert (
        updated[0][:, :, 5].abs().sum() > 0 and not updated[0][:, :, 6:].any()
    )  # written at position 5 only
    assert all("expand_kv" not in layer.self_attn.__dict__ for layer in language_model.layers)


def test_wrappers_work_with_torch_ir_extract_ir() -> None:
    torch_ir = pytest.importorskip("torch_ir")
    options = options_from_spec(SPEC, output_dir="/tmp")
    config = load_config(
        SPEC, overrides={**tiny_overrides(SPEC, options), "text_config.num_hidden_layers": 2}
    )
    with applied(SPEC, backend="extraction"):
        model = load_model(SPEC, device="meta", config=config)
        language_model, lm_head = submodule(model, SPEC, "language_model"), model.lm_head
        wrapper = runtime.DecodeWrapper.from_language_model(language_model, lm_head, kv_layout="latent")
        inputs = runtime.decode_inputs(
            language_model.config,
            batch=1,
            position=4,
            max_cache_len=8,
            kv_layout="latent",
            num_layers=2,
            dtype=torch.float32,
        )
        ir = torch_ir.extract_ir(wrapper, inputs, strict=False)
    assert len(ir.graph_inputs) == 4 + 4 and len(ir.graph_outputs) == 1 + 4
    assert [tuple(m.shape) for m in ir.graph_outputs[1:3]] == [(1, 1, 8, 16), (1, 1, 8, 8)]
