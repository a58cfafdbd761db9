"""Storage comes from the checkpoint actually given: its config's ``quantization_config``.

One family, three checkpoints - dense, int4 (compressed-tensors pack-quantized, Kimi-K2.5's block) and
FP8 (block-scaled, DeepSeek-V3's) - each written from a tiny model by transformers' ``save_pretrained``
and quantized the way the published checkpoints are, loads through the weight map its own config
gives into the executed IR and equals what transformers loads. A config without ``quantization_config``
is a dense checkpoint even when the spec's ``quantization`` schemes describe an int4 one (Kimi-K2.5);
a scheme that contradicts the config is a located error, at ``validate`` and at ``apply``. The IR's
per-weight ``quantization`` is the weight map's entry, for every shipped spec at full size.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch_ir
from click.testing import CliRunner
from fixtures.checkpoints import (
    PREFILL,
    eager_logits,
    extract,
    fp8_quantized,
    int4_quantized,
    kimi_checkpoint,
    prefill_logits,
    published_vision,
)
from fixtures.shared_apply import SharedApplies
from fixtures.spec_files import kimi_spec_with
from safetensors.torch import load_file, save_file

from kimi_adapter_core.checkpoint.loader import load_weights
from kimi_adapter_core.checkpoint.naming import rename_weight
from kimi_adapter_core.checkpoint.storage import FP4_E2M1, FP8_BLOCK, MXFP4, PACK_QUANTIZED
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError, Refusal
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.spec.loader import check_spec

REPO = Path(__file__).resolve().parents[1]
KIMI_CONFIG = json.loads((REPO / "specs" / "kimi_k25" / "config.json").read_text())
INT4 = KIMI_CONFIG["text_config"]["quantization_config"]
# DeepSeek-V3's FP8 block with blocks that divide every tiny shape: transformers' dequantizer derives
# the block from the scale grid, which equals the configured block only for whole blocks
FP8 = {**json.loads((REPO / "specs" / "deepseek_v3" / "config.json").read_text())["quantization_config"]}
FP8["weight_block_size"] = [8, 16]
# the format each shipped config's quant_method stores with
FORMAT_OF = {None: set(), "compressed-tensors": {PACK_QUANTIZED}, "fp8": {FP8_BLOCK}, "mxfp4": {MXFP4}}
EXTRACTABLE = [p.stem for p in sorted((REPO / "specs").glob("*.yaml")) if load_spec(p).abi is not None]


def _formats(doc: dict[str, Any]) -> set[str]:
    return {g["storage"]["format"] for e in doc["weights"].values() for g in e["sources"] if "storage" in g}


def _read_by(doc: dict[str, Any]) -> set[str]:
    """Every checkpoint tensor the weight map reads: each source's name plus its storage suffixes."""
    return {
        name + part["suffix"]
        for entry in doc["weights"].values()
        for group in entry["sources"]
        for name in group["tensors"]
        for part in (group["storage"]["tensors"].values() if "storage" in group else [{"suffix": ""}])
    }


def _prompt(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, PREFILL), generator=torch.Generator().manual_seed(1))


