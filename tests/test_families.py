"""Every shipped family end to end through ``kadapt apply --verify``, and families adapted from YAML alone.

Each shipped spec (discovered, so a new one is covered without editing this file) builds its full-size
model on meta, exports prefill/decode IR with the cache its attention really has, and ``--verify``
replays the saved JSON with torch_ir against transformers' ``generate()`` on a tiny random-weight model.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures.releases import skip_if_not_here
from fixtures.shared_apply import SharedApplies

from kimi_adapter_core.backends.extraction import options_from_spec, verify
from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.cli import cli
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.of_spec import structure_of_raw

REPO = Path(__file__).resolve().parents[1]
# The remote-code spec needs --trust-remote-code and a model dir: tests/test_remote_code.py covers it.
SHIPPED = sorted(p for p in (REPO / "specs").glob("*.yaml") if p.stem != "kimi_k25_remote")


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_every_family_kind_is_shipped() -> None:
    """The shipped specs cover MHA/GQA/MLA-style attention, dense and MoE, and sliding windows."""
    kinds = set()
    for path in SHIPPED:
        spec = load_spec(path)
        structure = structure_of_raw(spec, json.loads(spec.source.config.read_text()))
        kinds.add((structure.attention.kind, "moe" if structure.moe else "dense"))
        kinds.add("sliding" if structure.has_sliding_layers else "full")
    assert {("gqa", "dense"), ("gqa", "moe"), ("mla", "moe"), "sliding", "full"} <= kinds


@pytest.mark.slow
@pytest.mark.compat
@pytest.mark.parametrize(
    "spec_path", [pytest.param(p, id=p.stem, marks=skip_if_not_here(p)) for p in SHIPPED]
)
def test_full_size_apply_and_verify(spec_path: Path, shipped_apply: SharedApplies) -> None:
    spec = load_spec(spec_path)
    structure = structure_of_raw(spec, json.loads(spec.source.config.read_text()))
    # apply SPEC --output-dir OUT --verify --format json, run once for every test that reads it
    result = shipped_apply(spec_path.stem)
    out = result.out
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["verify"]["passed"], data["verify"]
    assert data["verify"]["tokens_ir"] == data["verify"]["tokens_reference"]
    assert len(data["verify"]["tokens_ir"][0]) == 25  # 1 prefill token + 24 decode steps
    assert data["model"]["layers"] == structure.num_layers
    assert data["model"]["experts"] == (structure.moe.num_experts if structure.moe else 0)
    assert data["ledger"]["counts"]["failed"] == 0

    mapping = json.loads(next(out.glob("*_kv_mapping.json")).read_text())
    layout = structure.attention.default_kv_layout
    assert mapping["kv_layout"] == layout and mapping["attention"] == structure.attention.kind
    key, value = runtime.kv_shapes(structure.attention.kv_dims(layout), 1, spec.abi.max_cache_len)
    assert len(mapping["layers"]) == structure.num_layers
    for layer, kind in zip(mapping["layers"], structure.layer_kinds, strict=True):
        if kind == "linear":  # a request's conv window and recurrent state, as the config sizes them
            assert structure.linear is not None
            conv, recurrent = structure.linear.conv_state, structure.linear.recurrent_state
            assert tuple(layer["decode_conv_input"]["shape"]) == (1, *conv.shape())
            assert tuple(layer["decode_recurrent_output"]["shape"]) == (1, *recurrent.shape())
            assert layer["decode_recurrent_output"]["dtype"] == recurrent.dtype
            continue
        if kind == "lightning":  # MiniMax: the recurrent state alone, in the ABI dtype
            assert structure.linear is not None
            recurrent = structure.linear.recurrent_state
            assert [k for k in layer if k.startswith(("prefill_", "decode_"))] == [
                "prefill_recurrent_output",
                "decode_recurrent_input",
                "decode_recurrent_output",
            ]
            assert tuple(layer["decode_recurrent_output"]["shape"]) == (1, *recurrent.shape())
            assert layer["decode_recurrent_output"]["dtype"] == recurrent.dtype_in(spec.abi.dtype)
            continue
        if kind in ("none", "shared"):  # no mixer (Nemotron-H's MLP blocks) or another layer's KV (Gemma-4)
            assert not [k for k in layer if k.startswith(("prefill_", "decode_"))], layer
            continue
        dims = structure.kv_dims(layer["layer"], layout)  # each layer its own shape (Gemma-4, MiMo)
        own_key, own_value = runtime.kv_shapes(dims, 1, spec.abi.max_cache_len)
        assert tuple(layer["decode_key_input"]["shape"]) == own_key
        assert tuple(layer["decode_value_output"]["shape"]) == own_value
        if structure.layer_kv_dims(layout) is None:
            assert (own_key, own_value) == (key, value)
        if kind == "indexed":  # the DSA indexer's keys: one head of the indexer's width, a slot per token
            assert structure.indexer is not None
            index_key = (1, 1, spec.abi.max_cache_len, structure.indexer.head_dim)
            assert tuple(layer["decode_index_key_input"]["shape"]) == index_key
        if kind in structure.compressors:  # DeepSeek-V4: an entry slot per closed window (its indexer's too)
            c = structure.compressors[kind]
            slots = spec.abi.max_cache_len // c.rate
            assert tuple(layer["decode_comp_input"]["shape"]) == (1, 1, slots, c.head_dim)
            assert tuple(layer["decode_comp_src_input"]["shape"]) == (
                1,
                1,
                c.overlap * c.rate,
                2 * c.overlap * c.head_dim,
            )
            if c.indexer is not None:
                assert tuple(layer["decode_index_comp_input"]["shape"]) == (1, 1, slots, c.indexer.head_dim)
    if structure.attention.kind == "gqa":  # per-layer K/V with the config's KV heads, not the query heads
        assert key == (
            1,
            structure.attention.num_kv_heads,
            spec.abi.max_cache_len,
            structure.attention.head_dim,
        )
    for kind in ("prefill", "decode"):
        graph = data["extraction"]["graphs"][kind]
        assert graph["layers"] == structure.num_layers
        document = json.loads(Path(graph["path"]).read_text())
        assert document["metadata"]["structure"]["attention"]["kind"] == structure.attention.kind


def test_non_mla_output_says_nothing_of_mla(tmp_path: Path) -> None:
    result = run("apply", str(REPO / "specs" / "llama.yaml"), "--output-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "MLA" not in result.output and "None experts" not in result.output
    assert "heads KV, GQA" in result.output and "GQA 32 heads / 8 KV heads x 128" in result.output


@pytest.mark.slow
def test_verify_catches_a_missing_sliding_window_mask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mistral's tiny model slides a window of 4 over an 8-token prompt: without the per-layer mask
    the wrappers are wrong (a full causal mask is what a naive ABI passes). The whole-model check
    refuses the export before it starts, and --verify on its own says so too."""
    monkeypatch.setattr(runtime, "sliding_window_mask", lambda mask, positions, window: mask)
    spec = load_spec(REPO / "specs" / "mistral.yaml")
    result = CliRunner().invoke(cli, ["apply", str(spec.path), "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 1 and not any((tmp_path / "out").iterdir())
    assert "refused (stack-differs):" in result.output and "at the decoder stack" in result.output
    report = verify(spec, options_from_spec(spec, output_dir=tmp_path / "verify"), echo=lambda line: None)
    assert not report.passed
    assert "prefill logits" in {check.name for check in report.checks if not check.passed}


# A family kadapt does not ship, adapted from YAML alone (the guide's procedure): Qwen3 dense with
# QK-norm and alternating sliding-window layers, and Mixtral (softmax top-2 MoE, no shared experts).
UNSHIPPED = {
    "qwen3": (
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 512,
            "max_position_embeddings": 4096,
            "use_sliding_window": True,
            "sliding_window": 64,
            "max_window_layers": 2,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
        },
        "",
    ),
    "mixtral": (
        {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "vocab_size": 512,
            "max_position_embeddings": 4096,
            "rope_theta": 1000000.0,
            "sliding_window": None,
        },
        """
        moe:
          moe_class: MixtralSparseMoeBlock
          num_experts_key: num_local_experts
        """,
    ),
}


def _unshipped_spec(tmp_path: Path, family: str) -> Path:
    config, extra = UNSHIPPED[family]
    (tmp_path / family).mkdir()
    (tmp_path / family / "config.json").write_text(json.dumps(config))
    bridges = [("X1", "_attn_implementation", "eager")]
    if "moe" in extra:
        bridges.append(("X2", "_experts_implementation", "batched_mm"))
    bridge_yaml = "".join(
        f"  - {{id: {i}, why: export needs it, op: set, path: {path}, value: {value}, "
        "backends: [extraction]}\n"
        for i, path, value in bridges
    )
    spec = tmp_path / f"{family}.yaml"
    spec.write_text(
        textwrap.dedent(
            f"""\
            apiVersion: kadapt/v1
            kind: AdapterSpec
            metadata: {{name: {family}}}
            gate: {{model_type: {family}}}
            source: {{config: {family}/config.json}}
            config_bridges:
            """
        )
        + bridge_yaml
        + textwrap.dedent(
            """\
            module_paths: {language_model: model, language_layers: model.layers, lm_head: lm_head}
            abi:
              batch: 1
              prefill_len: 16
              max_cache_len: 64
              dtype: float32
              prefill:
                inputs: [input_ids, attention_mask, position_ids]
                outputs: [logits, "k.{layer}", "v.{layer}"]
              decode:
                inputs: [input_ids, attention_mask, position_ids, cache_position, "pk.{layer}", "pv.{layer}"]
                outputs: [logits, "k.{layer}", "v.{layer}"]
            """
        )
        + textwrap.dedent(extra)
    )
    return spec


@pytest.mark.parametrize("family", sorted(UNSHIPPED))
def test_unshipped_family_from_yaml_alone(tmp_path: Path, family: str) -> None:
    spec_path = _unshipped_spec(tmp_path, family)
    assert run("validate", str(spec_path)).exit_code == 0
    result = run(
        "apply", str(spec_path), "--output-dir", str(tmp_path / "out"), "--verify", "--format", "json"
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["verify"]["passed"], data["verify"]
    mapping = json.loads((tmp_path / "out" / f"{family}_kv_mapping.json").read_text())
    assert mapping["layers"][0]["decode_key_input"]["shape"] == [1, 2, 64, 32]
    if family == "qwen3":  # layers from max_window_layers on slide; the tiny verify model keeps that
        assert mapping["sliding_windows"] == [None, None, 64, 64]
    if family == "mixtral":  # named as Mixtral checkpoints (and save_pretrained) name them
        weights = json.loads((tmp_path / "out" / "mixtral_weight_map.json").read_text())["weights"]
        fused = weights["model.layers.0.mlp.experts.gate_up_proj"]["sources"]
        assert [g["tensors"][0] for g in fused] == [
            "model.layers.0.block_sparse_moe.experts.0.w1.weight",
            "model.layers.0.block_sparse_moe.experts.0.w3.weight",
        ]
        assert len(fused[0]["tensors"]) == 8
        down = weights["model.layers.1.mlp.experts.down_proj"]["sources"][0]["tensors"]
        assert down[-1] == "model.layers.1.block_sparse_moe.experts.7.w2.weight"
        router = weights["model.layers.0.mlp.gate.weight"]["sources"][0]["tensors"]
        assert router == ["model.layers.0.block_sparse_moe.gate.weight"]
