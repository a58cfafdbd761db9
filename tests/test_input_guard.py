"""The binder guards every execution of a saved graph (issue 22, item 4).

``symbolic.bind_ir`` checks the inputs against the IR's own ``graph_inputs`` (name, shape, dtype) before
the executor sees them, for static graphs as for dynamic ones, and the multimodal prefill's placeholder
count against the feature rows (the one rule the graph cannot check). Each refusal is one ``KadaptError``
naming the input, its expected and its received shape. Positions are read by value (issue 39, item 4): a
row outside the cache is refused on every decode graph, contiguous (whose write would drop the token
silently) and paged, and on a prefill or multimodal prefill given the cache it fills, naming the input,
row, position and limit (the packed step graph's: ``tests/test_step_graph.py``). The declarations here
are those of real saved files (a tiny Llama export, the KV mapping's ``merged_prefill`` section as the
runtime builds it).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch_ir

from kimi_adapter_core.backends.extraction import options_from_spec, run
from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.backends.extraction.runtime.symbolic import (
    Placeholders,
    bind_ir,
    check_inputs,
    position_inputs,
)
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied, load_config, load_model
from kimi_adapter_core.spec import load_spec

PREFILL, CACHE = 8, 32


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, Any]]]:
    """A static tiny Llama export (prefill 8, cache 32, float32): its options and loaded IRs."""
    spec = load_spec("llama")
    out = tmp_path_factory.mktemp("llama")
    options = options_from_spec(spec, output_dir=out, prefill_len=PREFILL, max_cache_len=CACHE)
    options = dataclasses.replace(options, dtype="float32")
    config = load_config(spec, backend="extraction", overrides=tiny_overrides(spec, options))
    with applied(spec, backend="extraction"):
        run(spec, load_model(spec, device="meta", config=config), options, echo=lambda _: None)
    yield options, {kind: torch_ir.load_ir(options.path(kind)) for kind in ("prefill", "decode")}


def _prefill_inputs(batch: int, length: int) -> tuple[torch.Tensor, ...]:
    _, mask, positions = runtime.prefill_inputs(
        batch=batch, prefill_len=length, dtype=torch.float32, device="cpu"
    )
    return torch.zeros(batch, length, dtype=torch.long), mask, positions


def test_a_matching_call_binds_to_the_static_graph_unchanged(saved: tuple) -> None:
    _, irs = saved
    assert bind_ir(irs["prefill"], _prefill_inputs(1, PREFILL), {}, graph="prefill") is irs["prefill"]


def _replaced(index: int, make: Any) -> Any:
    """The matching prefill inputs with input ``index`` replaced by ``make(original)``."""

    def inputs() -> tuple[torch.Tensor, ...]:
        good = list(_prefill_inputs(1, PREFILL))
        good[index] = make(good[index])
        return tuple(good)

    return inputs


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (  # a prompt longer than the static prefill_len
            lambda: _prefill_inputs(1, PREFILL + 1),
            rf"^prefill input input_ids: expected shape \[1, {PREFILL}\], got \[1, {PREFILL + 1}\]: "
            rf"dim 1 must be {PREFILL} \(static\), got {PREFILL + 1}$",
        ),
        (  # and a shorter one: the contract right-pads it, the graph does not
            lambda: _prefill_inputs(1, PREFILL - 3),
            rf"input_ids: expected shape \[1, {PREFILL}\], got \[1, {PREFILL - 3}\]",
        ),
        (  # a batch the graph was not made for
            lambda: _prefill_inputs(2, PREFILL),
            rf"input_ids: expected shape \[1, {PREFILL}\], got \[2, {PREFILL}\]: dim 0 must be 1",
        ),
        (  # token ids of another dtype
            _replaced(0, lambda ids: ids.int()),
            rf"input_ids: expected int64 \[1, {PREFILL}\], got int32 \[1, {PREFILL}\]: dtype must be int64",
        ),
        (  # a mask of another rank
            _replaced(1, lambda mask: mask[0]),
            rf"attention_mask: expected shape \[1, 1, {PREFILL}, {PREFILL}\], "
            rf"got \[1, {PREFILL}, {PREFILL}\]: must have 4 dims, got 3",
        ),
        (  # a bf16 mask into a float32 graph
            _replaced(1, lambda mask: mask.bfloat16()),
            "attention_mask: expected float32 .* got bfloat16 .*: dtype must be float32",
        ),
        (  # an input missing
            lambda: _prefill_inputs(1, PREFILL)[:2],
            r"prefill graph takes 3 inputs \(input_ids, attention_mask, position_ids\), got 2",
        ),
    ],
)
def test_static_prefill_refuses_inputs_it_was_not_made_for(saved: tuple, inputs: Any, message: str) -> None:
    _, irs = saved
    with pytest.raises(KadaptError, match=message):
        bind_ir(irs["prefill"], inputs(), {}, graph="prefill")


def test_static_decode_refuses_a_cache_of_the_wrong_shape(saved: tuple) -> None:
    """The cache tensors are declared by the decode IR too: one too short is named before execution."""
    options, irs = saved
    decode = irs["decode"]
    cache = [torch.zeros(meta.shape, dtype=torch.float32) for meta in decode.graph_inputs[4:]]
    positions = torch.full((1, 1), PREFILL, dtype=torch.long)
    mask = runtime.additive_causal_mask(positions, CACHE, torch.float32)
    fixed = (torch.zeros(1, 1, dtype=torch.long), mask, positions, positions.view(-1))
    assert bind_ir(decode, (*fixed, *cache), {}, graph="decode") is decode
    bad = decode.graph_inputs[7]  # layer 1's value cache
    cache[3] = torch.zeros(*bad.shape[:2], CACHE // 2, bad.shape[3])
    expected = ", ".join(str(d) for d in bad.shape)
    with pytest.raises(
        KadaptError,
        match=rf"^decode input {bad.name}: expected shape \[{expected}\], got .*: "
        rf"dim 2 must be {CACHE} \(static\)",
    ):
        bind_ir(decode, (*fixed, *cache), {}, graph="decode")
    assert options.decode_names.past_value is not None
    assert bad.name == options.decode_names.past_value.format(layer=1)


# The multimodal prefill's declaration and rule: 4 feature rows, placeholder token 7.
ROWS, HIDDEN, TOKEN, LENGTH = 4, 16, 7, 10
MERGED_IR = torch_ir.IR.from_dict(
    {
        "graph_inputs": [
            {"name": "input_ids", "shape": [2, LENGTH], "dtype": "int64"},
            {"name": "image_features", "shape": [ROWS, HIDDEN], "dtype": "float32"},
            {"name": "attention_mask", "shape": [2, 1, LENGTH, LENGTH], "dtype": "float32"},
            {"name": "position_ids", "shape": [2, LENGTH], "dtype": "int64"},
        ],
        "graph_outputs": [],
        "weights": [],
        "nodes": [],
    }
)


def _mapping_section() -> dict[str, Any]:
    """The KV mapping's ``merged_prefill`` section, as the extraction writes it."""
    return runtime.build_merged_prefill_mapping(
        ((1, 16), (1, 8)),
        graph="prefill_mm_ir.json",
        inputs=[meta.name for meta in MERGED_IR.graph_inputs],
        batch=2,
        prefill_len=LENGTH,
        num_layers=1,
        dtype="float32",
        names={
            "prefill_key": "present.{layer}.key",
            "prefill_value": "present.{layer}.value",
            "decode_key_in": "past.{layer}.key",
            "decode_value_in": "past.{layer}.value",
        },
        feature_input="image_features",
        feature_shape=(ROWS, HIDDEN),
        placeholder_token_id=TOKEN,
    )


