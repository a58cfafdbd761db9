"""Chunked attention (Llama-4's ``chunked_attention`` layers) and its NoPE layers' temperature tuning.

The mask rule against transformers' own ``create_chunked_causal_mask`` across chunk boundaries (and
unlike a sliding window of the chunk's size), the structure's reading of chunked layers, a tiny
``llama4_text`` through the family matrix's trial (validate --resolve, apply, verify: prefill and 24
decode steps past several chunk boundaries), and the tiny verify config's temperature scale moving the
logits far beyond the verify's bound, so a wrong scale cannot pass. Then what plan, simulate and the
TensorCast target make of chunked layers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Llama4ForCausalLM, Llama4TextConfig
from transformers.masking_utils import create_chunked_causal_mask

from kimi_adapter_core.backends.extraction.runtime.abi import (
    StaticStateCache,
    additive_causal_mask,
    chunked_window_mask,
    sliding_window_mask,
)
from kimi_adapter_core.backends.simulation.estimate.planner import kv_sizing
from kimi_adapter_core.backends.simulation.model.serving_kernels import (
    chunked_pairs,
    prefill_keys,
    visible_keys,
)
from kimi_adapter_core.builtins.llama4 import _temperature_scales
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import ADAPTED, GUIDE_PATCHES, run_trial, write_spec
from kimi_adapter_core.generate.common import NotExpressible
from kimi_adapter_core.generate.tensorcast_coverage import refuse_unpriced_layers
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.derive import derive_structure

CHUNK = 4
MIN = torch.finfo(torch.float32).min


def _config(**over: object) -> Llama4TextConfig:
    """The family matrix's tiny llama4_text config at the verify's chunk and floor scale."""
    raw = {**tiny_config("llama4_text"), "attention_chunk_size": CHUNK, "floor_scale": 4, **over}
    config = Llama4TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    config._attn_implementation = "eager"
    return config


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """Visibility (True: attend) of an additive float mask or a boolean one."""
    return mask == 0 if mask.dtype != torch.bool else mask


def test_the_mask_is_transformers_chunked_mask_across_chunk_boundaries() -> None:
    length = 11  # queries 0..10: chunks [0, 3], [4, 7], [8, 10]
    config = _config()
    positions = torch.arange(length).unsqueeze(0)
    theirs = create_chunked_causal_mask(
        config=config,
        inputs_embeds=torch.zeros(1, length, config.hidden_size),
        attention_mask=torch.ones(1, length, dtype=torch.long),
        cache=None,
        position_ids=positions,
    )
    ours = chunked_window_mask(additive_causal_mask(positions, length, torch.float32), positions, CHUNK)
    assert torch.equal(_visible(ours[0, 0]), _visible(theirs[0, 0]))
    # right after a boundary a query sees only itself; a sliding window of the chunk's size is another rule
    assert _visible(ours[0, 0, 8]).nonzero().flatten().tolist() == [8]
    sliding = sliding_window_mask(additive_causal_mask(positions, length, torch.float32), positions, CHUNK)
    assert not torch.equal(_visible(ours), _visible(sliding))


def test_decode_rows_at_different_positions_each_see_their_own_chunk() -> None:
    positions = torch.tensor([[3], [4], [9], [15]])  # last of a chunk, first of one, middle, last
    mask = chunked_window_mask(additive_causal_mask(positions, 16, torch.float32), positions, CHUNK)
    keys = torch.arange(16)
    for row, p in enumerate(positions.flatten().tolist()):
        rule = (keys <= p) & (keys // CHUNK == p // CHUNK)  # transformers' chunked overlay, in positions
        assert torch.equal(_visible(mask[row, 0, 0]), rule), p
    assert mask.dtype == torch.float32 and float(mask.min()) == MIN


def test_structure_reads_chunked_layers_from_layer_types_or_llama4s_rule() -> None:
    raw = tiny_config("llama4_text")
    listed = derive_structure(raw)
    assert listed.chunks == (8, 8, 8, None) and listed.windows == (None,) * 4
    assert "3/4 chunked-attention layers (chunk 8)" in listed.describe()
    assert listed.to_dict()["layers"][0]["chunk"] == 8 and "chunk" not in listed.to_dict()["layers"][1]
    # a JSON without layer_types: the config class's rule (rope layers chunked, every 4th layer NoPE, full)
    bare = {k: v for k, v in raw.items() if k not in ("layer_types", "no_rope_layers")}
    assert derive_structure({**bare, "num_hidden_layers": 8}).chunks == (8, 8, 8, None) * 2
    assert derive_structure({**bare, "no_rope_layers": [1, 0, 1, 1]}).chunks == (8, None, 8, 8)
    with pytest.raises(KadaptError, match="layer 0 is chunked_attention but the config sets no attention"):
        derive_structure({**raw, "attention_chunk_size": None})


def test_stacks_without_chunked_layers_name_no_chunk() -> None:
    structure = derive_structure(tiny_config("llama"))
    assert not structure.has_chunked_layers
    assert all("chunk" not in run for run in structure.to_dict()["layers"])


def test_the_static_cache_answers_get_seq_length_per_row_in_decode() -> None:
    assert StaticStateCache("heads", [0]).get_seq_length(0) == 0  # prefill starts at position 0
    past = [(torch.zeros(2, 1, 8, 4), torch.zeros(2, 1, 8, 4))]
    decode = StaticStateCache("heads", [0], past, torch.tensor([5, 2]))
    assert decode.get_seq_length(0).tolist() == [5, 2]


def test_temperature_scales_follow_each_rows_position() -> None:
    attention = Llama4ForCausalLM(_config()).model.layers[3].self_attn
    assert not attention.use_rope and attention.attn_temperature_tuning  # the NoPE layer
    hidden = torch.zeros(2, 1, 64)
    rows = _temperature_scales(attention, hidden, StaticStateCache("heads", [3], [()], torch.tensor([2, 11])))
    # upstream's formula: log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 at p = 2 and p = 11
    assert rows.flatten().tolist() == pytest.approx([1.0, 1.0 + 0.1 * float(torch.log1p(torch.tensor(3.0)))])


@torch.no_grad()
def test_temperature_tuning_moves_the_tiny_logits_beyond_the_verify_bound() -> None:
    torch.manual_seed(0)
    model = Llama4ForCausalLM(_config(initializer_range=0.2)).eval()
    ids = torch.randint(3, 128, (1, 32))  # the verify's positions: prompt 8 + 24 decode steps
    tuned = model(ids).logits
    for layer in model.model.layers:
        layer.self_attn.attn_temperature_tuning = False
    plain = model(ids).logits
    bound = 1e-4 * tuned.abs().amax(-1, keepdim=True)  # verify's float32 bound per row
    assert float(((tuned - plain).abs() / bound).max()) > 100


def test_llama4_text_is_adapted_by_the_family_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adapted under Scout's builtins; the same text classes tried next in the same process without them
    (the multimodal llama4 type, its guide patches dropped) are still refused for their rotary form (a
    probe cached under those builtins used to let it past)."""
    row = run_trial("llama4_text")
    assert (row.outcome, row.code) == (ADAPTED, ""), row.detail
    assert row.detail.startswith("heads KV, GQA; verify max |diff|")
    monkeypatch.delitem(GUIDE_PATCHES, "llama4")
    after = run_trial("llama4")
    refused = ("refused", "rotary-form", "Llama4TextRotaryEmbedding returns Tensor")
    assert (after.outcome, after.code, after.detail) == refused


