"""DeepSeek-V4's compressed sparse attention (issue 36): the ``csa`` layer kind, end to end.

A tiny random DeepSeek-V4 ``[sliding, csa, hca]`` (both rates 4, a Lightning indexer of 8 heads keeping the
top 2 entries), so the verify's prompt closes windows, its decode closes several more, and past the
third closed window the indexer's top-k decides which entries a query attends over. A csa layer keeps its
sliding K=V window, a ring of two windows of raw ``kv || gate`` (an entry mixes the previous window's
first series with its own second), its entries, and its indexer's ring and entries (``index_src``,
``index_comp``), kept by the pinned ``deepseek_v4_csa_compressor`` and ``deepseek_v4_indexer`` builtins.
kadapt's export verifies against transformers' own ``DeepseekV4CSACache`` at every step (every ring and
entry), rows joining, contiguous and paged, float32 and bfloat16; plan sizes the indexer
cache (it grows with the context) and counts the compressor's and indexer's tensors exactly; simulate
prices the indexer and the attention over the window and the top-k entries. transformers 5.23 has the
family too: the guide's pins list both releases' sources (``compat``: the export and verify run on both).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from fixtures.modules import import_path
from transformers import AutoConfig, AutoModelForCausalLM

from kimi_adapter_core.backends.extraction import options_from_spec, verify
from kimi_adapter_core.backends.simulation.model.census import census
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.serving_kernels import entry_pairs
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError, Refusal
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import module_paths, write_spec
from kimi_adapter_core.generate import render_spec
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.structure.derive import derive_structure

RATE, WINDOW, TOPK, INDEX_DIM = 4, 4, 2, 16
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def _config() -> dict[str, Any]:
    """The family matrix's tiny DeepSeek-V4 with a sliding, a csa and an hca layer of rate 4."""
    config = tiny_config("deepseek_v4")
    config.update(
        num_hidden_layers=3,
        layer_types=["sliding_attention", CSA, HCA],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        hc_mult=2,
        sliding_window=WINDOW,
        compress_rates={CSA: RATE, HCA: RATE},
        index_n_heads=8,
        index_head_dim=INDEX_DIM,
        index_topk=TOPK,
    )
    return config


def _spec(folder: Path, batch: int = 1, paged: bool = False) -> Spec:
    config = _config()
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    path = write_spec(folder, "deepseek_v4", config, module_paths(built))
    text = path.read_text().replace("batch: 1", f"batch: {batch}")
    pool = "dtype: float32\n  kv_cache: {kind: paged, block_size: 8}\n"
    path.write_text(text.replace("dtype: float32\n", pool) if paged else text)
    return load_spec(path)


@pytest.mark.compat
def test_the_structure_states_both_compressors() -> None:
    """csa layers slide and compress over two overlapping windows, with a Lightning indexer sized by the
    index_* keys; transformers' default V4 config (hca, then hca and csa alternating) derives; the legacy
    per-layer compress_ratios of a published config.json gives the same kinds and rates."""
    s = derive_structure(_config())
    assert s.layer_kinds == ("attention", "csa", "hca") and s.windows == (WINDOW,) * 3
    csa = s.compressors["csa"]
    assert (csa.rate, csa.head_dim, csa.overlap) == (RATE, 16, 2)
    assert csa.indexer is not None and (csa.indexer.head_dim, csa.indexer.topk) == (INDEX_DIM, TOPK)
    assert "1/3 compressed sparse layers (a compressor of every 4 tokens" in s.describe()
    assert "a Lightning indexer 8x16 top-2" in s.describe()
    default = derive_structure(AutoConfig.for_model("deepseek_v4"))
    assert default.layer_kinds[:5] == ("hca", "hca", "hca", "csa", "hca")
    assert {kind: c.rate for kind, c in default.compressors.items()} == {"hca": 128, "csa": 4}
    legacy = {key: value for key, value in _config().items() if key not in ("layer_types", "compress_rates")}
    legacy["compress_ratios"] = [0, 4, 128, 0]  # the last: the MTP layer, beyond num_hidden_layers
    found = derive_structure(legacy)
    assert found.layer_kinds == ("attention", "csa", "hca")
    assert {kind: c.rate for kind, c in found.compressors.items()} == {"hca": 128, "csa": 4}
    with pytest.raises(Refusal, match=r"compress_ratios holds \[64\]"):
        derive_structure({**legacy, "compress_ratios": [0, 64, 128]})
    without = {key: value for key, value in _config().items() if key != "index_topk"}
    with pytest.raises(Refusal, match="compressed_sparse_attention layers without index_topk"):
        derive_structure(without)