def _write(directory: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _fp8_dequantized_by_transformers(stored: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """transformers' own FP8 dequantizer: the op ``from_pretrained`` runs on each (weight, scale_inv)
    pair when it dequantizes (on CPU it always does; the quantizer itself needs accelerate)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None).convert({"weight": stored, "weight_scale_inv": scale_inv})["weight"]


@pytest.mark.parametrize("storage", ["dense", "int4", "fp8"])
def test_each_checkpoint_loads_through_the_weight_map_its_config_gives(storage: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    qc = {"dense": None, "int4": INT4, "fp8": FP8}[storage]
    spec, options, config, model = extract("deepseek_v3", tmp_path / "ir", quantization_config=qc)
    doc = json.loads(options.path("weight_map").read_text())
    assert _formats(doc) == {"dense": set(), "int4": {PACK_QUANTIZED}, "fp8": {FP8_BLOCK}}[storage]
    assert doc["quantization"] == (None if qc is None else "config quantization_config")

    model.save_pretrained(tmp_path / "saved")  # per-expert tensors, transformers' names
    tensors = load_file(str(tmp_path / "saved" / "model.safetensors"))
    plain = json.loads((tmp_path / "saved" / "config.json").read_text())
    plain.pop("quantization_config", None)
    generator = torch.Generator().manual_seed(7)
    if storage == "dense":
        checkpoint = reference_dir = _write(tmp_path / "dense", tensors, plain)
    elif storage == "int4":  # routed experts only, as Kimi-K2.5's ignore list says
        quantized = dict(tensors)
        for name, weight in tensors.items():
            if re.search(r"\.mlp\.experts\.\d+\.\w+_proj\.weight$", name):
                del quantized[name]
                _, stored = int4_quantized(weight, INT4["config_groups"]["group_0"]["weights"]["group_size"])
                quantized.update({name + suffix: t for suffix, t in stored.items()})
        # transformers reads this very checkpoint: compressed-tensors decompresses it while loading
        checkpoint = reference_dir = _write(
            tmp_path / "int4", quantized, {**plain, "quantization_config": qc}
        )
    else:  # every projection but the head and the router, as DeepSeek-V3 publishes it
        quantized, dequantized = dict(tensors), dict(tensors)
        block = (FP8["weight_block_size"][0], FP8["weight_block_size"][1])
        for name, weight in tensors.items():
            if re.search(r"_proj(_with_mqa)?\.weight$", name):
                rows, cols = weight.shape
                grid = (-(-rows // block[0]), -(-cols // block[1]))
                scale = torch.exp2(torch.randint(-8, -5, grid, generator=generator).float())
                quantized[name], _ = fp8_quantized(weight, scale, block)
                quantized[name + "_scale_inv"] = scale
                dequantized[name] = _fp8_dequantized_by_transformers(quantized[name], scale)
        checkpoint = _write(tmp_path / "fp8", quantized, {**plain, "quantization_config": qc})
        reference_dir = _write(tmp_path / "reference", dequantized, plain)

    reference, info = AutoModelForCausalLM.from_pretrained(
        reference_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # the layout is one transformers reads, tensor for tensor
    weights = load_weights(doc, checkpoint)
    state = reference.state_dict()
    assert set(weights) <= set(state) and len(weights) == len(doc["weights"])
    assert _read_by(doc) == set(load_file(str(checkpoint / "model.safetensors")))
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name].to(tensor.dtype)), name
    for param in reference.parameters():  # compressed-tensors decompresses to bf16 (exact values here)
        param.data = param.data.float()
    prompt = _prompt(config.vocab_size)
    torch.testing.assert_close(
        prefill_logits(options, weights, prompt), eager_logits(spec, reference.eval(), prompt)
    )


# DeepSeek-V4's top-level tensors by their model name (no ``model.``) as its checkpoint names them, where
# transformers' renamings are anchored at the base model's names (conversion_mapping.py, deepseek_v4)
V4_TOP_LEVEL_NAMES = {
    "embed_tokens.weight": "embed.weight",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_scale": "hc_head_scale",
}


def _as_deepseek_v4_ships_it(
    tensors: dict[str, torch.Tensor], doc: dict[str, Any], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """``tensors`` (a ``save_pretrained`` state) with every source the weight map says is quantized
    stored as DeepSeek-V4-Flash ships it: FP8 with power-of-two ue8m0 block scales, the routed experts
    FP4 (two random e2m1 codes a byte) with one ue8m0 scale per 32 inputs of a row."""
    stored = dict(tensors)
    for entry in doc["weights"].values():
        for group in (g for g in entry["sources"] if "storage" in g):
            storage = group["storage"]
            for name in group["tensors"]:
                rows, cols = tensors[name].shape
                if storage["format"] == FP8_BLOCK:
                    br, bc = storage["block"]
                    grid = (-(-rows // br), -(-cols // bc))
                    scale = torch.exp2(torch.randint(-8, -5, grid, generator=generator).float())
                    stored[name], _ = fp8_quantized(tensors[name].float(), scale, (br, bc))
                else:
                    assert storage["format"] == FP4_E2M1, storage["format"]
                    codes = torch.randint(0, 256, (rows, cols // 2), generator=generator, dtype=torch.uint8)
                    stored[name] = codes.view(torch.int8)
                    scale = torch.exp2(torch.randint(-3, 3, (rows, cols // 32), generator=generator).float())
                stored[name + "_scale_inv"] = scale.to(torch.float8_e8m0fnu)
    return stored


def test_deepseek_v4_flash_checkpoint_loads_as_transformers_reads_it(tmp_path: Path) -> None:
    """DeepSeek-V4-Flash's quantization_config (FP8 with ue8m0 scales, ``expert_dtype: fp4``): the weight
    map stores the routed experts FP4 and every other linear FP8 but the head, which the checkpoint
    renames (``head.weight``) and keeps bf16; transformers' own loader reads the very checkpoint the
    map describes - no tensor missing or unexpected - into the weights kadapt's loader gives, both as
    ``save_pretrained`` names it and under the published checkpoint's names (the base model's, without
    ``model.``, ``embed.weight``, scales as ``X.scale``), which transformers' loader accepts too."""
    from transformers import AutoModelForCausalLM

    qc = json.loads((REPO / "specs" / "deepseek_v4_flash" / "config.json").read_text())["quantization_config"]
    qc = {**qc, "weight_block_size": [8, 16]}  # whole blocks of the tiny shapes (see FP8 above)
    spec, options, config, model = extract("deepseek_v4_flash", tmp_path / "ir", quantization_config=qc)
    doc = json.loads(options.path("weight_map").read_text())
    assert _formats(doc) == {FP8_BLOCK, FP4_E2M1}
    head = doc["weights"]["lm_head.weight"]["sources"]
    assert head[0]["tensors"] == ["head.weight"] and "storage" not in head[0]
    for entry in doc["weights"].values():
        for group in (g for g in entry["sources"] if "storage" in g):
            routed = re.search(r"\.experts\.\d+\.", group["tensors"][0]) is not None
            assert (group["storage"]["format"] == FP4_E2M1) == routed, group["tensors"][0]
            assert group["storage"]["tensors"]["scale"]["dtype"] == "float8_e8m0fnu"

    model.save_pretrained(tmp_path / "saved")
    plain = json.loads((tmp_path / "saved" / "config.json").read_text())
    stored = _as_deepseek_v4_ships_it(
        load_file(str(tmp_path / "saved" / "model.safetensors")), doc, torch.Generator().manual_seed(7)
    )
    checkpoint = _write(tmp_path / "fp8", stored, {**plain, "quantization_config": qc})
    assert _read_by(doc) == set(stored)
    # the names the published checkpoint uses (DeepSeek's inference code's): the base model's, without
    # ``model.``, its top-level tensors under their own names, scales as ``X.scale``
    own = {f"model.{k}": v for k, v in V4_TOP_LEVEL_NAMES.items()}
    assert doc["base_model_prefix"] == "model" and doc["aliases"] == own
    published = {
        re.sub(r"\.weight_scale_inv$", ".scale", own.get(name, name).removeprefix("model.")): t
        for name, t in stored.items()
    }
    assert (
        len(published) == len(stored)
        and "embed.weight" in published
        and "layers.0.attn.wkv.scale" in published
    )
    published_dir = _write(tmp_path / "published", published, {**plain, "quantization_config": qc})
    for folder in (checkpoint, published_dir):
        weights = load_weights(doc, folder)
        # on CPU transformers dequantizes an FP8 checkpoint while loading it (to bf16: every value here
        # is a short mantissa times a power of two, exact in bf16)
        reference, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, output_loading_info=True
        )
        assert not any(info.values()), info
        state = reference.state_dict()
        assert set(weights) <= set(state) and len(weights) == len(doc["weights"])
        for name, tensor in weights.items():
            assert torch.equal(tensor, state[name].to(tensor.dtype)), name


