"""``kadapt plan``: the planner's figures for Kimi-K2.5 against numbers worked out by hand here
(other families: ``test_simulation_families.py``)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from fixtures.spec_files import KIMI_SPEC, kimi_spec_with

from kimi_adapter_core.backends.simulation.estimate.planner import make_plan
from kimi_adapter_core.backends.simulation.model.arch import spec_architecture
from kimi_adapter_core.backends.simulation.model.inputs import ModelInputs, model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.tables.device import get_device, load_device_file
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.vision.images import image_batch

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "specs" / "kimi_k25.yaml"
# every shipped spec whose config is local (the remote-code one needs --trust-remote-code)
SHIPPED_SPECS = tuple(sorted(p.stem for p in (REPO / "specs").glob("*.yaml") if p.stem != "kimi_k25_remote"))


@pytest.fixture(scope="module")
def spec_path() -> Path:
    return SHIPPED


@pytest.fixture(scope="module")
def spec() -> Spec:
    return KIMI_SPEC


@functools.cache
def kimi_inputs(quant: str | None) -> ModelInputs:
    """The shipped Kimi spec's inputs, built once per ``quant``: a fresh build re-checks the storage of
    each of the 384 experts of every routed-experts tensor (its policy's memo is per build)."""
    return model_inputs(KIMI_SPEC, quant)


def plan(spec: Spec, quant: str | None = None, **kwargs):  # noqa: ANN201 - a Plan
    inputs = kimi_inputs(quant) if spec is KIMI_SPEC else model_inputs(spec, quant)
    par = Parallel(kwargs.pop("tp", 1), kwargs.pop("dp", 1), kwargs.pop("ep", 1))
    return make_plan(inputs, par, **kwargs)


def test_architecture_summary(spec: Spec) -> None:
    arch = spec_architecture(spec)
    s = arch.structure
    assert (s.num_layers, s.hidden_size, s.attention.num_heads, s.vocab_size) == (61, 7168, 64, 163840)
    assert s.attention.is_mla and s.moe is not None
    assert (s.n_dense_layers, s.n_moe_layers, s.moe.num_experts, s.moe.top_k) == (1, 60, 384, 8)
    assert arch.model_type == "kimi_k25"  # the root's, not the text sub-config's kimi_k2
    v = arch.vision
    assert v is not None and (v.hidden, v.num_layers, v.merge_h, v.text_hidden) == (1152, 27, 2, 7168)


def test_kv_cache_bytes(spec: Spec) -> None:
    p = plan(spec)
    assert p.kv.layout == "latent"
    assert p.kv.bytes_per_token_layer == (512 + 64) * 2 == 1152  # kv_lora + rope, bf16
    assert p.kv.layouts() == {"latent": 1152, "expanded": 64 * (192 + 128) * 2}  # H x (qk + v), bf16
    assert round(p.kv.layouts()["expanded"] / 1152, 1) == 35.6
    assert p.kv.bytes_per_token == 1152 * 61
    assert plan(spec, tp=8, ep=8).kv.rank_bytes_per_token_layer == 1152  # the latent is replicated over TP
    assert plan(spec, kv_dtype="fp8").kv.bytes_per_token_layer == 576


def test_max_seq_len(spec: Spec) -> None:
    assert plan(spec).max_seq_len == 262144
    assert plan(spec, seq_len=4096).seq_len == 4096
    with pytest.raises(KadaptError, match="exceeds"):
        plan(spec, seq_len=262145)


def test_parameter_count_from_first_principles(spec: Spec) -> None:
    h, v, layers, moe_layers = 7168, 163840, 61, 60
    attention = (
        h * 1536
        + 1536  # q_a_proj + q_a_layernorm
        + 1536 * 64 * 192  # q_b_proj: heads x (nope 128 + rope 64)
        + h * (512 + 64)
        + 512  # kv_a_proj_with_mqa + kv_a_layernorm
        + 512 * 64 * (128 + 128)  # kv_b_proj: heads x (nope + v)
        + 64 * 128 * h  # o_proj
        + 2 * h
    )  # input / post-attention RMSNorm
    expert = 3 * h * 2048  # gate, up, down
    text = (
        2 * v * h
        + h  # embed_tokens + lm_head (untied) + final norm
        + layers * attention
        + 1 * 3 * h * 18432  # the one dense MLP layer
        + moe_layers * (384 * h + 384 + expert + 384 * expert)
    )  # router + bias + shared + routed
    p = plan(spec)
    vision = sum(w.params for w in p.weights if w.group.name.startswith(("vision", "projector")))
    assert p.total_params - vision == text
    assert 1.0e12 < p.total_params < 1.1e12  # "1T parameters"
    assert 0.4e9 < vision < 0.5e9  # MoonViT-400M + projector
    routed = 60 * 384 * expert
    assert p.active_params == p.total_params - routed + routed * 8 // 384  # top-8 of 384 experts
    assert 32e9 < p.active_params - vision < 33e9  # "32B activated"


def test_checkpoint_names_follow_the_spec(spec: Spec) -> None:
    """module_paths + backends.extraction.weight_renames, applied to the model's own parameter names."""
    groups = {g.name: g for g in model_inputs(spec, None).groups}
    assert groups["embed_tokens"].checkpoint_name == "language_model.model.embed_tokens.weight"
    assert groups["lm_head"].checkpoint_name == "language_model.lm_head.weight"
    assert groups["attn.q_a_proj"].checkpoint_names[60] == (
        "language_model.model.layers.60.self_attn.q_a_proj.weight",
    )
    assert groups["routed_experts"].checkpoint_names[0] == (
        "language_model.model.layers.1.mlp.experts.gate_up_proj",
        "language_model.model.layers.1.mlp.experts.down_proj",
    )
    assert (
        groups["router_bias"].checkpoint_name
        == "language_model.model.layers.1.mlp.gate.e_score_correction_bias"
    )


def test_weight_bytes_follow_the_config_quantization(spec: Spec) -> None:
    """The shipped config's quantization_config (compressed-tensors int4, group 32) sizes the experts;
    the spec's Q1 claims the same and holds, so nothing is noted."""
    p = plan(spec)
    assert not [w for w in p.warnings if "quantization" in w]
    routed = next(w for w in p.weights if w.group.name == "routed_experts")
    assert routed.format == "int4/g32" and routed.params == routed.group.count  # Q1 matches every expert
    per_param = 4 / 8 + 2 / 32  # int4 payload + one bf16 scale per 32 weights
    assert routed.total_bytes == pytest.approx(60 * 384 * 3 * 7168 * 2048 * per_param)
    assert {w.format for w in p.weights if w.group.name != "routed_experts"} <= {"bf16", "fp32"}
    assert 550e9 < p.weight_bytes < 650e9  # the published checkpoint is ~595 GB


def test_weights_split_per_device(spec: Spec) -> None:
    one, tp8 = plan(spec), plan(spec, tp=8, ep=8)
    assert tp8.memory.weights < one.memory.weights
    routed = next(w for w in tp8.weights if w.group.name == "routed_experts")
    assert routed.params_per_device == routed.group.count // 8
    q_a = next(w for w in tp8.weights if w.group.name == "attn.q_a_proj")
    assert q_a.params_per_device == q_a.group.count  # latent projections are replicated under TP
    embed = next(w for w in tp8.weights if w.group.name == "embed_tokens")
    assert embed.params_per_device == 163840 // 8 * 7168  # vocab-parallel


def test_vision_cache_entry(spec: Spec) -> None:
    assert plan(spec).vision_cache_entry_bytes == 64 * 64 // 4 * 7168 * 2 == 14_680_064


def test_vision_cache_for_a_batch_of_images(spec: Spec) -> None:
    """--batch sequences x --images images: the features each device's DP group keeps."""
    images = image_batch(spec, spec_architecture(spec).vision, 2, (896, 448))  # 64x32 patches -> 512 tokens
    assert (images.grid, images.tokens_per_image) == ((64, 32), 512)
    assert images.feature_bytes_per_image == 512 * 7168 * 2
    p = plan(spec, tp=4, dp=2, batch=6, images=images)
    assert p.memory.vision_cache == 3 * 2 * 512 * 7168 * 2  # 3 sequences per DP group, 2 images each
    assert p.memory.used == pytest.approx(
        p.memory.weights + p.memory.kv_cache + p.memory.activations + p.memory.vision_cache
    )
    assert plan(spec, tp=4, dp=2, batch=6).memory.vision_cache == 0
    assert not p.warnings
    large = plan(spec, images=image_batch(spec, spec_architecture(spec).vision, 1, (1792, 1792)))
    assert any("fills 4096 tokens, more than the 1024" in w for w in large.warnings)


def test_quant_mode_reformats_linear_weights(spec: Spec) -> None:
    bf16, w8 = plan(spec, "BF16"), plan(spec, "W8A8")
    assert bf16.weight_bytes == pytest.approx(2 * bf16.total_params, rel=1e-6)
    assert w8.weight_bytes < bf16.weight_bytes / 1.9
    with pytest.raises(KadaptError, match="BF16, W8A8, W4A8, W4A16"):
        plan(spec, "FP4")


def _dense(text: dict[str, Any]) -> None:
    text.pop("quantization_config")


def test_a_dense_config_sizes_bf16_experts_and_says_why(spec: Spec, tmp_path: Path) -> None:
    """Kimi-K2.5's spec claims int4 experts (Q1) but a config without quantization_config is a dense
    checkpoint, as extraction reads it: plan sizes the experts bf16 and notes that Q1 was not applied.
    Every other weight is sized as for the shipped checkpoint."""
    shipped, dense = plan(spec), plan(load_spec(kimi_spec_with(tmp_path, _dense)))
    routed = next(w for w in dense.weights if w.group.name == "routed_experts")
    assert routed.format == "bf16" and routed.total_bytes == 2 * routed.params == 2 * routed.group.count
    others = [
        (w.group.name, w.format, w.total_bytes) for w in dense.weights if w.group.name != "routed_experts"
    ]
    assert others == [
        (w.group.name, w.format, w.total_bytes) for w in shipped.weights if w.group.name != "routed_experts"
    ]
    [note] = [w for w in dense.warnings if "quantization" in w]
    assert note.startswith("quantization[0] (Q1, int4") and "the config has no quantization_config" in note


def test_a_weight_mode_ignores_the_checkpoint_storage(spec: Spec, tmp_path: Path) -> None:
    """--quant re-formats every text linear weight whatever the checkpoint stores: the same figures for
    the dense and the int4 checkpoint, W4 modes in the group size of the spec's Q1, and no note about
    a checkpoint the mode replaces."""
    dense = load_spec(kimi_spec_with(tmp_path, _dense))
    for mode in ("W4A16", "BF16"):
        from_dense, from_int4 = plan(dense, mode), plan(spec, mode)
        assert [(w.format, w.total_bytes) for w in from_dense.weights] == [
            (w.format, w.total_bytes) for w in from_int4.weights
        ]
        assert not [w for w in from_dense.warnings if "quantization" in w]
    routed = next(w for w in plan(dense, "W4A16").weights if w.group.name == "routed_experts")
    assert routed.format == "int4/g32 (W4A16)"


def test_cli_plan_of_a_dense_config(tmp_path: Path) -> None:
    out = CliRunner().invoke(cli, ["plan", str(kimi_spec_with(tmp_path, _dense)), "--format", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    routed = next(g for g in data["weights"]["groups"] if g["group"] == "routed_experts")
    assert routed["format"] == "bf16" and set(data["weights"]["bytes_by_format"]) == {"bf16", "fp32"}
    assert [w for w in data["warnings"] if w.startswith("quantization[0] (Q1, int4") and "not applied" in w]


def test_a_scheme_covering_a_tensor_the_config_stores_dense_is_located(tmp_path: Path) -> None:
    """The config leaves layer 1's experts dense; Q1's glob covers them: plan fails with the located
    error ``apply`` gives, at Q1's line (plain ``validate`` compares parameters only, not tensors)."""
    ignore = r"re:.*layers\.1\.mlp\.experts\..*"
    path = kimi_spec_with(tmp_path, lambda text: text["quantization_config"]["ignore"].append(ignore))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.startswith("  - id: Q1"))
    with pytest.raises(KadaptError) as raised:
        plan(load_spec(path))
    assert raised.value.location == f"{path}:{line}:5"
    tensor = "language_model.model.layers.1.mlp.experts.0.gate_proj.weight"
    assert f"covers checkpoint tensor {tensor}" in raised.value.message
    assert raised.value.message.endswith(
        "stores it dense (stored as is); the config decides what is read: fix the scheme (or the config)"
    )
    result = CliRunner().invoke(cli, ["plan", str(path)])
    assert result.exit_code == 1 and f"error: {path}:{line}:5: quantization[0] (Q1)" in result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output


def test_experts_stored_in_two_formats_are_an_error(tmp_path: Path) -> None:
    """One stacked experts tensor has one size per weight: a config that leaves one expert of a layer
    dense and quantizes the rest cannot be sized (the weight map refuses it too). Without Q1, whose
    claim would fail first."""
    path = kimi_spec_with(
        tmp_path,
        lambda text: text["quantization_config"]["ignore"].append(r"re:.*layers\.1\.mlp\.experts\.0\."),
    )
    raw = yaml.safe_load(path.read_text())
    del raw["quantization"]
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(
        KadaptError,
        match="stores the experts of language_model.model.layers.1.mlp.experts."
        r"gate_up_proj in different formats \(bf16, int4/g32\)",
    ):
        plan(load_spec(path))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tp": 3}, "does not divide the 64 attention heads"),
        ({"ep": 5, "dp": 5}, "does not divide the 384 routed experts"),
        ({"tp": 2, "ep": 4}, "does not divide the 2 devices"),
        ({"dp": 2, "batch": 3}, "does not split evenly"),
    ],
)
def test_bad_parallel_sizes(spec: Spec, kwargs: dict, message: str) -> None:
    with pytest.raises(KadaptError, match=message):
        plan(spec, **kwargs)