# bfloat16 on both releases: 5.23 builds the compressors' position_bias and kv_norm in the model's dtype
# where 5.24 builds them in float32, but both loaders keep them float32, as verify's reference does
@pytest.mark.parametrize(
    ("paged", "dtype"),
    [
        (False, "float32"),
        pytest.param(True, "float32", marks=pytest.mark.compat),
        pytest.param(False, "bfloat16", marks=pytest.mark.compat),
    ],
)
def test_kadapt_exports_and_verifies_every_ring_and_entry(tmp_path: Path, paged: bool, dtype: str) -> None:
    """kadapt's own export and verify, batch 2: prefill and 24 decode steps equal transformers' logits and
    generation, every returned state (both compressors' rings and entries) equals its DeepseekV4CSACache
    at every step, rows join a running batch; the state mapping names the indexer's ring and entries
    and states their contract."""
    spec = _spec(tmp_path, batch=2, paged=paged)
    out = tmp_path / "out"
    options = dataclasses.replace(options_from_spec(spec, output_dir=out), verify_dtypes=(dtype,))
    report = verify(spec, options, echo=lambda line: None, keep_in=out)
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    states = next(check.detail for check in report.checks if check.name.startswith("returned states"))
    assert "1 csa layers" in states and "index_src max" in states and "index_comp max" in states
    joining = next(check.detail for check in report.checks if check.name.startswith("joining rows"))
    assert "2 rows joining" in joining and ("paged" in joining) == paged
    mapping = json.loads((out / "deepseek_v4_kv_mapping.json").read_text())
    layer, capacity = mapping["layers"][1], mapping["max_cache_len"]
    assert layer["kind"] == "csa" and layer["compress_rate"] == RATE
    assert layer["decode_comp_src_input"]["shape"] == [2, 1, 2 * RATE, 4 * 16]
    assert layer["decode_index_src_input"]["shape"] == [2, 1, 2 * RATE, 4 * INDEX_DIM]
    assert layer["decode_index_comp_input"]["shape"] == [2, 1, capacity // RATE, INDEX_DIM]
    assert layer["prefill_index_comp_output"]["shape"] == [2, 1, 8 // RATE, INDEX_DIM]
    contract = mapping["contract"]["compressed"]
    assert contract["rates"] == {"csa": RATE, "hca": RATE}
    assert "top min(index_topk, max_cache_len / rate)" in contract["sparse"]["top_k"]


def test_an_abi_without_the_indexer_states_is_refused_before_export(tmp_path: Path) -> None:
    """A csa stack whose ABI names the compressor's ring and entries but not its indexer's is refused,
    naming the templates to add."""
    path = _spec(tmp_path).path
    text = path.read_text()
    for template in (', "is.{layer}", "ie.{layer}"', ', "pis.{layer}", "pie.{layer}"'):
        assert template in text
        text = text.replace(template, "")
    path.write_text(text)
    spec = load_spec(path)
    with pytest.raises(KadaptError, match=r'add "<present index_src \{layer\}>"'):
        verify(spec, options_from_spec(spec, output_dir=tmp_path / "out"), echo=lambda line: None)


def test_plan_sizes_the_indexer_cache_and_counts_every_tensor(tmp_path: Path) -> None:
    """Every tensor of the built model in plan's inventory (the csa compressor's two-series projections,
    its indexer's compressor, query projection and head weights); one sequence keeps floor(T / rate)
    entries and indexer keys per csa layer beside a two-window ring of each."""
    spec = _spec(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**_config()))
    inputs = model_inputs(spec, None)
    assert census(inputs.groups, inputs.naming, model).problems() == []
    names = {group.name: group for group in inputs.groups}
    assert names["attn.csa_compressor.projections"].tensor_shapes == ((32, 64), (32, 64))
    assert names["attn.csa_compressor.indexer.q_b_proj"].tensor_shapes == ((8 * INDEX_DIM, 32),)
    assert names["attn.csa_compressor.indexer.position_bias"].dtype == "fp32"
    result = CliRunner().invoke(cli, ["plan", str(spec.path), "--seq-len", "256", "--format", "json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output[result.output.index("{") :])
    entries = plan["states"]["compressed_entries"]
    csa = entries["kinds"]["csa"]
    assert csa["layer_ids"] == [1] and csa["entries_per_sequence"] == 256 // RATE
    assert csa["index_entry_shape"] == [INDEX_DIM] and csa["ring_shape"] == [2 * RATE, 4 * 16]
    # bf16: csa 64 x (16 + 16) + a ring of 8 x 4 x (16 + 16); hca 64 x 16 + a ring of 4 x 2 x 16
    assert entries["bytes_per_sequence"] == (64 * 32 + 8 * 4 * 32 + 64 * 16 + 4 * 2 * 16) * 2


def _ops(spec: Spec, *args: str) -> list[dict[str, Any]]:
    command = ["simulate", str(spec.path), "--device", "h200", *args, "--format", "json"]
    result = CliRunner().invoke(cli, command)
    assert result.exit_code == 0, result.output
    return json.loads(result.output[result.output.index("{") :])["ops"]


def test_simulate_prices_the_indexer_and_the_top_k_entries(tmp_path: Path) -> None:
    """Decode at context 200: the sliding layer reads its 4 keys, the hca layer 4 plus the 50 entries
    closed by then, the csa layer 4 plus its top 2; its indexer scores the 50 entries with 8 heads of 16
    (q.k, then relu, weight and sum per head) and takes their top-k, priced by roofline."""
    ops = _ops(_spec(tmp_path), "--decode", "--context-len", "200")
    attention = sum(op["flops"] for op in ops if op["op"] == "attention_decode")
    assert attention == 4 * 2 * 2 * 16 * (WINDOW + (WINDOW + 201 // RATE) + (WINDOW + TOPK))
    logits = next(op for op in ops if op["op"] == "csa_indexer_logits")
    assert logits["flops"] == 2 * 50 * 8 * INDEX_DIM + 3 * 50 * 8 and logits["source"] == "roofline"
    assert next(op for op in ops if op["op"] == "csa_indexer_topk")["flops"] == 50


def test_prefill_entry_pairs_are_capped_by_the_top_k() -> None:
    """A prefill query at p sees min((p + 1) // rate, top-k) entries: 16 queries of rate 4 and top-2 see
    0,0,0,1,1,1,1,2,2,... (3 x 0 + 4 x 1 + 9 x 2)."""
    assert entry_pairs(0, 16, 4, 2) == 4 + 9 * 2
    assert entry_pairs(0, 16, 4) == sum((p + 1) // 4 for p in range(16))
    assert entry_pairs(5, 11, 4, 2) == sum(min((p + 1) // 4, 2) for p in range(5, 16))


def test_generate_carries_the_compressed_sparse_layers(tmp_path: Path) -> None:
    """The generated extraction module carries the csa layers beside the hca one: each kind and rate,
    and the indexer's key width, which its config readers read as kadapt's structure does."""
    files, notes = render_spec(_spec(tmp_path), ["extraction"], skip_inexpressible=True)
    assert notes == []
    path = tmp_path / "extraction.py"
    path.write_text(next(item.text for item in files if item.path.name == "extraction.py"))
    module = import_path(path, "generated_deepseek_v4_csa")
    assert module.LAYER_KINDS == module.layer_kinds(module.SOURCE_CONFIG) == ("attention", "csa", "hca")
    assert module.COMPRESS_RATES == module.compress_rates(module.SOURCE_CONFIG) == {"csa": RATE, "hca": RATE}
    assert module.INDEX_DIM == module.index_dim(module.SOURCE_CONFIG) == INDEX_DIM


@pytest.mark.compat
def test_compressed_layers_stitch_reading_their_own_rotary_tables(tmp_path: Path) -> None:
    """Each compressor holds its own rotary table (a non-persistent buffer): copies of a compressed layer
    read their own layer's (stitching would otherwise fall back to tracing all 43 layers of the Flash
    model, minutes instead of seconds). Five layers, the last two copies of the csa and hca layers: export
    and verify equal transformers, every ring and entry too."""
    spec = _spec(tmp_path, batch=2)
    out = tmp_path / "out"
    overrides = {
        "num_hidden_layers": 5,
        "layer_types": ["sliding_attention", CSA, HCA, CSA, HCA],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe", "moe"],
    }
    options = dataclasses.replace(
        options_from_spec(spec, output_dir=out), verify_dtypes=("float32",), verify_overrides=overrides
    )
    report = verify(spec, options, echo=lambda line: None, keep_in=out)
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    for graph in ("prefill", "decode"):
        document = json.loads((out / f"deepseek_v4_{graph}_ir.json").read_text())
        assert document["metadata"]["stitching"] == {"traced_layers": 3, "replicated_from": {"3": 1, "4": 2}}
        tables = [name for name in document["constants"] if "compressor" in name and "inv_freq" in name]
        assert {name.split(".")[2] for name in tables} == {"1", "2", "3", "4"}  # each layer its own