def test_kimi_config_without_quantization_config_is_a_dense_checkpoint(tmp_path: Path) -> None:
    """The reported case: Kimi-K2.5's spec declares int4 experts (Q1), the checkpoint's config has no
    quantization_config. transformers loads it dense; so does the weight map, saying Q1 was not applied."""
    from transformers import AutoModelForImageTextToText

    spec, options, config, model = extract(
        "kimi_k25", tmp_path / "ir", **{"text_config.quantization_config": None}
    )
    assert spec.quantization, "the spec's int4 scheme is what this test is about"
    doc = json.loads(options.path("weight_map").read_text())
    assert doc["quantization"] is None and _formats(doc) == set()
    assert [n for n in doc["notes"] if n.startswith("quantization[0] (Q1, int4") and "not applied" in n]
    for kind in ("prefill", "decode", "vision"):
        ir = json.loads(options.path(kind).read_text())
        assert not [w["name"] for w in ir["weights"] if "quantization" in w], kind

    dense, _ = kimi_checkpoint(model, 32)
    vision = published_vision(model, config.vision_config.num_attention_heads)
    plain = config.to_dict()
    plain["text_config"].pop("quantization_config", None)
    checkpoint = _write(tmp_path / "dense", {**dense, **vision}, plain)
    reference = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    weights = load_weights(doc, checkpoint)
    assert _read_by(doc) == set(dense) | set(vision)  # every tensor of the checkpoint, none it lacks
    state = reference.state_dict()
    native_of = {rename_weight(path, options.weight_renames): path for path in state}
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[native_of[name]]), name
    prompt = _prompt(config.text_config.vocab_size)
    torch.testing.assert_close(
        prefill_logits(options, weights, prompt), eager_logits(spec, reference, prompt)
    )


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=64),
            r"quantization\[0\] \(Q1\): .* groups of 32, bfloat16 scales, but text config "
            r"quantization_config has no such config group \(group_0: int4, groups of 64, bfloat16 scales\)",
        ),
        (  # the first MoE layer's experts left dense: Q1's glob covers them
            lambda qc: qc["ignore"].append(r"re:.*layers\.1\.mlp\.experts\..*"),
            r"quantization\[0\] \(Q1\): .* covers checkpoint tensor "
            r"language_model\.model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight and says it is int4 "
            r"pack-quantized, groups of 32, bfloat16 scales, but the text config quantization_config stores "
            r"it dense",
        ),
    ],
    ids=["group-size", "glob-covers-a-dense-tensor"],
)
def test_a_scheme_the_config_contradicts_is_an_error_at_apply(change, expected: str, tmp_path: Path) -> None:
    qc = json.loads(json.dumps(INT4))
    change(qc)
    with pytest.raises(KadaptError, match=expected) as raised:
        extract("kimi_k25", tmp_path / "ir", **{"text_config.quantization_config": qc})
    assert not list((tmp_path / "ir").glob("*.json"))  # stopped before anything is written
    # the spec's error, at the scheme: not a refusal (those are for models kadapt cannot describe)
    assert not isinstance(raised.value, Refusal)
    spec = load_spec(REPO / "specs" / "kimi_k25.yaml")
    assert raised.value.location == spec.locate("quantization[0]")