def _merged_inputs(placeholders: int) -> tuple[torch.Tensor, ...]:
    """Ids with ``placeholders`` placeholder tokens spread over both rows of the batch."""
    ids = torch.randint(8, 100, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    spots = [(0, 2), (0, 3), (1, 0), (1, 5), (1, 6), (0, 9)][:placeholders]
    for row, column in spots:
        ids[row, column] = TOKEN
    _, mask, positions = runtime.prefill_inputs(
        batch=2, prefill_len=LENGTH, dtype=torch.float32, device="cpu"
    )
    return ids, torch.randn(ROWS, HIDDEN), mask, positions


def _decode_call(decode: Any, position_ids: int, cache_position: int) -> tuple[torch.Tensor, ...]:
    """Decode inputs of the saved graph for one row: its positions, a mask over the cache, zero caches."""
    positions = torch.full((1, 1), position_ids, dtype=torch.long)
    mask = runtime.additive_causal_mask(positions, CACHE, torch.float32)
    cache = [torch.zeros(meta.shape, dtype=torch.float32) for meta in decode.graph_inputs[4:]]
    return (torch.zeros(1, 1, dtype=torch.long), mask, positions, torch.tensor([cache_position]), *cache)


@pytest.mark.parametrize(
    ("position_ids", "cache_position", "refused"),
    [
        (CACHE, CACHE, f"position_ids: row 0 holds {CACHE}"),
        (CACHE - 1, CACHE, f"cache_position: row 0 holds {CACHE}"),
        (-1, 0, "position_ids: row 0 holds -1"),
        (0, -1, "cache_position: row 0 holds -1"),
    ],
)
def test_decode_positions_outside_the_cache_are_refused_by_default(
    saved: tuple, position_ids: int, cache_position: int, refused: str
) -> None:
    """A position >= max_cache_len has no slot: the contiguous per-row write (``write_rows``) would drop
    the token without an error, so the binder refuses it with no help from the caller, reading the limit
    from the graph's own declaration (the mask spans the cache), and names input, row, position, limit."""
    _, irs = saved
    decode = irs["decode"]
    assert bind_ir(decode, _decode_call(decode, CACHE - 1, CACHE - 1), {}, graph="decode") is decode
    call = _decode_call(decode, position_ids, cache_position)
    message = rf"^saved\.json input {refused}, outside 0\.\.{CACHE - 1}: a position must be a slot of the "
    with pytest.raises(KadaptError, match=message + rf"cache \(max_cache_len {CACHE}\)"):
        bind_ir(decode, call, {}, graph="saved.json")  # by the declaration, whatever the caller's label
    assert bind_ir(decode, call, {}, graph="decode", check_values=False) is decode  # the documented switch


def test_the_kv_mappings_value_ranges_agree_with_the_declaration(saved: tuple) -> None:
    import json

    from kimi_adapter_core.backends.extraction.runtime.symbolic import decode_value_ranges

    options, irs = saved
    decode = irs["decode"]
    values = decode_value_ranges(decode, json.loads(options.path("kv_mapping").read_text()))
    assert values == {"position_ids": (0, CACHE - 1), "cache_position": (0, CACHE - 1)}
    assert position_inputs(decode, graph="decode") == ([2, 3], CACHE)
    assert position_inputs(irs["prefill"], graph="prefill") == ([2], None)
    with pytest.raises(KadaptError, match=rf"^decode input cache_position: row 0 holds {CACHE}, outside"):
        bind_ir(decode, _decode_call(decode, 0, CACHE), {}, graph="decode", values=values)


def test_paged_decode_positions_outside_the_cache_are_refused(saved: tuple) -> None:
    """The paged graph would fail loudly (the block table has no entry past the cache); the binder
    refuses first, with the same error, here for the second row of a batch of two. The declaration is
    the paged ABI's (``decode_inputs`` with block pools) over the saved graph's KV dims."""
    _, irs = saved
    key, value = (irs["decode"].graph_inputs[index].shape for index in (4, 5))  # [1, heads, CACHE, dim]
    block_size, num_blocks, batch = 4, 2 * CACHE // 4, 2
    example = runtime.decode_inputs(
        ((key[1], key[3]), (value[1], value[3])),
        batch=batch,
        position=CACHE - 1,
        max_cache_len=CACHE,
        num_layers=1,
        dtype=torch.float32,
        device="cpu",
        paged=(block_size, num_blocks),
    )
    names = ["input_ids", "attention_mask", "position_ids", "cache_position", "block_table", "key", "value"]
    paged = torch_ir.IR.from_dict(
        {
            "graph_inputs": [
                {"name": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
                for name, tensor in zip(names, example, strict=True)
            ],
            "graph_outputs": [],
            "weights": [],
            "nodes": [],
        }
    )
    assert tuple(paged.graph_inputs[5].shape[:2]) == (num_blocks, block_size)  # a block pool
    assert bind_ir(paged, example, {}, graph="decode") is paged
    late = (*example[:3], torch.tensor([CACHE - 1, CACHE]), *example[4:])
    with pytest.raises(
        KadaptError, match=rf"^decode input cache_position: row 1 holds {CACHE}, outside 0\.\.{CACHE - 1}: "
    ):
        bind_ir(paged, late, {}, graph="decode")


def test_prefill_positions_past_the_cache_it_fills_are_refused(saved: tuple) -> None:
    """A prefill graph states no cache length: with the ``max_cache_len`` of the cache its KV fills, a
    row whose positions run past it is refused (its next decode step would have no slot)."""
    _, irs = saved
    prefill = irs["prefill"]
    ids, mask, positions = _prefill_inputs(1, PREFILL)
    last = positions + (CACHE - PREFILL)  # positions CACHE-PREFILL..CACHE-1: the cache's last slots
    assert bind_ir(prefill, (ids, mask, last), {}, graph="prefill", max_cache_len=CACHE) is prefill
    past = positions + (CACHE - PREFILL + 1)
    assert bind_ir(prefill, (ids, mask, past), {}, graph="prefill") is prefill  # no cache: nothing to hold
    with pytest.raises(
        KadaptError, match=rf"^prefill input position_ids: row 0 holds {CACHE}, outside 0\.\.{CACHE - 1}: "
    ):
        bind_ir(prefill, (ids, mask, past), {}, graph="prefill", max_cache_len=CACHE)


@pytest.mark.parametrize("key_len", ["prefill_len", 0])
def test_a_decode_declaration_whose_mask_states_no_cache_length_is_refused(key_len: Any) -> None:
    """The decode limit is the mask's key length: an edited file that makes it symbolic or empty is
    refused naming the mask, never read as a cache with no limit."""
    declared = [
        ("input_ids", [1, 1], "int64"),
        ("attention_mask", [1, 1, 1, key_len], "float32"),
        ("position_ids", [1, 1], "int64"),
        ("cache_position", [1], "int64"),
    ]
    ir = torch_ir.IR.from_dict(
        {
            "graph_inputs": [{"name": n, "shape": shape, "dtype": d} for n, shape, d in declared],
            "graph_outputs": [],
            "weights": [],
            "nodes": [],
        }
    )
    with pytest.raises(
        KadaptError, match=r"^decode input attention_mask: declared \[1, 1, 1, .*max_cache_len"
    ):
        position_inputs(ir, graph="decode")


def test_placeholders_are_read_from_the_mapping_or_the_ir_metadata() -> None:
    from_mapping = Placeholders.from_document(_mapping_section())
    from_metadata = Placeholders.from_document(
        {"feature_input": "image_features", "placeholder_token_id": TOKEN}
    )
    assert from_mapping == from_metadata == Placeholders(TOKEN, "image_features")


@pytest.mark.parametrize("count", [ROWS - 1, ROWS + 1, 0])
def test_a_placeholder_count_off_the_feature_rows_is_refused(count: int) -> None:
    rule = Placeholders.from_document(_mapping_section())
    with pytest.raises(
        KadaptError,
        match=rf"^prefill_mm input input_ids \[2, {LENGTH}\] has {count} image placeholder tokens "
        rf"\(id {TOKEN}\) but image_features \[{ROWS}, {HIDDEN}\] has {ROWS} rows; they must be equal",
    ):
        bind_ir(MERGED_IR, _merged_inputs(count), {}, graph="prefill_mm", placeholders=rule)


def test_the_placeholder_count_over_the_whole_batch_passes_and_is_only_checked_when_asked() -> None:
    rule = Placeholders.from_document(_mapping_section())
    assert check_inputs(MERGED_IR, _merged_inputs(ROWS), {}, graph="prefill_mm", placeholders=rule) == {}
    check_inputs(MERGED_IR, _merged_inputs(ROWS - 1), {}, graph="prefill_mm")  # the text-only shape check
    with pytest.raises(KadaptError, match="has no input 'pixels' for the image features"):
        check_inputs(
            MERGED_IR,
            _merged_inputs(ROWS),
            {},
            graph="prefill_mm",
            placeholders=Placeholders(TOKEN, "pixels"),
        )


def test_the_binder_stays_torch_free() -> None:
    """A runtime can copy the reference binder without torch: importing it must not import torch."""
    code = (
        "import sys, kimi_adapter_core.backends.extraction.runtime.symbolic as s; "
        "assert 'torch' not in sys.modules, 'symbolic imports torch'; print(s.Placeholders.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "Placeholders", done.stderr


def test_multimodal_prefill_positions_past_the_cache_it_fills_are_refused() -> None:
    """The multimodal prefill's positions (after its mask, behind the image features) are checked like
    the text prefill's: given the cache its KV fills, a row running past it is refused."""
    rule = Placeholders.from_document(_mapping_section())
    ids, features, mask, positions = _merged_inputs(ROWS)
    bind_ir(MERGED_IR, (ids, features, mask, positions), {}, graph="prefill_mm", max_cache_len=LENGTH)
    past = positions + 1  # row 0's last token at position LENGTH: no slot in a cache of LENGTH
    with pytest.raises(
        KadaptError,
        match=rf"^prefill_mm input position_ids: row 0 holds {LENGTH}, outside 0\.\.{LENGTH - 1}: ",
    ):
        bind_ir(
            MERGED_IR,
            (ids, features, mask, past),
            {},
            graph="prefill_mm",
            placeholders=rule,
            max_cache_len=LENGTH,
        )
