"""The one structural description every backend reads: derived right for each family, and every
contradiction between a spec and its config refused at the spec line, before any model is built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoConfig

from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.derive import derive_structure
from kimi_adapter_core.structure.of_spec import structure_of_config, structure_of_raw

REPO = Path(__file__).resolve().parents[1]


def shipped(name: str):
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    return structure_of_raw(spec, json.loads(spec.source.config.read_text()))


def test_qwen3_moe() -> None:
    s = shipped("qwen3_moe")
    assert (s.attention.kind, s.attention.num_heads, s.attention.num_kv_heads, s.attention.head_dim) == (
        "gqa",
        64,
        4,
        128,
    )
    assert s.moe is not None and (s.moe.num_experts, s.moe.top_k, s.moe.scoring) == (128, 8, "softmax")
    assert s.moe.normalize_top_k and s.moe.num_shared_experts == 0 and s.moe.expert_intermediate_size == 1536
    assert s.n_moe_layers == 94 and s.n_dense_layers == 0 and not s.has_sliding_layers
    assert s.attention.kv_dims("heads") == ((4, 128), (4, 128))


def test_deepseek_v3() -> None:
    s = shipped("deepseek_v3")
    assert s.attention.is_mla and s.attention.kv_dims("latent") == ((1, 512), (1, 64))
    assert s.attention.kv_dims("expanded") == ((128, 192), (128, 128))
    assert s.dense_layer_ids == (0, 1, 2) and s.n_moe_layers == 58
    assert s.moe is not None and (s.moe.scoring, s.moe.expert_groups, s.moe.top_k_groups) == ("sigmoid", 8, 4)
    assert s.moe.routed_scaling_factor == 2.5 and s.num_mtp_layers == 1 and s.rope.type == "yarn"


def test_dense_families() -> None:
    llama, mistral = shipped("llama"), shipped("mistral")
    assert llama.moe is None and llama.intermediate_size == 14336 and llama.rope.type == "llama3"
    assert llama.attention.describe() == "GQA 32 heads / 8 KV heads x 128" and not llama.has_sliding_layers
    assert mistral.windows == (4096,) * 32


@pytest.mark.parametrize(
    "name", sorted(p.stem for p in (REPO / "specs").glob("*.yaml") if p.stem != "kimi_k25_remote")
)
def test_raw_dict_and_transformers_config_agree(name: str) -> None:
    """plan reads the JSON (torch-free), apply reads transformers' normalized config: same structure
    (for every shipped spec: Gemma-3's layer pattern, which its config class builds, included)."""
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    raw = json.loads(spec.source.config.read_text())
    config = AutoConfig.for_model(**raw)
    assert structure_of_config(spec, config) == structure_of_raw(spec, raw)


def test_transformers_layer_types_decide_alternating_windows() -> None:
    from transformers import Qwen3Config

    config = Qwen3Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert derive_structure(config).windows == (None, None, 8, 8)
    assert derive_structure(config.to_dict()).windows == (None, None, 8, 8)  # what plan reads


def test_mqa_and_mha_kinds() -> None:
    base = {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 10, "num_attention_heads": 4}
    assert derive_structure({**base, "num_key_value_heads": 1}).attention.kind == "mqa"
    assert derive_structure(base).attention.kind == "mha"
    with pytest.raises(KadaptError, match="do not split into 3 KV heads"):
        derive_structure({**base, "num_key_value_heads": 3})


def test_math_outside_the_layers_is_modelled_from_the_config() -> None:
    """Gemma-2's final soft-capping, Cohere's logit scale, Granite's multipliers: data the wrappers apply,
    read from the config object and the raw JSON alike."""
    from transformers import CohereConfig, Gemma2Config, GraniteConfig

    gemma = derive_structure(Gemma2Config(num_hidden_layers=2))
    assert gemma.outside_ops("logits") == (("softcap", 30.0),) and gemma.outside_ops("embeddings") == ()
    cohere = CohereConfig(num_hidden_layers=2)
    assert derive_structure(cohere).outside_ops("logits") == (("mul", 0.0625),)
    assert derive_structure(cohere.to_dict()).outside == derive_structure(cohere).outside
    granite = derive_structure(
        GraniteConfig(num_hidden_layers=2, embedding_multiplier=12.0, logits_scaling=8.0)
    )
    assert granite.outside_ops("embeddings") == (("mul", 12.0),)
    assert granite.outside_ops("logits") == (("div", 8.0),)
    assert "embeddings x 12 (embedding_multiplier), logits / 8 (logits_scaling)" in granite.describe()
    assert derive_structure(GraniteConfig(num_hidden_layers=2)).outside == ()  # 1.0 means none


def test_feature_outside_the_layers_that_is_not_modelled_is_refused() -> None:
    refused = r"refused \(outside-layers\): .*use_bidirectional_attention = True"
    with pytest.raises(KadaptError, match=refused):
        derive_structure(
            {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 10, "num_attention_heads": 4,
             "use_bidirectional_attention": True}
        )  # fmt: skip


@pytest.fixture()
def llama_copy(tmp_path: Path):
    shutil.copytree(REPO / "specs" / "llama", tmp_path / "llama")

    def write(old: str, new: str) -> Path:
        text = (REPO / "specs" / "llama.yaml").read_text()
        assert old in text
        path = tmp_path / "llama.yaml"
        path.write_text(text.replace(old, new))
        return path

    return write


def _line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


@pytest.mark.parametrize(
    ("old", "new", "anchor", "message"),
    [
        (
            "architecture:\n  attention: gqa",
            "architecture:\n  attention: mha",
            "attention: mha",
            "architecture.attention is 'mha' but config describes GQA attention",
        ),
        (
            "architecture:\n  attention: gqa",
            "mla:\n  attention_class: LlamaAttention",
            "mla:",
            "the spec has an `mla` section but config has no multi-head latent attention",
        ),
        (
            "architecture:\n  attention: gqa",
            "moe:\n  moe_class: LlamaMLP\n  num_experts_key: num_experts",
            "num_experts_key",
            "moe.num_experts_key: 'num_experts' is not in llama/config.json",  # caught by validate already
        ),
        (
            "  dtype: bfloat16",
            "  dtype: bfloat16\n  kv_layout: latent",
            "kv_layout: latent",
            "kv_layout 'latent' does not fit this model's GQA attention",
        ),
    ],
)
def test_spec_contradicting_its_config_fails_before_any_build(
    llama_copy, old: str, new: str, anchor: str, message: str
) -> None:
    path = llama_copy(old, new)
    result = CliRunner().invoke(cli, ["apply", str(path), "--output-dir", str(path.parent / "out")])
    assert result.exit_code == 1, result.output
    assert message in result.output and f"{path}:{_line_of(path, anchor)}:" in result.output
    assert "building" not in result.output and "Traceback" not in result.output
    assert not (path.parent / "out").exists() or not any((path.parent / "out").iterdir())


def test_architecture_fields_name_a_key_the_table_lacks(llama_copy) -> None:
    spec = load_spec(
        llama_copy("architecture:\n  attention: gqa", "architecture:\n  fields: {vocab_size: n_vocab}")
    )
    raw = json.loads(spec.source.config.read_text())
    with pytest.raises(KadaptError, match=r"no vocab_size \(looked for: n_vocab\).*architecture.fields"):
        structure_of_raw(spec, raw)
    raw["n_vocab"] = 77
    assert structure_of_raw(spec, raw).vocab_size == 77


def test_validate_resolve_reports_every_unresolvable_name(tmp_path: Path) -> None:
    """`validate --resolve`: targets imported, config structure checked, a short model built on meta."""
    shutil.copytree(REPO / "specs" / "qwen3_moe", tmp_path / "qwen3_moe")
    text = (REPO / "specs" / "qwen3_moe.yaml").read_text()
    for old, new in [
        ("  language_layers: model.layers", "  language_layers: model.decoder_layers"),
        ("  gate_class: Qwen3MoeTopKRouter", "  gate_class: Qwen3MoeRouter"),
    ]:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "qwen3_moe.yaml"
    path.write_text(text)
    plain = CliRunner().invoke(cli, ["validate", str(path)])
    assert plain.exit_code == 0  # the YAML alone cannot know
    result = CliRunner().invoke(cli, ["validate", "--resolve", "--format", "json", str(path)])
    assert result.exit_code == 1, result.output
    found = {
        d["breadcrumb"] or d["message"].split(" ")[0]: d
        for d in json.loads(result.output)["files"][0]["diagnostics"]
    }
    assert found["moe.gate_class"]["line"] == _line_of(path, "gate_class: Qwen3MoeRouter")
    assert "close: Qwen3MoeTopKRouter" in found["moe.gate_class"]["message"]
    paths = [d for d in found.values() if "decoder_layers" in d["message"]]
    assert paths and paths[0]["line"] == _line_of(path, "language_layers:")


def test_validate_resolve_reports_a_missing_patch_target(llama_copy) -> None:
    path = llama_copy(
        "module_paths:",
        "patches:\n  - id: K9\n    why: test\n"
        "    target: transformers.models.llama.modeling_llama:LlamaAttention.expand_kv\n"
        "    kind: replace\n    impl: builtin:mla_expand_kv_functional\n\nmodule_paths:",
    )
    result = CliRunner().invoke(cli, ["validate", "--resolve", str(path)])
    assert result.exit_code == 1
    assert f"{path}:{_line_of(path, 'target: transformers.models.llama')}:" in result.output
    assert "LlamaAttention has no attribute 'expand_kv'" in result.output