def test_apply_locates_a_scheme_the_config_contradicts(tmp_path: Path) -> None:
    """``kadapt apply`` as a user runs it, on a config that leaves layer 1's experts dense while Q1's
    glob covers them (plain ``validate`` compares parameters, so the weight map is what finds it): exit
    1 with the spec's file:line:col of ``quantization[0]``, no refusal, no traceback, nothing written."""
    ignore = r"re:.*layers\.1\.mlp\.experts\..*"
    spec = kimi_spec_with(tmp_path, lambda text: text["quantization_config"]["ignore"].append(ignore))
    line = next(i for i, text in enumerate(spec.read_text().splitlines(), 1) if text.startswith("  - id: Q1"))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["apply", str(spec), "--output-dir", str(out)])
    assert result.exit_code == 1, result.output
    tensor = "language_model.model.layers.1.mlp.experts.0.down_proj.weight"
    assert f"error: {spec}:{line}:5: quantization[0] (Q1): " in result.output
    assert f"covers checkpoint tensor {tensor}" in result.output
    assert "refused" not in result.output and "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)
    assert not out.exists() or not list(out.iterdir())


@pytest.mark.parametrize(
    ("change", "severity", "expected"),
    [
        (lambda text: None, None, None),
        (
            lambda text: text.pop("quantization_config"),
            "warning",
            "Q1 describes int4 storage, but the config has no quantization_config: extraction reads that "
            "checkpoint dense",
        ),
        (
            lambda text: text["quantization_config"]["config_groups"]["group_0"]["weights"].update(
                num_bits=8
            ),
            "error",
            "Q1: 'language_model.model.layers.*.mlp.experts.*' is int4 packed into int32 words, groups of "
            "32, bfloat16 scales, but text config quantization_config has no such config group (group_0: "
            "int8",
        ),
        (  # kadapt 0.1.0 ignored a scheme beside a quantization_config no scheme describes
            lambda text: text.update(quantization_config=FP8),
            "warning",
            "deprecated form, an error from kadapt 0.3.0: Q1 is int4 storage, but text config "
            "quantization_config has quant_method 'fp8' (int schemes describe compressed-tensors "
            "pack-quantized only)",
        ),
    ],
    ids=["agrees", "no-quantization-config", "bits", "fp8"],
)
def test_plain_validate_checks_the_schemes_against_the_config(
    change, severity: str | None, expected: str | None, tmp_path: Path
) -> None:
    """Torch-free: the shipped config's quantization_config against the spec's schemes, located at the
    scheme."""
    result = check_spec(kimi_spec_with(tmp_path, change))
    found = [d for d in result.errors + result.warnings if d.code in ("quantization", "deprecated")]
    if expected is None:
        assert found == []
        return
    [diag] = found
    assert diag.severity.value == severity and diag.breadcrumb == "quantization[0]"
    assert expected in diag.message
    assert diag.line == next(
        i
        for i, line in enumerate((tmp_path / "kimi_k25.yaml").read_text().splitlines(), 1)
        if line.startswith("  - id: Q1")
    )


