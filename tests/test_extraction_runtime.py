"""The embeddable ABI runtime: standalone, eager-equal to transformers, usable by torch_ir.extract_ir."""

from __future__ import annotations

import ast
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch_ir
from fixtures.spec_files import KIMI_SPEC as SPEC
from fixtures.spec_files import REPO

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.loading import applied, load_config, load_model, submodule
from kimi_adapter_core.structure.derive import derive_structure


def test_runtime_imports_only_stdlib_and_torch() -> None:
    tree = ast.parse(Path(runtime.__file__).read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {m.split(".")[0] for m in modules} <= {
        "__future__",
        "contextlib",
        "functools",
        "inspect",
        "sys",
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
    kimi = json.loads((REPO / "specs" / "kimi_k25" / "config.json").read_text())["text_config"]
    mla = derive_structure(kimi).attention
    assert runtime.kv_shapes(mla.kv_dims("latent"), 1, 2048) == ((1, 1, 2048, 512), (1, 1, 2048, 64))
    assert runtime.kv_shapes(mla.kv_dims("expanded"), 2, 16) == ((2, 64, 16, 192), (2, 64, 16, 128))
    qwen = derive_structure(json.loads((REPO / "specs" / "qwen3_moe" / "config.json").read_text())).attention
    assert runtime.kv_shapes(qwen.kv_dims("heads"), 1, 64) == ((1, 4, 64, 128), (1, 4, 64, 128))
    with pytest.raises(ValueError, match="does not fit GQA attention; valid: heads"):
        qwen.kv_dims("latent")
    present = torch.arange(6.0).view(1, 1, 3, 2)
    (placed,) = runtime.place_prefill_kv([present], 5)
    assert (
        placed.shape == (1, 1, 5, 2) and torch.equal(placed[:, :, :3], present) and not placed[:, :, 3:].any()
    )


def test_sliding_window_mask_hides_keys_a_window_behind() -> None:
    positions = torch.tensor([[3, 4]])
    full = runtime.additive_causal_mask(positions, 6, torch.float32)
    visible = runtime.sliding_window_mask(full, positions, window=2) == 0
    # transformers' overlay: key k visible to the query at p iff k <= p and p - k < window
    assert visible[0, 0].tolist() == [
        [False, False, True, True, False, False],
        [False, False, False, True, True, False],
    ]


@pytest.fixture(scope="module")
def tiny_cpu() -> torch.nn.Module:
    options = options_from_spec(SPEC, output_dir=tempfile.gettempdir())
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
            keyword = upstream.decoder_protocol(language_model).cache_keyword
            prefill = runtime.PrefillWrapper.from_language_model(
                language_model, lm_head, kv_layout=kv_layout, cache_keyword=keyword
            )
            decode = runtime.DecodeWrapper.from_language_model(
                language_model, lm_head, kv_layout=kv_layout, cache_keyword=keyword
            )
            _, mask, positions = runtime.prefill_inputs(
                batch=1, prefill_len=5, dtype=torch.float32, device="cpu"
            )
            logits, *present = prefill(ids[:, :5], mask, positions)
            kv_dims = derive_structure(language_model.config).attention.kv_dims(kv_layout)
            step = runtime.decode_inputs(
                kv_dims,
                batch=1,
                position=5,
                max_cache_len=9,
                num_layers=2,
                dtype=torch.float32,
                device="cpu",
            )
            decoded, *updated = decode(ids[:, 5:], *step[1:4], *runtime.place_prefill_kv(present, 9))
    torch.testing.assert_close(logits, expected[:, :5])
    torch.testing.assert_close(decoded, expected[:, 5:])
    key, value = runtime.kv_shapes(kv_dims, 1, 9)
    assert [tuple(t.shape) for t in updated] == [key, value, key, value]
    assert torch.equal(updated[0][:, :, :5], runtime.place_prefill_kv(present, 9)[0][:, :, :5])
    assert (
        updated[0][:, :, 5].abs().sum() > 0 and not updated[0][:, :, 6:].any()
    )  # written at position 5 only
    assert all("expand_kv" not in layer.self_attn.__dict__ for layer in language_model.layers)


def _greedy(prefill: Any, decode: Any, ids: torch.Tensor, steps: int, cache_len: int) -> tuple[Any, ...]:
    """Prefill logits and presents, then ``steps`` greedy decode steps over a ``cache_len`` cache."""
    _, mask, positions = runtime.prefill_inputs(
        batch=1, prefill_len=ids.shape[1], dtype=torch.float32, device="cpu"
    )
    logits, *present = prefill(ids, mask, positions)
    cache = runtime.place_prefill_kv(present, cache_len)
    token = logits[:, -1:].argmax(-1)
    tokens, step_logits = [token], []
    for position in range(ids.shape[1], ids.shape[1] + steps):
        pos = torch.full((1, 1), position)
        mask = runtime.additive_causal_mask(pos, cache_len, torch.float32)
        decoded, *cache = decode(token, mask, pos, torch.tensor([position]), *cache)
        token = decoded[:, -1:].argmax(-1)
        tokens.append(token)
        step_logits.append(decoded)
    return logits, present, torch.cat(tokens, dim=1), torch.cat(step_logits, dim=1), cache


def test_absorbed_mla_equals_reexpand(tiny_cpu: torch.nn.Module) -> None:
    """Absorbing kv_b_proj is the same math: logits and cache within 1e-5, identical greedy tokens."""
    language_model, lm_head = (
        submodule(tiny_cpu, SPEC, "language_model"),
        submodule(tiny_cpu, SPEC, "lm_head"),
    )
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    # the protocol probe runs each layer once on first use (then cached): probed before counting
    keyword = upstream.decoder_protocol(language_model).cache_keyword
    runs, kv_b_calls = {}, []
    hooks = [
        layer.self_attn.kv_b_proj.register_forward_hook(lambda *_: kv_b_calls.append(1))
        for layer in language_model.layers
    ]
    try:
        with torch.no_grad(), applied(SPEC, backend="extraction"):
            for attention in runtime.MLA_ATTENTIONS:
                kv_b_calls.clear()
                wrappers = [
                    cls.from_language_model(
                        language_model,
                        lm_head,
                        kv_layout="latent",
                        cache_keyword=keyword,
                        mla_attention=attention,
                    )
                    for cls in (runtime.PrefillWrapper, runtime.DecodeWrapper)
                ]
                runs[attention] = _greedy(*wrappers, ids, steps=16, cache_len=24)
                # reexpand runs kv_b_proj in every layer of every step; absorbed only reads its weight
                assert len(kv_b_calls) == (0 if attention == "absorbed" else 2 * 17)
                assert all("forward" not in layer.self_attn.__dict__ for layer in language_model.layers)
    finally:
        for hook in hooks:
            hook.remove()
    (logits, present, tokens, decoded, cache), (a_logits, a_present, a_tokens, a_decoded, a_cache) = (
        runs["reexpand"],
        runs["absorbed"],
    )
    tolerance = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(a_logits, logits, **tolerance)
    for ours, theirs in zip([*a_present, *a_cache], [*present, *cache], strict=True):
        torch.testing.assert_close(ours, theirs, **tolerance)
    torch.testing.assert_close(a_decoded, decoded, **tolerance)
    assert torch.equal(a_tokens, tokens) and len(set(tokens[0].tolist())) > 3


def test_absorbed_needs_the_latent_layout() -> None:
    with pytest.raises(ValueError, match="needs kv_layout 'latent'"):
        runtime.check_mla_attention("expanded", "absorbed")
    with pytest.raises(ValueError, match="unknown mla_attention 'fused'"):
        runtime.check_mla_attention("latent", "fused")
    runtime.check_mla_attention("expanded", "reexpand")


def test_wrappers_work_with_torch_ir_extract_ir() -> None:
    options = options_from_spec(SPEC, output_dir=tempfile.gettempdir())
    config = load_config(
        SPEC, overrides={**tiny_overrides(SPEC, options), "text_config.num_hidden_layers": 2}
    )
    with applied(SPEC, backend="extraction"):
        model = load_model(SPEC, device="meta", config=config)
        language_model, lm_head = submodule(model, SPEC, "language_model"), model.lm_head
        wrapper = runtime.DecodeWrapper.from_language_model(
            language_model,
            lm_head,
            kv_layout="latent",
            cache_keyword=upstream.decoder_protocol(language_model).cache_keyword,
        )
        inputs = runtime.decode_inputs(
            derive_structure(language_model.config).attention.kv_dims("latent"),
            batch=1,
            position=4,
            max_cache_len=8,
            num_layers=2,
            dtype=torch.float32,
        )
        ir = torch_ir.extract_ir(wrapper, inputs, strict=False)
    assert len(ir.graph_inputs) == 4 + 4 and len(ir.graph_outputs) == 1 + 4
    assert [tuple(m.shape) for m in ir.graph_outputs[1:3]] == [(1, 1, 8, 16), (1, 1, 8, 8)]


def _attention_matmul_flops(graph: Any) -> int:
    """Multiply-add FLOPs of every linear/mm/bmm node inside the attentions, from node shapes."""
    import math

    types, flops = graph.node_types(), 0
    for node in graph.nodes:
        if ".self_attn" not in node.scope:
            continue
        op = node.op.split(".")[1]
        if op in ("linear", "mm", "bmm", "matmul"):
            first = graph.type_of(node.inputs[0], types).shape
            flops += 2 * math.prod(node.outputs[0].shape) * first[-1]
    return flops


def test_absorbed_decode_graph_never_expands_the_cache() -> None:
    """kv_b_proj's weight is only reshaped (never a linear over the cache) and the attention FLOPs drop."""
    import dataclasses

    from kimi_adapter_core.backends.extraction.ir.graph import WEIGHT
    from kimi_adapter_core.backends.extraction.ir.stitch import Plan
    from kimi_adapter_core.backends.extraction.job.pipeline import Clock, backbone_of, bound_to, build_graph

    cache_len, graphs = 48, {}
    options = options_from_spec(SPEC, output_dir="/tmp", prefill_len=4, max_cache_len=cache_len)
    config = load_config(
        SPEC, overrides={**tiny_overrides(SPEC, options), "text_config.num_hidden_layers": 2}
    )
    with applied(SPEC, backend="extraction"):
        model = load_model(SPEC, device="meta", config=config, dtype=torch.float32)
        backbone = backbone_of(SPEC, model)
        for attention in runtime.MLA_ATTENTIONS:
            chosen = bound_to(
                SPEC, backbone, dataclasses.replace(options, dtype="float32", mla_attention=attention)
            )
            graphs[attention] = build_graph("decode", backbone, chosen, Plan(2), Clock(lambda _: None))
    text = backbone.config
    kv_b_out = text.num_attention_heads * (text.qk_nope_head_dim + text.v_head_dim)
    for attention, graph in graphs.items():
        consumers = {
            node.op.split(".")[1]
            for node in graph.nodes
            for ref in node.inputs
            if ref.kind == WEIGHT and ref.key.endswith("self_attn.kv_b_proj.weight")
        }
        expanding = [  # a kv_b_proj-sized output over the cache positions
            node
            for node in graph.nodes
            if len(node.outputs[0].shape) >= 2
            and node.outputs[0].shape[-2] == cache_len
            and node.outputs[0].shape[-1] == kv_b_out
        ]
        if attention == "absorbed":
            assert consumers and consumers <= {"view", "reshape", "_unsafe_view"}, consumers
            assert not expanding
        else:
            assert "linear" in consumers and expanding
    absorbed, reexpand = (_attention_matmul_flops(graphs[a]) for a in ("absorbed", "reexpand"))
    # kv_b_proj over 48 positions dominates the re-expanding attention; absorbed pays H x r per position
    assert 0 < absorbed * 2 < reexpand, (absorbed, reexpand)
