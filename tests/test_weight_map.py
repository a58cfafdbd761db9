"""The weight map binds real checkpoint files to the executed IR.

Checkpoints here are written the way the real ones are: by transformers' own ``save_pretrained`` (its
reverse conversion splits fused experts back into per-expert tensors), and for Kimi-K2.5 in the
published layout (``language_model.model.layers.N.mlp.experts.E.gate_proj.weight_packed``, int4
packed by compressed-tensors' own packer) - a layout the test checks transformers' loader accepts.
Weights then reach the saved IR only through ``weight_loader.load_weights``; the executed graph must
match the eager model holding the same (dequantized) weights.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from fixtures.checkpoints import (
    PREFILL,
    eager_logits,
    extract,
    fp8_quantized,
    kimi_checkpoint,
    prefill_logits,
    published_vision,
)
from safetensors.torch import save_file

from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.equivalence.tolerance import Tolerance
from kimi_adapter_core.backends.extraction.equivalence.verdict import VerifyReport
from kimi_adapter_core.backends.extraction.equivalence.vision import check_vision
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.checkpoint.loader import load_weights, permute_for_rope, unpack_int
from kimi_adapter_core.checkpoint.naming import rename_weight
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied, load_config, load_model
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3_moe", "deepseek_v3"])
def test_checkpoint_written_by_transformers_loads_into_the_ir(name: str, tmp_path: Path) -> None:
    # deepseek_v3 ships an FP8 quantization_config: this tiny checkpoint is written unquantized
    spec, options, config, model = extract(name, tmp_path / "ir", quantization_config=None)
    model.save_pretrained(tmp_path / "ckpt")  # transformers' writer: fused experts saved per expert
    doc = json.loads(options.path("weight_map").read_text())
    assert not any("storage" in g for e in doc["weights"].values() for g in e["sources"])
    weights = load_weights(doc, tmp_path / "ckpt")
    state = model.state_dict()
    assert set(weights) == {rename_weight(p, options.weight_renames) for p in state} & set(weights)
    for path, tensor in state.items():
        if rename_weight(path, options.weight_renames) in weights:
            assert torch.equal(weights[rename_weight(path, options.weight_renames)], tensor), path
    fused = [e for e in doc["weights"].values() if e["ops"]]
    assert bool(fused) == (name in ("qwen3_moe", "deepseek_v3"))
    for entry in fused:  # rebuilt from one tensor per expert
        assert all(re.search(r"\.experts\.\d+\.", t) for g in entry["sources"] for t in g["tensors"])
    prompt = torch.randint(
        3, config.get_text_config().vocab_size, (1, PREFILL), generator=torch.Generator().manual_seed(1)
    )
    torch.testing.assert_close(prefill_logits(options, weights, prompt), eager_logits(spec, model, prompt))


def test_kimi_int4_checkpoint_in_the_published_layout_loads_into_the_ir(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    spec, options, config, model = extract("kimi_k25", tmp_path / "ir")
    doc = json.loads(options.path("weight_map").read_text())
    scheme = config.text_config.quantization_config["config_groups"]["group_0"]["weights"]
    dense, packed = kimi_checkpoint(model, scheme["group_size"])

    vision = published_vision(model, config.vision_config.num_attention_heads)
    assert any(name.endswith(".wqkv.weight") for name in vision)

    # 1. the layout is the one transformers' loader reads: the dequantized per-expert checkpoint and the
    # fused, rope-interleaved vision tensors load into a fresh native model equal to the values we wrote
    (tmp_path / "dense").mkdir()
    save_file({**dense, **vision}, str(tmp_path / "dense" / "model.safetensors"))
    plain = config.to_dict()
    del plain["text_config"]["quantization_config"]
    (tmp_path / "dense" / "config.json").write_text(json.dumps(plain))
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    reference = loaded.state_dict()
    for path, tensor in model.state_dict().items():
        if path.startswith(("model.vision_tower.", "model.mm_projector.")):
            assert torch.equal(reference[path], tensor), path

    # 2. the int4 checkpoint: routed experts only, as the config's ignore list says
    (tmp_path / "int4").mkdir()
    save_file({**packed, **vision}, str(tmp_path / "int4" / "model.safetensors"))
    quantized = {n for n in packed if n.endswith("_packed")}
    assert quantized and all(".mlp.experts." in n for n in quantized)
    assert not any(".shared_experts." in n or "self_attn" in n or "lm_head" in n for n in quantized)
    weights = load_weights(doc, tmp_path / "int4")
    native_of = {rename_weight(path, options.weight_renames): path for path in reference}
    assert {native_of[name] for name in weights} >= {
        p for p in reference if p.startswith("model.vision_tower.")
    }
    for graph_name, tensor in weights.items():
        torch.testing.assert_close(
            tensor, reference[native_of[graph_name]], rtol=0, atol=1e-6, msg=graph_name
        )
    q_proj = doc["weights"]["vision_tower.encoder.blocks.0.attn.q_proj.weight"]
    assert q_proj["sources"][0]["tensors"] == ["vision_tower.encoder.blocks.0.wqkv.weight"]
    assert [op["op"] for op in q_proj["ops"]] == ["chunk", "permute_for_rope"]

    # 3. the vision graph runs on those weights and equals transformers' image features
    report = VerifyReport("latent", 1e-4)
    float32 = dataclasses.replace(options, dtype="float32")
    check_vision(report, spec, loaded, float32, weights, tolerance=Tolerance("float32", 1e-4))
    assert report.passed, report.render()

    prompt = torch.randint(
        3, config.text_config.vocab_size, (1, PREFILL), generator=torch.Generator().manual_seed(1)
    )
    torch.testing.assert_close(prefill_logits(options, weights, prompt), eager_logits(spec, loaded, prompt))


def test_int4_unpacking_agrees_with_compressed_tensors() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    q = torch.randint(-8, 8, (6, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    packed = pack_to_int32(q, 4)
    assert torch.equal(unpack_int(packed, 4, 64).to(torch.int8), q)
    assert torch.equal(unpack_int(packed, 4, 64).to(torch.int8), unpack_from_int32(packed, 4, q.shape))


@pytest.mark.parametrize("shape", [(48, 10), (48,)])
def test_rope_permutation_is_transformers_own(shape: tuple[int, ...]) -> None:
    """The weight map's ``permute_for_rope`` equals transformers' ``PermuteForRope`` (weights and biases),
    and ``inverse`` undoes it."""
    from types import SimpleNamespace

    from transformers.core_model_loading import PermuteForRope

    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    config = SimpleNamespace(vision_config=SimpleNamespace(num_attention_heads=4))
    theirs = PermuteForRope(subconfig_key="vision_config")._permute_for_rope(tensor, config)
    ours = permute_for_rope(tensor, 4)
    assert torch.equal(ours, theirs) and not torch.equal(ours, tensor)
    assert torch.equal(permute_for_rope(ours, 4, inverse=True), tensor)


def test_fp8_block_storage_dequantizes_per_block(tmp_path: Path) -> None:
    spec, options, config, model = extract("deepseek_v3", tmp_path / "ir")
    doc = json.loads(options.path("weight_map").read_text())
    entries = doc["weights"]
    fp8 = {
        g["tensors"][0]: g
        for e in entries.values()
        for g in e["sources"]
        if g.get("storage", {}).get("format") == "fp8-block"
    }
    assert any("self_attn.kv_a_proj_with_mqa" in n for n in fp8) and any(".experts.0." in n for n in fp8)
    assert not any("lm_head" in n or "mlp.gate.weight" in n or "norm" in n for n in fp8)
    name, group = next(iter(fp8.items()))
    block = group["storage"]["block"]
    rows, cols = group["shape"]
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(4))
    scale = torch.rand(-(-rows // block[0]), -(-cols // block[1])) + 0.5
    stored, expected = fp8_quantized(weight, scale, block)
    (tmp_path / "ckpt").mkdir()
    save_file({name: stored, name + "_scale_inv": scale}, str(tmp_path / "ckpt" / "model.safetensors"))
    one = {"weights": {name: {"shape": [rows, cols], "dtype": "float32", "sources": [group], "ops": []}}}
    got = load_weights(one, tmp_path / "ckpt")[name]
    assert torch.equal(got, expected)
    assert (got - weight).abs().max() <= weight.abs().max() * 0.07  # e4m3: 3 mantissa bits


def test_a_weight_rename_transformers_would_not_load_is_an_error(tmp_path: Path) -> None:
    from kimi_adapter_core.checkpoint.layout import checkpoint_sources
    from kimi_adapter_core.checkpoint.tensors import TensorType

    spec = load_spec("kimi_k25")
    options = options_from_spec(spec, output_dir=tmp_path)
    config = load_config(spec, overrides=tiny_overrides(spec, options))
    with applied(spec):
        meta = load_model(spec, device="meta", config=config, dtype=torch.float32)
    path = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    weights = {path: TensorType(tuple(meta.get_parameter(path).shape), "float32")}
    good = checkpoint_sources(meta, weights, options.weight_renames)[path]
    assert good.tensors[0] == "language_model.model.layers.1.mlp.experts.0.gate_proj.weight"
    with pytest.raises(KadaptError, match="would load into"):
        checkpoint_sources(meta, weights, (("^model\\.language_model\\.", "text.model."),))


def test_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path: Path) -> None:
    """gpt-oss's published layout: routed experts as MXFP4 blocks + e8m0 scales, transposed on disk.
    The expected weights come from transformers' own dequantizer (``convert_moe_packed_tensors``)."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    spec, options, config, model = extract("gpt_oss", tmp_path / "ir")
    doc = json.loads(options.path("weight_map").read_text())
    packed = {
        g["tensors"][0]: g["storage"]
        for e in doc["weights"].values()
        for g in e["sources"]
        if g.get("storage", {}).get("format") == "mxfp4"
    }
    layers = config.num_hidden_layers
    assert len(packed) == 2 * layers and all(n.endswith(("gate_up_proj", "down_proj")) for n in packed)
    model.save_pretrained(tmp_path / "ckpt")
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    expected: dict[str, torch.Tensor] = {}
    for name, storage in packed.items():
        del tensors[name]  # the published checkpoint has no dense copy
        blocks = torch.randint(0, 256, storage["tensors"]["blocks"]["shape"], generator=generator)
        scales = torch.randint(122, 129, storage["tensors"]["scales"]["shape"], generator=generator)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks.to(torch.uint8), scales.to(torch.uint8)
        expected[name] = convert_moe_packed_tensors(
            blocks.to(torch.uint8), scales.to(torch.uint8), dtype=torch.float32
        )
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    weights = load_weights(doc, tmp_path / "ckpt")
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    with torch.no_grad():  # the eager model holding the dequantized experts is the reference
        for name, tensor in expected.items():
            model.get_parameter(name).copy_(tensor)
    prompt = torch.randint(3, config.vocab_size, (1, PREFILL), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(prefill_logits(options, weights, prompt), eager_logits(spec, model, prompt))


@pytest.mark.parametrize(
    "module",
    [
        "model.layers.0.self_attn",
        "model.layers.11.self_attn.q_proj",
        "model.layers.1.mlp.router",
        "model.layers.1.mlp.router_bias",
        "model.layers.1.mlp.experts",
        "model.embed_tokens",
        "lm_head",
        "language_model.lm_head",
        "model.layers.1.mlp.gate",
        "model.layers.1.mlp.gate_proj",
    ],
)
def test_modules_to_not_convert_match_as_transformers_matches_them(module: str) -> None:
    """One rule for a quantization_config's modules_to_not_convert (the weight map's FP8/MXFP4 storage,
    simulation's weight sizes): transformers' own should_convert_module, negated."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    from kimi_adapter_core.checkpoint.storage import not_converted

    gpt_oss = json.loads((REPO / "specs" / "gpt_oss" / "config.json").read_text())
    for patterns in (
        gpt_oss["quantization_config"]["modules_to_not_convert"],
        ["mlp.gate", "layers.1"],
        ["lm_head"],
    ):
        assert not_converted(module, tuple(patterns)) == (not should_convert_module(module, patterns))


def test_module_matcher_is_compressed_tensors_rule_entry_by_entry() -> None:
    """The one-pass matcher equals the rule read entry by entry: ``re:`` from the start, else the name
    or a dotted suffix (never a partial component)."""
    import re

    from kimi_adapter_core.checkpoint.storage import module_matcher

    entries = ["lm_head", "re:.*self_attn.*", "mlp.gate", "re:vision_tower.*", "experts.0.down_proj"]

    def by_entry(module: str) -> bool:
        return any(
            re.match(e[3:], module) is not None
            if e.startswith("re:")
            else module == e or module.endswith("." + e)
            for e in entries
        )

    modules = [
        "lm_head", "language_model.lm_head", "model.lm_head_x", "model.layers.3.self_attn.q_proj",
        "model.layers.3.mlp.gate", "model.layers.3.mlp.gate_proj", "model.layers.3.xmlp.gate",
        "vision_tower.blocks.0.wo", "model.vision_tower.x", "model.layers.1.mlp.experts.0.down_proj",
        "model.layers.1.mlp.experts.10.down_proj", "",
    ]  # fmt: skip
    for matches in (module_matcher(entries), module_matcher(e for e in entries)):  # any iterable
        assert [matches(m) for m in modules] == [by_entry(m) for m in modules]
    assert sum(by_entry(m) for m in modules) == 6  # both outcomes are exercised


def test_weight_renames_substitute_as_re_sub_does() -> None:
    """Rules with group references are expanded per match (``naming._compiled``): the names must be
    exactly ``re.sub``'s, rule after rule, for every template form a spec may write."""
    rules = (
        (r"^model\.language_model\.", "language_model.model."),
        (r"^language_model\.model\.layers\.(\d+)\.attn\.", r"blocks.\1.attention."),
        (r"experts\.(?P<e>\d+)\.", r"e\g<e>.\g<0>"),
        (r"\.weight$", r"\\w"),  # an escaped backslash stays one backslash
    )
    paths = [
        "model.language_model.layers.12.attn.q.weight",
        "model.language_model.layers.3.mlp.experts.17.down_proj.weight",
        "lm_head.weight",
        "model.visual.blocks.0.bias",
    ]

    def by_re_sub(path: str) -> str:
        for pattern, replacement in rules:
            path = re.sub(pattern, replacement, path)
        return path

    assert [rename_weight(p, rules) for p in paths] == [by_re_sub(p) for p in paths]
    assert len({by_re_sub(p) for p in paths} - set(paths)) == 3  # three of the four are renamed
