"""The multi-token-prediction (MTP) draft graph beside the packed step graph (issue 39 item 3).

DeepSeek-V3 and GLM-4.5 ship ``num_nextn_predict_layers: 1``: one more decoder layer, after the main
stack, that predicts the token after next. transformers (5.23+) builds it as ``MtpModel`` (one
``MtpLayer`` per depth: ``eh_proj(cat(enorm(embed(token)), hnorm(hidden)))``, a decoder layer of the
last layer's class, a post norm, the main model's LM head) and drafts with it in
``MTPCandidateGenerator``. ``MtpWrapper`` is that layer as a packed graph over a paged pool of its own:

``MtpWrapper(hidden_states, input_ids, positions, token_rows, block_table, logit_indices, key, value)``
-> ``(logits, key, value)``:

- ``hidden_states`` ``[T, hidden]``: the main model's final (normed) hidden state at position
  ``positions[t]`` of request ``token_rows[t]`` (the step graph returns them with its logits);
- ``input_ids`` ``[T]``: the token *after* that position (at ``positions[t] + 1``: the main model's
  greedy token for the last position, else the next token of the request);
- ``positions``, ``token_rows``, ``block_table``, ``logit_indices``: as the step graph's; ``positions``
  are the hidden states' positions, so the MTP layer's KV of token ``t`` goes to slot ``positions[t]`` of
  its own pool through the request's row of the same block table, and token ``t`` attends over slots
  ``0..positions[t]`` (transformers' ``MtpCache``: the MTP layer's queries run one position ahead of
  the main model's, its keys are offset by one);
- ``logits`` ``[N, vocab]``: the draft for position ``positions[t] + 2`` of each asked token.

The rotary embedding rotates the token's own position (``positions + 1``), as ``MtpModel`` does. Only
one MTP depth is exported (a second depth chains the first's output, position-shifted again); every
family shipping MTP today has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .abi import KVDims, StaticStateCache, _TextStack, additive_causal_mask, decode_kv_shapes

# The MTP graph's fixed inputs, in order (then its pools: the key and value of its one layer).
MTP_FIXED = ("hidden_states", "input_ids", "positions", "token_rows", "block_table", "logit_indices")


def mtp_refusal(config: Any) -> str | None:
    """Why ``config``'s model has no MTP draft graph under the installed transformers (None: it has one)."""
    import transformers

    try:
        from transformers.modeling_layers import MtpModel  # noqa: F401
    except ImportError:
        return (
            f"transformers {transformers.__version__} has no transformers.modeling_layers.MtpModel (the MTP "
            "module the draft graph is traced from and proven against; 5.23 and later have it)"
        )
    return mtp_layer_refusal(config)


def mtp_layer_refusal(config: Any) -> str | None:
    """Why ``config`` states no MTP layer the draft graph can export (None: exactly one), whatever the
    installed transformers: what decides whether a generated module carries the MTP graph at all."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    count = getattr(text, "num_mtp_layers", None)
    if not count:
        return (
            f"the {text.model_type} config has no MTP layers (num_nextn_predict_layers / num_mtp_layers is "
            f"{count!r}): there is no draft module to export; drafts for it come from elsewhere (n-gram, a "
            "draft model), verified in the step graph"
        )
    if count != 1:
        return f"the config has {count} MTP layers: only one depth is exported (a second chains the first)"
    return None


def mtp_model(main_model: nn.Module) -> nn.Module:
    """transformers' ``MtpModel`` of ``main_model``, built on ``main_model``'s device (meta: no weights),
    its embeddings, rotary embedding and LM head the main model's own."""
    from transformers.modeling_layers import MtpModel

    device = next(main_model.parameters()).device
    with torch.device(device):
        return MtpModel(main_model, main_model.config.get_text_config().num_mtp_layers).eval()


