"""``kadapt plan`` and ``kadapt simulate`` on DeepSeek sparse attention (issue 36 item 4): DeepSeek-V3.2,
DeepSeek-V3's published sizes with a 64 x 128 indexer picking each query's top-2048 keys in all 61 layers.

plan counts the indexer's weights (to the parameter, against transformers' own model built on meta) and
sizes its keys beside the latent KV cache (FP8 + an fp32 scale per 128 channels, growing with the
context, replicated over TP). simulate prices the indexer (its projections, the scoring of every visible
key, the top-k) and the attention over the top-k keys only: at a 64k context DSA decode attends to 2,048
latents where dense MLA reads 65,537, so it is far cheaper, while its indexer grows with the context.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator
from kimi_adapter_core.backends.simulation.estimate.planner import make_plan
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import load_spec

V3_CONFIG = REPO / "specs" / "deepseek_v3" / "config.json"
INDEX = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
SPEC = """\
apiVersion: kadapt/v1
kind: AdapterSpec
metadata:
  name: {name}
  model: deepseek-ai/DeepSeek-V3.2-Exp
  description: DeepSeek-V3.2 sizes for plan and simulate tests.
gate:
  model_type: {name}
source:
  config: {name}/config.json
module_paths:
  language_model: model
  language_layers: model.layers
  lm_head: lm_head
architecture:
  attention: mla
mla:
  attention_class: {prefix}Attention
moe:
  moe_class: {prefix}MoE
  experts_class: {prefix}Experts
  num_experts_key: n_routed_experts
  routing:
    scoring_func: sigmoid
    topk_method: noaux_tc
abi:
  batch: 1
  prefill_len: 128
  max_cache_len: 2048
  dtype: bfloat16
  prefill:
    inputs: [input_ids, attention_mask, position_ids]
    outputs: [logits, "present.{{layer}}.key", "present.{{layer}}.value"]
  decode:
    inputs: [input_ids, attention_mask, position_ids, cache_position, "past.{{layer}}.key",
      "past.{{layer}}.value"]
    outputs: [logits, "present.{{layer}}.key", "present.{{layer}}.value"]
