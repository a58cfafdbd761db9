"""The mixed step graph: one call over the packed tokens of every scheduled request (issue 39).

What a vLLM- or SGLang-style engine runs each step: prefill chunks, single decode tokens and ``k + 1``
speculative tokens of different requests packed into one ``[T]`` token vector, each token at its own
position, reading and writing the paged KV pool through the block table, logits only for the tokens the
engine asks for.

``StepWrapper(input_ids, positions, token_rows, block_table, logit_indices, past.0.key, ...)``
-> ``(logits, present.0.key, ...)``:

- ``input_ids`` ``[T]``: the tokens of every request this step, packed (no padding between requests);
- ``positions`` ``[T]``: each token's position in its request (``0..max_cache_len-1``);
- ``token_rows`` ``[T]``: each token's request, a row of ``block_table``;
- ``block_table`` ``[R, max_cache_len / block_size]``: each request's physical blocks, as in paged decode;
- ``logit_indices`` ``[N]``: the tokens (indices into ``T``) whose logits the engine wants (a chunk's
  last token, a decode token, every speculative token to verify);
- the pools ``[num_blocks, block_size, heads, dim]`` of paged decode; ``logits`` is ``[N, vocab]``.

With ``hidden_states`` (an MTP draft graph beside it) the asked tokens' final normed hidden states
``[N, hidden]`` follow the logits; with ``aux_layers`` (an EAGLE-3 draft's features) then their hidden
states after each of those decoder layers, concatenated in layer order: ``[N, len(aux_layers) * hidden]``.
Layer ``i``'s is the residual stream decoder layer ``i`` hands on, transformers' ``hidden_states[i + 1]``
(for the last layer before the final norm, where transformers' ``hidden_states[-1]`` is after it); vLLM's
``eagle_aux_hidden_state_layer_ids`` counts the state entering a layer (``i + 1`` there, 0 the embeddings).

Why it is cheap: the paged decode graph already writes every row's new key and value into the pool
(``paged_write``, one ``index_copy``) before any row reads its blocks back (``paged_view``). So a step
is a paged decode in which each token is a row of its own, whose block-table row is its request's:
after the write, the pool holds every token of this step, and a token at position ``p`` attends over
its request's slots ``0..p`` (``additive_causal_mask`` by position, computed in the graph): what the
request cached before, and the tokens of this step before it. A prompt prefilled in chunks then equals
a one-shot prefill, and ``k + 1`` speculative tokens are verified in one call.

The engine's part (the contract): a request's tokens are at consecutive positions continuing what its
blocks already hold, so every slot ``<= p`` is written; no two tokens write one slot; a block written
this step belongs to that request alone (prefix blocks shared between requests are read-only: the
binder's ownership check, ``step_bind``). Sizes are static: an engine with fewer tokens pads with
tokens of a request whose block-table row points at a scratch block no live request owns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .abi import (
    KVDims,
    ResidualStreams,
    StaticStateCache,
    _TextStack,
    additive_causal_mask,
    decode_inputs,
    per_layer_states,
)

# The step graph's fixed inputs, in order (then the pools, as paged decode's).
STEP_FIXED = ("input_ids", "positions", "token_rows", "block_table", "logit_indices")
# Layer kinds whose state a step can write token by token into the pool: the attention caches (and the
# KV-less MLP blocks). A linear mixer's fixed-size state takes a request's tokens in order as one scan,
# which a packed step of independent token rows cannot give it; a KV-sharing layer reads keys another
# layer computed in the same call for the same query rows.
STEP_KINDS = ("attention", "indexed", "none")


def step_refusal(kinds: Sequence[str]) -> str | None:
    """Why a stack of these layer kinds has no step graph (None: it has one)."""
    for layer, kind in enumerate(kinds):
        if kind not in STEP_KINDS:
            what = "shares another layer's KV" if kind == "shared" else f"keeps {kind} state"
            return (
                f"layer {layer} {what}: the packed step graph writes attention KV token by token into the "
                f"paged pool, and reads only layers of kinds {', '.join(STEP_KINDS)}"
            )
    return None


class StepWrapper(_TextStack):
    """The packed step over a paged pool (module docstring): each token a decode row of its request."""

    def __init__(
        self, *args: Any, hidden_states: bool = False, aux_layers: Sequence[int] = (), **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        refusal = step_refusal(self.kinds) or aux_refusal(aux_layers, len(self.layers), self.streams)
        if refusal is not None:
            raise ValueError(refusal)
        self.hidden_states = hidden_states  # also return the asked tokens' final hidden states (MTP)
        self.aux_layers = tuple(aux_layers)  # and their hidden states after these layers (EAGLE-3)
        self._logit_indices: torch.Tensor | None = None
        self._aux: list[torch.Tensor] = []  # the aux layers' outputs, while forward runs

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_rows: torch.Tensor,
        block_table: torch.Tensor,
        logit_indices: torch.Tensor,
        *pools: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        past = per_layer_states(pools, self.kinds)
        key_length = block_table.shape[1] * pools[0].shape[1]  # max_cache_len: blocks of block_size
        position_ids = positions.view(-1, 1)
        mask = additive_causal_mask(position_ids, key_length, pools[0].dtype)
        cache = StaticStateCache(
            self.kv_layout,
            self.layer_ids,
            past,
            positions,
            block_table.index_select(0, token_rows),  # each token's row: its request's blocks
            kinds=self.kinds,
        )
        self._logit_indices = logit_indices
        try:
            outputs = self._run(input_ids.view(-1, 1), mask, position_ids, cache)
        finally:
            self._logit_indices, self._aux = None, []
        # logits [N, vocab], then the final hidden states [N, hidden] and the aux layers' [N, k * hidden]
        heads = 1 + self.hidden_states + bool(self.aux_layers)
        return (*(output[:, -1] for output in outputs[:heads]), *outputs[heads:])

    def layer_output(self, position: int, hidden_states: torch.Tensor) -> None:
        """Keep the output of an aux layer (``[T, 1, hidden]``: every token's, the asked rows are taken
        after the stack)."""
        if position in self.aux_layers:
            self._aux.append(hidden_states)

    def head_rows(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Only the tokens ``logit_indices`` names reach the norm and the LM head (``[N, 1, hidden]``)."""
        assert self._logit_indices is not None, "head_rows runs inside forward"
        return hidden_states.index_select(0, self._logit_indices)

    def head_outputs(self, logits: torch.Tensor, normed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The logits, with ``hidden_states`` the final normed hidden states an MTP module reads
        (transformers' ``hidden_states[-1]``: the last hidden state after the final norm), with
        ``aux_layers`` the asked rows of those layers' outputs, concatenated (an EAGLE-3 draft's ``fc``
        input)."""
        aux = (torch.cat([self.head_rows(kept) for kept in self._aux], dim=-1),) if self.aux_layers else ()
        return (logits, *((normed,) if self.hidden_states else ()), *aux)


def aux_refusal(aux_layers: Sequence[int], num_layers: int, streams: ResidualStreams | None) -> str | None:
    """Why a step graph over ``num_layers`` traced layers cannot return these aux layers (None: it can)."""
    outside = [layer for layer in aux_layers if not 0 <= layer < num_layers]
    if outside:
        return f"aux layers {outside} are not among the {num_layers} layers the step graph runs"
    if aux_layers and streams is not None:
        return (
            "aux layers of a stack with residual streams (hyper-connections): its layers hand on several "
            "streams, and which hidden state an EAGLE-3 draft reads of them is not defined"
        )
    return None


def step_inputs(
    kv_dims: KVDims,
    *,
    tokens: int,
    rows: int,
    logits: int,
    block_size: int,
    num_blocks: int,
    max_cache_len: int,
    kinds: Sequence[str],
    dtype: torch.dtype,
    device: str | torch.device = "meta",
    index_dim: int | None = None,
    layer_kv_dims: Sequence[KVDims] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Example step inputs: ``tokens`` tokens dealt round-robin to ``rows`` requests at consecutive
    positions, a block table giving the rows blocks in order (wrapping around the pool), logits of the
    last ``logits`` tokens, and zeroed pools."""
    token_rows = torch.arange(tokens, device=device).remainder(rows)
    positions = torch.div(torch.arange(tokens, device=device), rows, rounding_mode="floor")
    indices = torch.arange(tokens - logits, tokens, device=device)
    # The block table and pools are the paged decode graph's: its example inputs, without the
    # per-row token, mask and positions a step replaces with its packed ones.
    _ids, _mask, _positions, _cache_position, table, *pools = decode_inputs(
        kv_dims,
        batch=rows,
        position=0,
        max_cache_len=max_cache_len,
        num_layers=len(kinds),
        dtype=dtype,
        device=device,
        paged=(block_size, num_blocks),
        kinds=kinds,
        index_dim=index_dim,
        layer_kv_dims=layer_kv_dims,
    )
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    return ids, positions, token_rows, table, indices, *pools


def step_mapping(
    *,
    graph: str,
    inputs: Sequence[str],
    logits: str,
    tokens: int,
    rows: int,
    logit_count: int,
    max_cache_len: int,
    block_size: int,
    placeholder_token_id: int | None = None,
    hidden: tuple[str, int] | None = None,
    aux: tuple[str, Sequence[int], int] | None = None,
) -> dict[str, Any]:
    """The state mapping's ``step`` section: the packed step graph's fixed inputs and its rules (the pools
    are the paged decode graph's, ``contract.paged``); with ``placeholder_token_id`` (a multimodal spec's
    image placeholder) the token its ids may not hold; with ``hidden`` (its name and width: a step graph
    feeding the MTP draft graph) the final hidden states it returns after the logits; with ``aux`` (its
    name, the layers and the hidden width: ``abi.step.aux_layers``) the layers' hidden states after those."""
    ids, positions, token_rows, table, indices = inputs
    shapes = {ids: [tokens], positions: [tokens], token_rows: [tokens]}
    shapes.update({table: [rows, max_cache_len // block_size], indices: [logit_count]})
    placeholder = (
        {
            "placeholder_token_id": placeholder_token_id,
            "placeholder_rule": f"{ids} never holds {placeholder_token_id}: the step graph embeds token "
            "ids, so an image placeholder would get no image features; a prompt with images is prefilled "
            "by the merged prefill graph (merged_prefill), whose KV the runtime places in the pool, and "
            "continues here",
        }
        if placeholder_token_id is not None
        else {}
    )
    return {
        "graph": graph,
        "inputs": [{"name": name, "shape": shape, "dtype": "int64"} for name, shape in shapes.items()],
        "logits": {"name": logits, "shape": [logit_count, "vocab"], "row_i": f"the token {indices}[i]"},
        **(
            {
                "hidden_states": {
                    "name": hidden[0],
                    "shape": [logit_count, hidden[1]],
                    "row_i": f"the token {indices}[i]'s final hidden state (after the final norm: "
                    "what the MTP draft graph reads)",
                }
            }
            if hidden is not None
            else {}
        ),
        **(
            {
                "aux_hidden_states": {
                    "name": aux[0],
                    "layers": list(aux[1]),
                    "shape": [logit_count, len(aux[1]) * aux[2]],
                    "row_i": f"the token {indices}[i]'s hidden states after decoder layers {list(aux[1])}, "
                    f"concatenated in that order ({aux[2]} columns each): layer l's is the residual stream "
                    "decoder layer l hands on (transformers' hidden_states[l + 1]; the last layer's before "
                    "the final norm), what an EAGLE-3 draft reads",
                }
            }
            if aux is not None
            else {}
        ),
        "pools": "the paged decode graph's KV inputs and outputs, in its order (contract.paged)",
        "rule": f"{ids}[t] is token t of the call, at position {positions}[t] of request {token_rows}[t], "
        f"whose blocks are row {token_rows}[t] of {table} (contract.paged's slot rule). The graph writes "
        "every token's KV into the pools, then each token attends over its request's slots 0..its "
        "position: a request's tokens in one call must be at consecutive positions continuing what its "
        "blocks hold (a prefill chunk, one decode token, or k+1 speculative tokens), no two tokens may "
        "write one slot, and a block written in the call must be its request's alone (contract.paged."
        f"sharing). Logits row i is the token {indices}[i]'s. Unused tokens: a request whose block-table "
        "row points at a scratch block no live request owns",
        **placeholder,
    }
