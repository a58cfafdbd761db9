"""Binding the packed step graph (``runtime/step.py``): its value ranges and the block-ownership check.

``bind_ir`` already refuses a step token at a position past the cache (``position_inputs`` knows the
step graph's form). The state mapping's ``step`` section and ``contract.paged`` say what the other
index inputs may hold: a token's request is a row of the block table, a block table entry a block of
the pool, a logit index a token of the call. Outside, the graph would not fail but read another
request's blocks, past the pool, or another token's logits, so ``bind_step`` refuses them too.

Prefix reuse is the engine's to arrange and the graph cannot see it: rows may share the full blocks
of a common prefix (read-only), but a block written in a call must belong to the writing request
alone, else one request's tokens overwrite what another reads (``contract.paged.sharing``). Checking
it reads every token's block, so it is a debug check a runtime turns on (``check_ownership``).
Torch-free, like ``symbolic``, which a generated module embeds beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ....errors import KadaptError
from .symbolic import DimRange, _field, bind_ir


def step_value_ranges(mapping: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """What the step graph's index inputs may hold, by the state mapping (its ``step`` section and
    ``contract.paged``): positions ``0..max_cache_len-1``, requests ``0..rows-1``, blocks
    ``0..num_blocks-1``, logit indices ``0..tokens-1``."""
    where = "state mapping"
    step = mapping.get("step") if isinstance(mapping, Mapping) else None
    if not isinstance(step, Mapping) or not isinstance(step.get("inputs"), list) or len(step["inputs"]) != 5:
        raise KadaptError(f"{where}: step must list the step graph's 5 fixed inputs (was it exported?)")
    ids, positions, rows, table, indices = step["inputs"]
    last = _field(mapping, "max_cache_len", int, where) - 1
    blocks = _field(mapping, "contract.paged.num_blocks", int, where) - 1
    return {
        _field(positions, "name", str, where): (0, last),
        _field(rows, "name", str, where): (0, _first_dim(table, where) - 1),
        _field(table, "name", str, where): (0, blocks),
        _field(indices, "name", str, where): (0, _first_dim(ids, where) - 1),
    }


def _first_dim(entry: Any, where: str) -> int:
    """The first dim of a step input's stated shape (tokens of the ids, rows of the block table)."""
    shape = entry.get("shape") if isinstance(entry, Mapping) else None
    if not isinstance(shape, list) or not shape or type(shape[0]) is not int:
        raise KadaptError(f"{where}: step input {entry!r} must state a shape of integers")
    return int(shape[0])


def check_block_ownership(
    positions: Sequence[int],
    token_rows: Sequence[int],
    block_table: Sequence[Sequence[int]],
    block_size: int,
    *,
    graph: str = "step",
) -> None:
    """Refuse a call in which a block written by one request is also a block of another request of the
    call: two requests writing one block, or one writing a prefix block another reads. Each request's
    blocks are those up to its furthest position in the call (later entries of its row are unused)."""
    furthest: dict[int, int] = {}
    writer: dict[int, int] = {}
    for token, (position, row) in enumerate(zip(positions, token_rows, strict=True)):
        furthest[row] = max(furthest.get(row, position), position)
        block = block_table[row][position // block_size]
        if writer.setdefault(block, row) != row:
            raise KadaptError(
                f"{graph}: token {token} of request row {row} writes block {block}, which request row "
                f"{writer[block]} writes in the same call: a written block must belong to one row"
            )
    for row, last in furthest.items():
        for logical, block in enumerate(block_table[row][: last // block_size + 1]):
            if writer.get(block, row) != row:
                raise KadaptError(
                    f"{graph}: request row {writer[block]} writes block {block}, which request row {row} "
                    f"reads as its logical block {logical}: a shared prefix block is read-only; copy it "
                    "to a block of the writing row first (copy-on-write)"
                )


def bind_step(
    ir: Any,
    inputs: Sequence[Any],
    mapping: Mapping[str, Any],
    *,
    graph: str = "step",
    ranges: Mapping[str, DimRange] | None = None,
    check_values: bool = True,
    check_ownership: bool = False,
) -> Any:
    """``bind_ir`` of the step graph with its index inputs' ranges from ``mapping`` (``step_value_ranges``),
    no image placeholder in its token ids where the mapping names one (``check_no_placeholder``) and,
    with ``check_ownership``, the block-ownership check (``check_block_ownership``)."""
    values = step_value_ranges(mapping) if check_values else None
    bound = bind_ir(ir, inputs, ranges or {}, graph=graph, values=values, check_values=check_values)
    placeholder = mapping["step"].get("placeholder_token_id") if check_values else None
    if placeholder is not None:
        check_no_placeholder(inputs[0].tolist(), placeholder, graph=graph)
    if check_ownership:
        size = _field(mapping, "contract.paged.block_size", int, "state mapping")
        positions, token_rows, table = (inputs[index].tolist() for index in (1, 2, 3))
        check_block_ownership(positions, token_rows, table, size, graph=graph)
    return bound


def check_no_placeholder(token_ids: Sequence[int], placeholder: int, *, graph: str = "step") -> None:
    """Refuse a step whose token ids hold the image placeholder: the step graph embeds token ids, so the
    placeholder would be embedded as a token where the model puts image features (silently wrong
    logits); such a prompt is prefilled by the merged prefill graph."""
    if placeholder in token_ids:
        raise KadaptError(
            f"{graph} input input_ids: token {list(token_ids).index(placeholder)} is the image placeholder "
            f"(id {placeholder}); the step graph embeds token ids only: prefill a prompt with images with "
            "the merged prefill graph (merged_prefill), place its KV in the pool and continue in the step "
            "graph"
        )


def bind_mtp(
    ir: Any,
    inputs: Sequence[Any],
    mapping: Mapping[str, Any],
    *,
    graph: str = "mtp",
    check_values: bool = True,
    check_ownership: bool = False,
) -> Any:
    """``bind_ir`` of the MTP draft graph (``runtime/mtp.py``): its index inputs are the step graph's
    (same names, same ranges: ``step_value_ranges``) after the hidden states, and with ``check_ownership``
    its writes into the MTP pools follow the step graph's block ownership rule."""
    values = step_value_ranges(mapping) if check_values else None
    bound = bind_ir(ir, inputs, {}, graph=graph, values=values, check_values=check_values)
    if check_ownership:
        size = _field(mapping, "contract.paged.block_size", int, "state mapping")
        positions, token_rows, table = (inputs[index].tolist() for index in (2, 3, 4))
        check_block_ownership(positions, token_rows, table, size, graph=graph)
    return bound
