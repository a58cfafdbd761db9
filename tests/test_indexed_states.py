"""DeepSeek sparse attention (issue 36): a DSA layer's indexer keeps keys of its own beside the KV cache.

Each query attends only to the top-k keys its indexer scores highest, so the indexer keys are state a
runtime must carry exactly like a key: placed, written per row at each row's position, masked, paged.
The wrappers return them; on a tiny random DeepSeek-V3.2 (top-4 of up to 32 visible keys, so the
selection decides every step) they equal transformers' own cache step by step, a graph that loses the
selection fails ``--verify``, and what kadapt cannot carry is refused with its reason.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV32Config, DynamicCache

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction import options_from_spec, verify
from kimi_adapter_core.backends.extraction.equivalence import roundtrip
from kimi_adapter_core.backends.extraction.options import bind_structure
from kimi_adapter_core.backends.extraction.runtime import abi
from kimi_adapter_core.errors import KadaptError, Refusal
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.derive import derive_structure

TOPK = 4


def tiny_dsa() -> Any:
    config = DeepseekV32Config(
        **{k: v for k, v in tiny_config("deepseek_v32").items() if k != "model_type"},
    )
    config.index_topk, config.index_n_heads, config._attn_implementation = TOPK, 8, "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.2 if parameter.dim() > 1 else 0.5)
    return model


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_the_indexer_keys_are_carried_as_transformers_carries_them(paged: bool) -> None:
    """Prefill and 20 decode steps (the visible keys grow past 4x the top-k): logits, the latent KV and
    the indexer keys written so far equal transformers' with its own DynamicCache."""
    model = tiny_dsa()
    language_model = model.model
    kinds = ["indexed"] * model.config.num_hidden_layers
    keyword = upstream.cache_keyword(language_model.layers[0])
    wrapper = {"kv_layout": "latent", "cache_keyword": keyword, "layer_kinds": kinds}
    prefill = abi.PrefillWrapper.from_language_model(language_model, model.lm_head, **wrapper)
    decode = abi.DecodeWrapper.from_language_model(language_model, model.lm_head, paged=paged, **wrapper)
    length, capacity, block = 6, 32, 8
    prompt = torch.randint(
        3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1)
    )
    cache = DynamicCache(config=model.config)
    _, mask, positions = abi.prefill_inputs(batch=1, prefill_len=length, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        reference = model(prompt, **{keyword: cache}, use_cache=True).logits
        logits, *present = prefill(prompt, mask, positions)
    assert (logits - reference).abs().max() <= 1e-5
    assert len(present) == 3 * len(kinds)
    table: tuple[torch.Tensor, ...] = ()
    if paged:
        per_row = capacity // block
        block_table = torch.randperm(2 * per_row, generator=torch.Generator().manual_seed(3))[:per_row]
        table = (block_table.view(1, per_row),)
        pools = [(2 * per_row, block, tensor.shape[1], tensor.shape[3]) for tensor in present]
        states = abi.place_prefill_kv_paged(present, table[0], torch.tensor([length]), pools, kinds)
    else:
        states = abi.place_prefill_kv(present, capacity, kinds)
    token = logits[:, -1:].argmax(-1)
    for step in range(20):
        position = length + step
        rows = torch.full((1, 1), position)
        step_mask = abi.additive_causal_mask(rows, capacity, torch.float32)
        with torch.no_grad():
            reference = model(token, **{keyword: cache}, use_cache=True).logits
            logits, *states = decode(token, step_mask, rows, rows.view(-1), *table, *states)
        assert (logits - reference).abs().max() <= 1e-5, step
        for layer in range(len(kinds)):
            ours = states[3 * layer + 2]
            ours = abi.paged_view(ours, table[0]) if paged else ours
            theirs = cache.layers[layer].indexer_keys  # [batch, tokens, index_head_dim]
            assert (ours[:, 0, : position + 1] - theirs).abs().max() <= 1e-5, (step, layer)
        token = logits[:, -1:].argmax(-1)


def test_the_probe_reads_the_indexer_keys_and_refuses_a_dsa_layer_probed_as_attention() -> None:
    model = tiny_dsa()
    kinds = ["indexed"] * model.config.num_hidden_layers
    upstream.forget()
    protocol = upstream.decoder_protocol(model.model, kinds)
    assert protocol.index_dim == model.config.index_head_dim
    upstream.forget()
    with pytest.raises(upstream.LayersUnsupported) as refused:
        upstream.decoder_protocol(model.model)
    upstream.forget()
    assert refused.value.code == "cache-protocol"
    assert "update_indexer" in refused.value.findings[0].found


def test_the_structure_says_the_indexer_and_refuses_one_it_cannot_size() -> None:
    config = DeepseekV32Config()
    structure = derive_structure(config)
    assert set(structure.layer_kinds) == {"indexed"}
    indexer = structure.indexer
    assert (indexer.n_heads, indexer.head_dim, indexer.topk) == (64, 128, 2048)
    assert "with a DSA indexer 64x128 top-2048" in structure.describe()
    assert structure.to_dict()["indexer"] == {"n_heads": 64, "head_dim": 128, "topk": 2048}
    raw = {k: v for k, v in config.to_dict().items() if not k.startswith("index_")}
    with pytest.raises(Refusal) as refused:
        derive_structure(raw)
    assert refused.value.code == "layer-types" and "index_head_dim" in refused.value.message


SPEC = """\
apiVersion: kadapt/v1
kind: AdapterSpec
metadata: {name: deepseek_v32}
gate: {model_type: deepseek_v32}
source: {config: deepseek_v32/config.json}
config_bridges:
  - {id: X1, why: eager attention exports as plain ops, op: set, path: _attn_implementation,
     value: eager, backends: [extraction]}
  - {id: X2, why: batched_mm experts export with static shapes, op: set,
     path: _experts_implementation, value: batched_mm, backends: [extraction]}
module_paths: {language_model: model, language_layers: model.layers, lm_head: lm_head}
abi:
  batch: 2
  prefill_len: 8
  max_cache_len: 64
  dtype: float32
  kv_cache: {kind: paged, block_size: 8}
  prefill:
    inputs: [input_ids, attention_mask, position_ids]
    outputs: [logits, "k.{layer}", "v.{layer}", "i.{layer}"]
  decode:
    inputs: [input_ids, attention_mask, position_ids, cache_position,
             "pk.{layer}", "pv.{layer}", "pi.{layer}"]
    outputs: [logits, "k.{layer}", "v.{layer}", "i.{layer}"]
"""


def dsa_spec(tmp_path: Path, text: str = SPEC) -> Any:
    (tmp_path / "deepseek_v32").mkdir()
    (tmp_path / "deepseek_v32" / "config.json").write_text(json.dumps(tiny_config("deepseek_v32")))
    (tmp_path / "deepseek_v32.yaml").write_text(text)
    return load_spec(tmp_path / "deepseek_v32.yaml")


def test_the_abi_must_name_the_indexer_keys_and_keep_the_attention_that_runs_the_indexer(
    tmp_path: Path,
) -> None:
    spec = dsa_spec(tmp_path, SPEC.replace(', "i.{layer}"', "").replace(', "pi.{layer}"', ""))
    structure = derive_structure(tiny_config("deepseek_v32"))
    with pytest.raises(KadaptError) as missing:
        bind_structure(options_from_spec(spec, output_dir=tmp_path / "out"), structure)
    assert '"<present index_key {layer}>"' in missing.value.message
    assert missing.value.location == spec.locate("abi.prefill.outputs")
    (tmp_path / "named").mkdir()
    named = dsa_spec(tmp_path / "named")
    absorbed = options_from_spec(
        named, output_dir=tmp_path / "out", kv_layout="latent", mla_attention="absorbed"
    )
    with pytest.raises(KadaptError, match="would drop the DSA indexer"):
        bind_structure(absorbed, structure)


def test_verify_proves_the_sparse_selection_with_ragged_paged_rows(tmp_path: Path) -> None:
    """Two rows of different lengths through a paged pool: tokens, logits and every returned state
    (latent KV and indexer keys) equal transformers' over 24 decode steps."""
    spec = dsa_spec(tmp_path)
    options = dataclasses.replace(
        options_from_spec(spec, output_dir=tmp_path / "out"), verify_dtypes=("float32",)
    )
    report = verify(spec, options, echo=lambda line: None)
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    checks = {check.name: check.detail for check in report.checks}
    assert "2 indexed layers, prefill + 24 decode steps" in checks["returned states"]
    assert "index_key max |diff|" in checks["returned states"]
    assert "paged, blocks out of order" in checks["ragged batch"]


def test_a_graph_that_attends_to_every_key_fails_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exported graphs (not the reference) keep every key instead of the indexer's top-4: the
    selection is what the verify model's logits depend on, so the round trip fails."""
    real_run = roundtrip.run

    def run(spec: Any, model: torch.nn.Module, options: Any, **kwargs: Any) -> Any:
        for module in model.modules():
            if hasattr(module, "index_topk"):
                module.index_topk = 10**6
        return real_run(spec, model, options, **kwargs)

    monkeypatch.setattr(roundtrip, "run", run)
    spec = dsa_spec(
        tmp_path,
        SPEC.replace("batch: 2", "batch: 1").replace(
            "kv_cache: {kind: paged, block_size: 8}", "kv_cache: {kind: contiguous}"
        ),
    )
    options = options_from_spec(spec, output_dir=tmp_path / "out")
    report = verify(
        spec,
        dataclasses.replace(options, verify_dtypes=("float32",), verify_decode_steps=8),
        echo=lambda line: None,
    )
    failed = {check.name for check in report.checks if not check.passed}
    assert {"prefill logits", "decode logits"} <= failed