def test_simulate_prices_each_query_its_own_chunk() -> None:
    # queries at positions 0..7, chunk 4: 1 + 2 + 3 + 4 keys, twice
    assert chunked_pairs(0, 8, CHUNK) == 20
    assert chunked_pairs(6, 3, CHUNK) == 3 + 4 + 1  # positions 6, 7, 8
    assert visible_keys(10, None, CHUNK) == 2  # the query at 9 sees 8 and 9
    assert visible_keys(10, 4, None) == 4 and visible_keys(10, None, None) == 10
    assert prefill_keys(6, 3, None, CHUNK) == 2 + 3  # the first query's chunk starts at 4


def test_plan_keeps_at_most_a_chunk_per_chunked_layer() -> None:
    kv = kv_sizing(derive_structure(tiny_config("llama4_text")), tp=1)
    assert kv.chunks == (8, 8, 8, None) and kv.caps == (8, 8, 8, None)
    assert kv.cached_token_layers(100) == 3 * 8 + 100
    assert kv_sizing(derive_structure(tiny_config("llama")), tp=1).chunks == ()


def test_tensorcast_profiles_refuse_chunked_layers(tmp_path: Path) -> None:
    paths = {"language_model": "model", "lm_head": "lm_head", "language_layers": "model.layers"}
    spec = load_spec(write_spec(tmp_path, "llama4_text", tiny_config("llama4_text"), paths))
    with pytest.raises(NotExpressible, match="3 of the 4 layers use chunked attention"):
        refuse_unpriced_layers(spec)