def test_memory_overflow_is_a_warning(spec: Spec) -> None:
    p = plan(spec, device=get_device("a100"))
    assert p.memory.free is not None and p.memory.free < 0
    assert p.warnings and "does not fit" in p.warnings[0]


def test_device_profiles_validate(tmp_path: Path) -> None:
    for name in ("h100", "h200", "a100", "atlas_800_a3", "h800"):
        assert get_device(name).memory_bytes > 0
    with pytest.raises(KadaptError, match="known devices: .*h200"):
        get_device("tpu9")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmemory: {size_gb: -1}\n", encoding="utf-8")
    with pytest.raises(KadaptError, match="invalid"):
        load_device_file(bad)


def test_cli_plan_text_and_json(spec_path: Path) -> None:
    runner = CliRunner()
    text = runner.invoke(cli, ["plan", str(spec_path), "--tp", "8", "--ep", "8", "--device", "h200"])
    assert text.exit_code == 0, text.output
    assert "1152 B" in text.output and "35.6x" in text.output and "free" in text.output
    assert "MLA 64 heads, kv_lora_rank 512" in text.output  # the structure's description
    out = runner.invoke(cli, ["plan", str(spec_path), "--format", "json"])
    assert out.exit_code == 0
    data = json.loads(out.output)
    assert data["kv_cache"]["bytes_per_token_layer"] == 1152 and data["kv_cache"]["layout"] == "latent"
    assert data["architecture"]["structure"]["attention"]["kind"] == "mla"
    assert data["vision_cache_entry_bytes"] == 14_680_064


