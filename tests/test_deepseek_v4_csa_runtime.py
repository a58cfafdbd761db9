"""DeepSeek-V4's compressed sparse attention in the runtime (issue 36): the ``csa`` state kind, proven
at the wrappers (kadapt's export and verify of it: ``tests/test_deepseek_v4_csa.py``).

A tiny random DeepSeek-V4 ``[sliding, csa, hca]`` (both rates 4, an indexer of 8 heads keeping the top 2
entries), driven by the runtime's prefill and decode wrappers with the three ``deepseek_v4_*`` builtins
wrapping upstream's compressors and indexer. A csa layer keeps its sliding K=V window, a ring of two
windows of raw ``kv || gate`` (an entry mixes the previous window's first series with its own second),
its entries, and its indexer's ring and entries; every query attends over the entries its indexer picks
among those closed. Logits equal transformers' own ``DynamicCache`` (``DeepseekV4CSACache``) at every
step and both series' entries equal its ``compressed_kv``. Eight indexer heads keep the ReLU'd scores
from tying at exactly zero, where which tied entry a top-k keeps has no defined answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction.runtime import abi
from kimi_adapter_core.backends.extraction.tiny_model import randomize_constants
from kimi_adapter_core.builtins import deepseek_v4 as builtins
from kimi_adapter_core.families.tiny import tiny_config

RATE, WINDOW, TOPK = 4, 4, 2
BATCH, CAPACITY, STEPS = 2, 32, 20
TOLERANCE = 1e-4
KINDS = ["attention", "csa", "hca"]
# upstream class -> the builtin kadapt wraps its forward with
WRAPPED = {
    "DeepseekV4HCACompressor": builtins.deepseek_v4_hca_compressor,
    "DeepseekV4CSACompressor": builtins.deepseek_v4_csa_compressor,
    "DeepseekV4Indexer": builtins.deepseek_v4_indexer,
}


def _model() -> torch.nn.Module:
    config = tiny_config("deepseek_v4")
    config.update(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        hc_mult=2,
        sliding_window=WINDOW,
        compress_rates={"compressed_sparse_attention": RATE, "heavily_compressed_attention": RATE},
        index_n_heads=8,
        index_head_dim=16,
        index_topk=TOPK,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).eval()
    randomize_constants(model)
    return model


@pytest.fixture
def wrapped() -> Iterator[None]:
    """The builtins wrapping upstream's forwards, as a spec's ``wrap`` patches install them."""
    originals = {name: getattr(modeling, name).forward for name in WRAPPED}

    def wrap(impl: Any, original: Any) -> Any:
        return lambda *args: impl(original, *args)

    for name, impl in WRAPPED.items():
        getattr(modeling, name).forward = wrap(impl, originals[name])
    try:
        yield
    finally:
        for name, original in originals.items():
            getattr(modeling, name).forward = original


def _assert_entries(states: list[torch.Tensor], cache: DynamicCache, written: int) -> None:
    """The csa layer's entries and its indexer's: transformers' ``compressed_kv`` of each, the other slots
    zeros; its rings hold two windows."""
    layer = cache.layers[1]
    assert states[4].shape[2] == 2 * RATE and states[6].shape[2] == 2 * RATE
    for name, entries in (("compressor", states[5]), ("indexer", states[7])):
        closed = layer.entry_count[name]
        assert closed == written // RATE
        expected = torch.zeros_like(entries)
        if closed:
            expected[:, 0, :closed] = layer.compressed_kv[name]
        assert (entries - expected).abs().max() <= TOLERANCE, (name, written)


@pytest.mark.compat
@pytest.mark.parametrize("prompt_len", [3, 6, 8])
def test_the_csa_state_kind_equals_transformers_cache(wrapped: None, prompt_len: int) -> None:
    """Prefill and 20 decode steps, batch 2, past the point where more entries are closed than the
    indexer keeps (so its top-k decides what is attended): logits and every csa entry equal transformers'
    with its own DynamicCache; the hca layer beside it as its own test proves."""
    model = _model()
    stack = model.model
    options: dict[str, Any] = {
        "kv_layout": "heads",
        "cache_keyword": upstream.cache_keyword(stack.layers[0]),
        "windows": [WINDOW] * 3,
        "rope_layer_types": upstream.rope_layer_types(stack),
        "layer_kinds": KINDS,
    }
    prefill = abi.PrefillWrapper.from_language_model(stack, model.lm_head, **options)
    decode = abi.DecodeWrapper.from_language_model(stack, model.lm_head, **options)
    keyword = upstream.cache_keyword(model)
    prompt = torch.randint(3, 128, (BATCH, prompt_len), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    _, mask, positions = abi.prefill_inputs(
        batch=BATCH, prefill_len=prompt_len, dtype=torch.float32, device="cpu"
    )
    with torch.no_grad():
        reference = model(prompt, **{keyword: cache}, use_cache=True).logits
        logits, *present = prefill(prompt, mask, positions)
    assert (logits - reference).abs().max() <= TOLERANCE * reference.abs().max()
    states = abi.place_prefill_kv(present, CAPACITY, KINDS)
    assert states[5].shape == (BATCH, 1, CAPACITY // RATE, 16) == states[7].shape
    _assert_entries(states, cache, prompt_len)
    token = logits[:, -1:].argmax(-1)
    for step in range(STEPS):
        position = prompt_len + step
        positions = torch.full((BATCH, 1), position)
        mask = abi.additive_causal_mask(positions, CAPACITY, torch.float32)
        with torch.no_grad():
            reference = model(token, **{keyword: cache}, position_ids=positions, use_cache=True).logits
            logits, *states = decode(token, mask, positions, positions.view(-1), *states)
        assert (logits - reference).abs().max() <= TOLERANCE * reference.abs().max(), step
        _assert_entries(states, cache, position + 1)
        token = logits[:, -1:].argmax(-1)
    assert (prompt_len + STEPS) // RATE > TOPK  # the indexer chose among more entries than it keeps


def test_decode_inputs_carry_the_csa_rings_and_entries() -> None:
    """The example decode inputs of a csa layer: its KV, then a two-window ring and the entries of its
    compressor (head_dim wide), then its indexer's (index_dim wide)."""
    inputs = abi.decode_inputs(
        ((1, 16), (1, 16)),
        batch=2,
        position=8,
        max_cache_len=32,
        num_layers=1,
        dtype=torch.float32,
        device="cpu",
        kinds=["csa"],
        index_dim=8,
        compress_rates={"csa": RATE},
    )
    shapes = [tuple(tensor.shape) for tensor in inputs[4:]]
    assert shapes == [
        (2, 1, 32, 16),
        (2, 1, 32, 16),
        (2, 1, 8, 64),
        (2, 1, 8, 16),
        (2, 1, 8, 32),
        (2, 1, 8, 8),
    ]


@pytest.mark.parametrize("impl", WRAPPED.values())
def test_the_builtins_take_the_cache_under_either_releases_name(impl: Any) -> None:
    """transformers 5.23 names the forwards' cache ``past_key_values``, 5.24 ``cache``: a builtin handed
    any cache but kadapt's, by position or under either name, calls upstream's forward back by position."""
    cache = DynamicCache()
    args = (torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long))
    expected = ("module", *args, cache, 3)
    for how in ({"cache": cache}, {"past_key_values": cache}):
        assert impl(lambda *called: called, "module", *args, layer_idx=3, **how) == expected
    assert impl(lambda *called: called, "module", *args, cache, 3) == expected