"""
LAYERS = 61
KEY_BYTES = 128 + 4  # an FP8 key of 128 channels and its fp32 scale
LATENT_BYTES = (512 + 64) * 2  # the bf16 MLA latent of one token and layer


def _v32_config(**changes: Any) -> dict[str, Any]:
    """DeepSeek-V3's shipped config as DeepSeek-V3.2: the indexer sizes, every layer indexed."""
    config = json.loads(V3_CONFIG.read_text())
    config |= {"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], **INDEX}
    config["layer_types"] = ["indexed_attention"] * config["num_hidden_layers"]
    return {k: v for k, v in (config | changes).items() if v is not None}


def _write_spec(folder: Path, name: str, config: dict[str, Any]) -> Path:
    prefix = {"deepseek_v32": "DeepseekV32", "deepseek_v3": "DeepseekV3"}[name]
    (folder / name).mkdir(parents=True)
    (folder / name / "config.json").write_text(json.dumps(config))
    path = folder / f"{name}.yaml"
    path.write_text(SPEC.format(name=name, prefix=prefix))
    return path


@pytest.fixture(scope="module")
def dsa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_spec(tmp_path_factory.mktemp("dsa"), "deepseek_v32", _v32_config())


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model as dense MLA: DeepSeek-V3's config unchanged."""
    return _write_spec(tmp_path_factory.mktemp("dense"), "deepseek_v3", json.loads(V3_CONFIG.read_text()))


def _cli(*args: object) -> dict[str, Any]:
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _meta_model(config: Any) -> torch.nn.Module:
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32ForCausalLM

    with torch.device("meta"):
        return DeepseekV32ForCausalLM(config)


def test_plan_counts_every_tensor_transformers_builds(dsa: Path) -> None:
    """transformers' default DeepseekV32Config (DeepSeek-V3.2-Exp's sizes): the inventory names exactly
    the parameters it builds, indexer included; from the published-style config through the spec,
    ``plan`` equals its parameters plus the router's correction bias (a persistent buffer the
    checkpoint holds, 58 MoE layers x 256)."""
    from transformers import DeepseekV32Config

    from kimi_adapter_core.backends.simulation.model.params import Naming, text_groups
    from kimi_adapter_core.structure.derive import derive_structure

    default = DeepseekV32Config()
    theirs = {name: p.numel() for name, p in _meta_model(default).named_parameters()}
    groups = text_groups(derive_structure(default), Naming("model", "model.layers", "lm_head", ()))
    assert {name: n for g in groups for name, n in g.tensors()} == theirs
    assert sum(theirs.values()) == 671_877_929_216
    indexer = [name for name in theirs if ".indexer." in name]
    assert len(indexer) == 5 * LAYERS  # wq_b, wk, k_norm weight and bias, weights_proj

    model = _meta_model(DeepseekV32Config(**{k: v for k, v in _v32_config().items() if k != "model_type"}))
    parameters = sum(p.numel() for p in model.parameters())
    held = sum(t.numel() for t in model.state_dict().values())
    plan = _cli("plan", dsa, "--format", "json")["weights"]
    assert plan["total_params"] == held == parameters + 58 * 256
    by_group = {g["group"]: g for g in plan["groups"]}
    assert by_group["attn.indexer_proj"]["params"] == LAYERS * (64 * 128 * 1536 + 128 * 7168)
    assert by_group["attn.indexer_proj"]["format"] == "fp8/b128x128"  # FP8 blocks, as wq_b and wk ship
    assert by_group["attn.indexer_weights_proj"]["format"] == "bf16"
    assert by_group["attn.indexer_proj"]["shard"] == "replicated"
    k_norm = "model.layers.0.self_attn.indexer.k_norm.weight"
    assert by_group["attn.indexer_k_norm"]["checkpoint_name"] == k_norm


def test_per_token_state_holds_the_indexer_keys(dsa: Path) -> None:
    inputs = model_inputs(load_spec(dsa), None)
    short, long = (make_plan(inputs, Parallel(tp=8), batch=4, seq_len=n) for n in (4096, 65536))
    kv = short.kv
    assert kv.index is not None and kv.index.layers == LAYERS
    assert kv.index.bytes_per_token == LAYERS * KEY_BYTES == 8052
    assert kv.bytes_per_token == LAYERS * LATENT_BYTES == 70272
    for plan, tokens in ((short, 4096), (long, 65536)):  # latent and keys replicated on every rank
        assert plan.kv.sequence_bytes(tokens) == tokens * LAYERS * (LATENT_BYTES + KEY_BYTES)
        assert plan.memory.kv_cache == 4 * tokens * LAYERS * (LATENT_BYTES + KEY_BYTES)
    assert long.kv.index_bytes(65536) == 16 * short.kv.index_bytes(4096)  # grows with the context


def test_plan_states_the_indexer_keys_in_text_and_json(dsa: Path) -> None:
    text = CliRunner().invoke(cli, ["plan", str(dsa), "--tp", "8", "--seq-len", "4096"]).output
    assert "indexer keys: 61 indexed layers x 132 B per token, grows with context" in text
    assert "(256 B in transformers' bf16 reference)" in text
    assert "one sequence of 4096 tokens (KV + indexer keys): 0.321 GB" in text
    states = _cli("plan", dsa, "--tp", "8", "--seq-len", "4096", "--format", "json")["states"]
    keys = states["indexer_keys"]
    assert (keys["layers"], keys["grows_with_context"], keys["dtype"]) == (LAYERS, True, "fp8")
    assert keys["indexer"] == {"n_heads": 64, "head_dim": 128, "topk": 2048}
    assert keys["bytes_per_token_layer"] == keys["bytes_per_token_layer_per_device"] == KEY_BYTES
    assert keys["bytes_per_sequence"] == 4096 * LAYERS * KEY_BYTES
    kv_bytes = states["attention_kv"]["bytes_per_sequence"]
    assert states["bytes_per_sequence"] == kv_bytes + keys["bytes_per_sequence"]
    assert "linear_attention" not in states


def test_the_published_config_without_layer_types_is_every_layer_indexed(tmp_path: Path) -> None:
    """DeepSeek-V3.2-Exp's config.json lists no layer_types (DeepseekV32Config fills them in): every layer
    is a DSA layer; a config whose layer_types name none while it sizes an indexer (transformers builds
    one in every layer anyway) is refused rather than sized as dense MLA."""
    unlisted = _write_spec(tmp_path / "a", "deepseek_v32", _v32_config(layer_types=None))
    published = model_inputs(load_spec(unlisted), None)
    assert published.arch.structure.layer_kinds == ("indexed",) * LAYERS
    full = _v32_config(layer_types=["full_attention"] * LAYERS)
    with pytest.raises(KadaptError, match="sizes a DSA indexer .*names no indexed_attention layer"):
        model_inputs(load_spec(_write_spec(tmp_path / "b", "deepseek_v32", full)), None)


def _decode(spec: Path, context: int, *extra: object) -> dict[str, Any]:
    return _cli(
        "simulate", spec, "--device", "h200", "--tp", "8", "--ep", "8", "--batch", "8", "--decode",
        "--context-len", context, "--format", "json", *extra,
    )  # fmt: skip


def _ops(sim: dict[str, Any], name: str, scope: str = "moe") -> list[dict[str, Any]]:
    return [op for op in sim["ops"] if op["op"] == name and op["scope"] == scope]


def _seconds(sim: dict[str, Any], *names: str) -> float:
    return sum(op["time_s"] for op in sim["ops"] if op["op"] in names)


@pytest.fixture(scope="module")
def decodes(dsa: Path, dense: Path) -> dict[str, dict[str, Any]]:
    return {"short": _decode(dsa, 4096), "long": _decode(dsa, 65536), "dense_long": _decode(dense, 65536)}


def test_simulate_prices_the_indexer_and_the_sparse_attention(decodes: dict[str, dict[str, Any]]) -> None:
    long = decodes["long"]
    assert not [op for op in long["ops"] if op["op"] == "mla_decode_attention"]  # not priced as dense
    (sparse,) = _ops(long, "sparse_mla_decode")
    (logits,) = _ops(long, "indexer_logits")
    (topk,) = _ops(long, "indexer_topk")
    assert sparse["count"] == logits["count"] == topk["count"] == 58
    assert sparse["source"] == logits["source"] == "roofline"
    pairs = 8 * 16 * 2048  # per rank: 8 queries x 16 heads x their top-2048 latents
    assert sparse["flops"] == 58 * (2 * pairs * (512 + 64) + 2 * pairs * 512)
    scored = 8 * 65537  # every visible key scored by the 64 indexer heads of 128
    assert logits["flops"] == 58 * (2 * scored * 64 * 128 + 3 * scored * 64)
    projections = {op["module"] for op in long["ops"] if ".indexer." in op["module"] and op["scope"] == "moe"}
    parts = ("wq_b", "wk", "weights_proj", "k_norm")
    assert projections == {f"moe_layer.self_attn.indexer.{p}" for p in parts}
    assert long["states"]["indexer_keys"] == {
        "layers": LAYERS,
        "grows_with_context": True,
        "bytes_per_request_per_device": 65537 * LAYERS * KEY_BYTES,
    }


def test_dsa_decode_attends_to_the_top_k_while_its_indexer_grows(decodes: dict[str, dict[str, Any]]) -> None:
    short, long, dense = decodes["short"], decodes["long"], decodes["dense_long"]
    sparse = ("sparse_mla_decode",)
    indexer = ("indexer_logits", "indexer_topk")
    assert _seconds(long, *sparse) == _seconds(short, *sparse) > 0  # 2,048 latents at 4k and at 64k
    assert _seconds(long, *indexer) > 3 * _seconds(short, *indexer)
    dense_attention = _seconds(dense, "mla_decode_attention")
    assert dense_attention > 10 * _seconds(long, *sparse)
    assert dense_attention > 4 * (_seconds(long, *sparse) + _seconds(long, *indexer))
    assert long["step_time_s"] < dense["step_time_s"]


def test_prefill_runs_sparse_attention_on_long_prompts_and_masked_mha_on_short(dsa: Path) -> None:
    def prefill(tokens: int) -> dict[str, Any]:
        return _cli(
            "simulate", dsa, "--device", "h200", "--tp", "8", "--ep", "8", "--query-len", tokens,
            "--format", "json",
        )  # fmt: skip

    long, short = prefill(32768), prefill(4096)
    (sparse,) = _ops(long, "sparse_mla_prefill")
    selected = 2048 * 2049 // 2 + (32768 - 2048) * 2048  # each query's visible keys, capped at the top-k
    assert sparse["flops"] == 58 * 16 * (2 * selected * (512 + 64) + 2 * selected * 512)
    assert not _ops(long, "flash_attention_prefill")
    # 4k tokens: fewer FLOPs in DeepSeek's masked MHA mode (the dense prefill, the top-k as its mask)
    assert _ops(short, "flash_attention_prefill") and not _ops(short, "sparse_mla_prefill")
    (logits,) = _ops(short, "indexer_logits")
    assert logits["flops"] == 58 * (2 * 64 * 128 + 3 * 64) * (4096 * 4097 // 2)


@pytest.mark.skipif(not aiconfigurator.available(), reason="AIConfigurator's tables are not installed")
def test_measured_cost_model_reads_aiconfigurators_dsa_module(dsa: Path) -> None:
    sim = _decode(dsa, 4096, "--cost-model", "measured", "--framework", "sglang")
    source = "aiconfigurator:h200_sxm/sglang"
    (sparse,) = _ops(sim, "sparse_mla_decode")
    assert sparse["source"] == source and sparse["time_s"] > 0
    for name in ("indexer_logits", "indexer_topk"):  # inside the measured module row
        (op,) = _ops(sim, name)
        assert op["source"] == source and op["time_s"] == 0


def test_layers_reusing_a_top_k_attend_sparsely_without_scoring(tmp_path: Path) -> None:
    """GLM-5 with ``indexer_types`` making every other layer after the dense ones ``shared``: those
    layers attend over the last full layer's top-k (simulate's ``topk_reuse`` layers) and score nothing,
    so at a 64k context a decode step costs less than with every layer scoring its own keys; plan
    counts an indexer and its keys only for the layers that score."""
    glm5 = json.loads((REPO / "specs" / "glm5" / "config.json").read_text())
    layers = glm5["num_hidden_layers"]
    reusing = ["full" if i < 4 or i % 2 == 0 else "shared" for i in range(layers)]
    shared = reusing.count("shared")
    steps, plans = {}, {}
    for name, kinds in (("all_full", ["full"] * layers), ("reusing", reusing)):
        folder = tmp_path / name
        (folder / "glm5").mkdir(parents=True)
        (folder / "glm5" / "config.json").write_text(json.dumps(glm5 | {"indexer_types": kinds}))
        spec = folder / "glm5.yaml"
        spec.write_text((REPO / "specs" / "glm5.yaml").read_text())
        steps[name] = _cli(
            "simulate", spec, "--device", "h200", "--tp", "8", "--decode", "--batch", "16",
            "--context-len", "65536", "--format", "json",
        )  # fmt: skip
        plans[name] = _cli("plan", spec, "--format", "json")
    ops = steps["reusing"]["ops"]
    reuse = [op for op in ops if op["scope"] == "moe.topk_reuse"]
    assert {op["op"] for op in reuse} >= {"sparse_mla_decode"}
    assert not [op for op in reuse if op["op"].startswith("indexer") or ".indexer" in op["module"]]
    assert steps["reusing"]["step_time_s"] < steps["all_full"]["step_time_s"]
    groups = {name: {g["group"]: g for g in plan["weights"]["groups"]} for name, plan in plans.items()}
    for group in ("attn.indexer_proj", "attn.indexer_weights_proj"):
        per_layer = groups["all_full"][group]["params"] / layers
        assert groups["reusing"][group]["params"] == pytest.approx(per_layer * (layers - shared))


def test_an_fp8_latent_cache_is_sized_as_sparse_mla_runtimes_store_it(dsa: Path) -> None:
    """With an indexer, an FP8 latent is FlashMLA's sparse FP8 layout (vLLM's ``fp8_ds_mla``, 656 B a
    token): 512 fp8 latent channels, an fp32 scale per 128 of them and the 64-channel rope key in bf16.
    DeepSeek-V3 itself (no indexer) keeps the plain FP8 latent, 576 B."""
    sparse = _cli("plan", dsa, "--kv-dtype", "fp8", "--seq-len", "4096", "--format", "json")["kv_cache"]
    assert sparse["bytes_per_token_layer"] == 512 + 512 // 128 * 4 + 64 * 2 == 656
    assert sparse["bytes_per_token"] == LAYERS * 656
    plain = _cli("plan", REPO / "specs" / "deepseek_v3.yaml", "--kv-dtype", "fp8", "--format", "json")
    assert plain["kv_cache"]["bytes_per_token_layer"] == 576
    text = CliRunner().invoke(cli, ["plan", str(dsa), "--kv-dtype", "fp8", "--seq-len", "4096"]).output
    assert "656 B   (512 fp8 + an fp32 scale per 128 + 64 bf16 rope" in text


def test_sparse_attention_reads_the_fp8_latent_in_the_layout_the_plan_sizes(dsa: Path) -> None:
    """At --kv-dtype fp8 the sparse kernel gathers and writes 656-byte latents (the layout ``plan``
    sizes), not 576: against bf16 (1152 B) each of the 8 x 2048 selected keys and the 8 written tokens
    saves 1152 - 656 bytes a layer."""
    bf16, fp8 = (
        _ops(_decode(dsa, 65536, "--kv-dtype", dtype), "sparse_mla_decode")[0] for dtype in ("bf16", "fp8")
    )
    assert bf16["count"] == fp8["count"] == 58
    saved = (bf16["bytes"] - fp8["bytes"]) / 58
    assert saved == (8 * 2048 + 8) * (2 * (512 + 64) - 656)