def test_cli_plan_vision_cache_per_image_and_batch(spec_path: Path) -> None:
    args = ["plan", str(spec_path), "--tp", "4", "--dp", "2", "--batch", "4", "--images", "3"]
    out = CliRunner().invoke(cli, [*args, "--image-size", "896x896", "--format", "json"])
    assert out.exit_code == 0, out.output
    cache = json.loads(out.stdout)["vision_cache"]
    per_image = 1024 * 7168 * 2
    assert (cache["entry_bytes"], cache["max_tokens_per_image"]) == (14_680_064, 1024)
    images = cache["images"]
    assert (images["image_size"], images["tokens_per_image"], images["feature_bytes_per_image"]) == (
        [896, 896],
        1024,
        per_image,
    )
    assert (images["images"], images["batch_bytes"], images["batch_entry_bytes"]) == (
        12,
        12 * per_image,
        12 * 14_680_064,
    )
    assert (images["images_per_device"], images["batch_bytes_per_device"]) == (6, 6 * per_image)
    assert json.loads(out.stdout)["memory_per_device"]["vision_cache_bytes"] == 6 * per_image
    text = CliRunner().invoke(cli, args)  # the spec's abi.vision image: 448x448, 256 tokens
    assert text.exit_code == 0, text.output
    assert "one 448x448 image         3.5 MiB   32x32 patches of 14 px -> 256 tokens" in text.output
    assert "batch                    42.0 MiB   12 images (4 sequences x 3)" in text.output
    assert "per device               21.0 MiB   6 images" in text.output
    assert "entry per image          14.0 MiB" in text.output


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--tp", "3"], 2, "attention heads"),
        (["--quant", "FP4"], 2, "not declared"),
        (["--device", "tpu9"], 2, "known devices"),
    ],
)
def test_cli_plan_errors(spec_path: Path, args: list[str], code: int, message: str) -> None:
    result = CliRunner().invoke(cli, ["plan", str(spec_path), *args])
    assert result.exit_code == code
    assert message in result.output