class MtpWrapper(_TextStack):
    """One MTP depth as a packed graph over its paged pool (module docstring)."""

    def __init__(
        self, mtp: nn.Module, *, kv_layout: str, cache_keyword: str, mla_attention: str = "reexpand"
    ) -> None:
        if getattr(mtp, "has_per_layer_rope", False):
            raise ValueError("the MTP layer takes a per-layer-type rope, which the MTP graph does not pass")
        layer = mtp.layers[0]
        norm = layer.post_norm if layer.use_post_norm else getattr(mtp, "shared_post_norm", None)
        super().__init__(
            mtp.embed_tokens,
            [layer.mtp_block],
            norm,
            mtp.rotary_emb,
            mtp.shared_head,
            kv_layout=kv_layout,
            cache_keyword=cache_keyword,
            mla_attention=mla_attention,
        )
        self.enorm, self.hnorm, self.eh_proj = layer.enorm, layer.hnorm, layer.eh_proj
        self.hidden_first = bool(getattr(mtp.config, "mtp_hidden_states_first", False))
        self._logit_indices: torch.Tensor | None = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_rows: torch.Tensor,
        block_table: torch.Tensor,
        logit_indices: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        slots = positions.view(-1, 1)
        mask = additive_causal_mask(slots, block_table.shape[1] * key.shape[1], key.dtype)
        rows = block_table.index_select(0, token_rows)
        cache = StaticStateCache(self.kv_layout, self.layer_ids, [(key, value)], positions, rows)
        embeds = self.embed_tokens(input_ids.view(-1, 1))
        previous = hidden_states.view(-1, 1, hidden_states.shape[-1])
        parts = (self.hnorm(previous), self.enorm(embeds))
        projected = self.eh_proj(torch.cat(parts if self.hidden_first else parts[::-1], dim=-1))
        self._logit_indices = logit_indices
        try:
            logits, *present = self._stack(projected, mask, slots + 1, cache)
        finally:
            self._logit_indices = None
        return (logits[:, -1], *present)

    def head_rows(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Only the tokens ``logit_indices`` names reach the post norm and the LM head."""
        assert self._logit_indices is not None, "head_rows runs inside forward"
        return hidden_states.index_select(0, self._logit_indices)


def mtp_inputs(
    step_example: Sequence[torch.Tensor],
    kv_dims: KVDims,
    *,
    hidden_size: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """Example MTP inputs: the step graph's example index inputs (``step_example``, ``step.step_inputs``:
    the draft graph is fed the step's positions, rows, block table and asked tokens), zero hidden states
    and one zeroed paged pool (key, value)."""
    ids, positions, token_rows, table, indices = step_example[:5]
    key_shape, value_shape = decode_kv_shapes(kv_dims, 1, 1, (block_size, num_blocks))
    hidden = torch.zeros(ids.shape[0], hidden_size, dtype=dtype, device=ids.device)
    pools = (
        torch.zeros(key_shape, dtype=dtype, device=ids.device),
        torch.zeros(value_shape, dtype=dtype, device=ids.device),
    )
    return hidden, ids, positions, token_rows, table, indices, *pools


def mtp_mapping(
    *,
    graph: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    hidden_size: int,
    hidden_output: str,
    tokens: int,
    rows: int,
    blocks_per_row: int,
    logit_count: int,
    pools: Sequence[dict[str, Any]],
    layer: int,
    dtype: str,
) -> dict[str, Any]:
    """The state mapping's ``mtp`` section: the draft graph's inputs, its pool entries (shape and dtype,
    paged like the main pools through the same block table) and the drafting rule."""
    hidden, ids, positions, token_rows, table, indices = inputs
    shapes = {hidden: [tokens, hidden_size], ids: [tokens], positions: [tokens], token_rows: [tokens]}
    shapes.update({table: [rows, blocks_per_row], indices: [logit_count]})
    return {
        "graph": graph,
        "checkpoint_layer": layer,
        "inputs": [
            {"name": name, "shape": shape, "dtype": dtype if name == hidden else "int64"}
            for name, shape in shapes.items()
        ],
        "pools": list(pools),
        "logits": {"name": outputs[0], "shape": [logit_count, "vocab"], "row_i": f"the token {indices}[i]"},
        "rule": f"{hidden}[t] is the step graph's {hidden_output} row of the token at position "
        f"{positions}[t] of request {token_rows}[t] (row {token_rows}[t] of {table}, the step graph's block "
        f"table), {ids}[t] the token at position {positions}[t] + 1 of that request (the main "
        "model's greedy token after its last position). Its KV goes to slot "
        f"{positions}[t] of the MTP pools (contract.paged's slot rule, the request's own blocks), and it "
        f"attends over slots 0..{positions}[t]: every position of a request must be fed once (prompt "
        "positions included), in order, before a draft is read. Logits row i drafts the token at "
        f"position {positions}[{indices}[i]] + 2. Draft from the last accepted position; after a "
        "verification, feed the positions accepted since (rejected positions are overwritten later)",
    }