# in reverse name order: test_user_outputs asks for the shared runs in name order, so when the two files run
# side by side (one per xdist worker) they meet on one spec's run at most instead of each waiting on the
# lock for the run the other is making, spec after spec
@pytest.mark.parametrize("name", EXTRACTABLE[::-1])
def test_ir_quantization_is_the_weight_map_entry(name: str, shipped_apply: SharedApplies) -> None:
    """For every shipped spec, in the files ``kadapt apply`` writes at full size (the shared run,
    ``shipped_apply``): each IR weight (text, and vision and the multimodal prefill when exported) is a
    weight map entry of the same shape and dtype, and carries a quantization block exactly when that
    entry's sources are stored quantized - naming the same tensors, storage and ops. The storage is the
    shipped config's."""
    result = shipped_apply(name)
    assert result.exit_code == 0, result.output
    [weight_map] = result.out.glob("*_weight_map.json")
    doc = json.loads(weight_map.read_text())
    raw = json.loads(load_spec(name).source.config.read_text())
    qc = raw.get("text_config", {}).get("quantization_config") or raw.get("quantization_config") or {}
    fp4_experts = {FP4_E2M1} if qc.get("expert_dtype") == "fp4" else set()  # DeepSeek-V4's routed experts
    assert _formats(doc) == FORMAT_OF[qc.get("quant_method")] | fp4_experts
    files = list(result.out.glob("*_ir.json"))
    assert len(files) >= 2
    for path in files:
        ir = json.loads(path.read_text())  # a full-size graph: parsed once, for both checks
        torch_ir.IR.from_dict(ir)  # pytorch-ir's loader (load_ir: json.loads, then this) reads it
        for weight in ir["weights"]:
            entry = doc["weights"][weight["name"]]
            assert (weight["shape"], weight["dtype"]) == (entry["shape"], entry["dtype"])
            stored = [g for g in entry["sources"] if "storage" in g]
            if not stored:
                assert "quantization" not in weight, weight["name"]
                continue
            quantization = weight["quantization"]
            assert quantization["weight_map"] == weight["name"] and quantization["ops"] == entry["ops"]
            assert [
                (s["first"], s["count"], s["shape"], s.get("storage")) for s in quantization["sources"]
            ] == [
                (g["tensors"][0], len(g["tensors"]), g["shape"], g.get("storage")) for g in entry["sources"]
            ]


@pytest.mark.slow
def test_apply_says_which_spec_scheme_a_dense_checkpoint_does_not_use(tmp_path: Path) -> None:
    """The full-size main job on a dense Kimi-K2.5 config: exit 0, a dense map, and the Q1 note on the
    notes channel (stderr) and in the JSON document, not only inside the weight map file."""
    spec = kimi_spec_with(tmp_path, lambda text: text.pop("quantization_config"))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["apply", str(spec), "--output-dir", str(out), "--format", "json"])
    assert result.exit_code == 0, result.output
    assert re.search(r"note: quantization\[0\] \(Q1, int4.*not applied", result.stderr)
    notes = json.loads(result.stdout)["extraction"]["notes"]
    assert [n for n in notes if n.startswith("quantization[0] (Q1") and "not applied" in n]