def test_cli_plan_memory_warning_exits_zero(spec_path: Path) -> None:
    result = CliRunner().invoke(cli, ["plan", str(spec_path), "--device", "a100"])
    assert result.exit_code == 0 and "WARNING: memory does not fit" in result.output


def test_plan_never_imports_torch() -> None:
    paths = [str(REPO / "specs" / f"{name}.yaml") for name in SHIPPED_SPECS]
    code = (
        "import sys\nfrom click.testing import CliRunner\nfrom kimi_adapter_core.cli import cli\n"
        f"for path in {paths!r}:\n"
        "    r = CliRunner().invoke(cli, ['plan', path, '--format', 'json'])\n"
        "    assert r.exit_code == 0, r.output\n"
        f"r = CliRunner().invoke(cli, ['plan', {str(SHIPPED)!r}, '--images', '2', '--image-size', '56x28'])\n"
        "assert r.exit_code == 0, r.output\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["deepseek_v4_flash", "deepseek_v3", "llama"])
def test_a_key_that_is_also_the_value_is_sized_once_for_a_runtime(name: str) -> None:
    """DeepSeek-V4's one KV head is key and value: the ABI still caches both (its states), and plan
    says what a runtime caching it once needs - half, the key alone; no other attention gets the line."""
    result = CliRunner().invoke(cli, ["plan", str(REPO / "specs" / f"{name}.yaml"), "--format", "json"])
    assert result.exit_code == 0, result.output
    kv = json.loads(result.output)["kv_cache"]
    text = CliRunner().invoke(cli, ["plan", str(REPO / "specs" / f"{name}.yaml")]).output
    if name != "deepseek_v4_flash":
        assert "bytes_per_token_value_is_key" not in kv and "shared key/value head" not in text
        return
    assert kv["bytes_per_token"] == 43 * (512 + 512) * 2
    assert kv["bytes_per_token_value_is_key"] == 43 * 512 * 2
    assert f"a runtime storing it once needs {43 * 512 * 2} B per token" in text
