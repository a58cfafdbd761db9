"""Executing the saved IR JSON files with torch_ir, fed as a runtime feeds them."""

from __future__ import annotations

import hashlib
import json

import torch

from ..options import ExtractionOptions
from ..runtime import abi as runtime
from ..runtime.symbolic import bind_ir, decode_value_ranges


class Replay:
    """Runs the saved IR files with torch_ir's executor, the way another tool would.

    Every call goes through ``symbolic.bind_ir`` first: inputs the graph was not made for (a prompt
    outside a dynamic range or longer than a static one, a wrong batch, dtype or cache shape, a position
    past the cache) are refused there, before execution, and dynamic sizes are bound to this call's shapes.

    A graph is a pure function of its inputs and weights, and verify's checks feed it the same inputs
    more than once: the states check (``departure.walk``) replays exactly the prefill and greedy decode
    steps the prompt check ran, and a localisation replays them again. ``execute`` therefore keeps each
    call's outputs under the bytes of its inputs and the weights it ran with, and hands a repeated
    call copies of them.
    """

    def __init__(self, options: ExtractionOptions, weights: dict[str, torch.Tensor]) -> None:
        import torch_ir

        self.irs = {kind: torch_ir.load_ir(options.path(kind)) for kind in ("prefill", "decode")}
        mapping = json.loads(options.path("kv_mapping").read_text())
        self.values = {"decode": decode_value_ranges(self.irs["decode"], mapping)}
        self.weights = weights
        self.ranges = options.dynamic_ranges
        self.dtype = getattr(torch, options.dtype)
        self.max_cache_len = options.max_cache_len
        self.paged = options.paged
        self.kv_layout = options.kv_layout or "heads"
        self.kinds = list(options.layer_kinds)  # each layer's kind: the states it takes and returns
        self.layer_roles = [runtime.LAYER_STATES[kind] for kind in self.kinds]
        self.block_table: torch.Tensor | None = None  # paged: the rows' blocks, out of order in the pool
        # outputs of the calls made so far, by graph and input bytes; each entry holds the weights it
        # ran with (a copy of this replay given other weights shares the dict, never its entries)
        self.ran: dict[tuple[str, str], tuple[dict[str, torch.Tensor], list[torch.Tensor]]] = {}

    def execute(self, kind: str, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        import torch_ir

        key = (kind, _digest(inputs))
        held = self.ran.get(key)
        if held is not None and held[0] is self.weights:
            return [tensor.clone() for tensor in held[1]]
        ir = bind_ir(
            self.irs[kind],
            inputs,
            self.ranges,
            graph=kind,
            values=self.values.get(kind),
            max_cache_len=self.max_cache_len,  # a prefill's positions too: its KV fills this cache
        )
        outputs = list(torch_ir.IRExecutor(ir, self.weights).execute(inputs))
        self.ran[key] = (self.weights, [tensor.clone() for tensor in outputs])
        return outputs

    def run_prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Prefill a prompt whose every row is real tokens (no padding)."""
        return self.run_ragged_prefill(prompt, torch.full((prompt.shape[0],), prompt.shape[1]))

    def run_ragged_prefill(
        self, padded: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Prefill rows of ``lengths`` real tokens, right padded to ``padded``'s width: each row's mask
        hides its own pad slots (the KV mapping's padding rule)."""
        logits, present = self.prefill_outputs(padded, lengths)
        return logits, self.place(present, lengths)

    def prefill_outputs(
        self, padded: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The prefill graph's logits and per-layer present KV as it returns them (not yet placed)."""
        _, causal, positions = runtime.prefill_inputs(
            batch=padded.shape[0], prefill_len=padded.shape[1], dtype=self.dtype, device="cpu"
        )
        pad = torch.arange(padded.shape[1]).view(1, 1, 1, -1) >= lengths.view(-1, 1, 1, 1)
        mask = causal.masked_fill(pad, torch.finfo(self.dtype).min)
        logits, *present = self.execute("prefill", (padded, mask, positions))
        return logits, present

    def written_at(self, present: list[torch.Tensor], position: int) -> list[torch.Tensor]:
        """What a decode step wrote at ``position`` in each present cache, ``[B, heads, 1, dim]`` (a paged
        pool read through the rows' block table); a linear layer's states whole (the step rewrote them),
        a compressor's ring whole and its entries closed by then (``(position + 1) // rate``)."""
        written: list[torch.Tensor] = []
        owners = runtime.flat_state_kinds(self.kinds, len(present))
        for tensor, role, kind in zip(present, self.roles(len(present)), owners, strict=True):
            if role in runtime.FIXED_ROLES:
                written.append(tensor)
                continue
            if role in runtime.COMPRESSED_ROLES:  # the entries closed so far (its ring gives the rate)
                written.append(tensor[:, :, : (position + 1) // runtime.compressor_rate(written[-1], kind)])
                continue
            if self.block_table is not None:
                tensor = runtime.paged_view(tensor, self.block_table)
            written.append(tensor[:, :, position : position + 1])
        return written

    def output_name(self, kind: str, index: int) -> str:
        """The name of output ``index`` of the ``kind`` graph (0 is the logits, then key/value by layer)."""
        return str(self.irs[kind].graph_outputs[index].name)

    def place(self, present: list[torch.Tensor], lengths: torch.Tensor) -> list[torch.Tensor]:
        """Prefill KV (rows of ``lengths`` real tokens) as the decode graph takes it: per-row caches,
        or with a paged cache the rows' blocks scattered out of order through the pool."""
        if self.paged is None:
            return runtime.place_prefill_kv(present, self.max_cache_len, self.kinds)
        per_row = self.max_cache_len // self.paged.block_size
        order = torch.randperm(self.paged.num_blocks, generator=torch.Generator().manual_seed(7))
        self.block_table = order[: len(lengths) * per_row].view(len(lengths), per_row)
        pools = [  # a pool per growing state: its heads and dim (keys, values, indexer keys)
            (self.paged.num_blocks, self.paged.block_size, tensor.shape[1], tensor.shape[3])
            for tensor, role in zip(present, self.roles(len(present)), strict=True)
            if role not in (*runtime.FIXED_ROLES, *runtime.COMPRESSED_ROLES)
        ]
        return runtime.place_prefill_kv_paged(present, self.block_table, lengths, pools, self.kinds)

    def roles(self, count: int) -> list[str]:
        """The role of each of ``count`` flat state tensors (``key``, ``conv``, ``index_key``, ...)."""
        return runtime.flat_state_roles(self.kinds, count)

    def join(
        self, states: list[torch.Tensor], row: int, present: list[torch.Tensor], length: int
    ) -> list[torch.Tensor]:
        """``states`` with row ``row`` replaced by its request's prefill outputs ``present`` (``length``
        tokens), the joining-request rule: a linear layer's states taken as they are, an attention
        layer's rows placed into that row's cache (paged: into that row's own blocks)."""
        joined: list[torch.Tensor] = []
        owners = runtime.flat_state_kinds(self.kinds, len(states))
        for tensor, new, role, kind in zip(states, present, self.roles(len(states)), owners, strict=True):
            if role in runtime.COMPRESSED_ROLES:  # per row, never paged (its ring gives the rate)
                tensor = tensor.clone()
                rate = runtime.compressor_rate(joined[-1], kind)
                tensor[row] = runtime.place_compressed(new[row : row + 1], tensor.shape[2] * rate, rate)[0]
            elif role in runtime.FIXED_ROLES:
                tensor = tensor.clone()
                tensor[row] = new[row]
            elif self.block_table is None:
                tensor = tensor.clone()
                tensor[row] = runtime.place_prefill_kv([new[row : row + 1]], self.max_cache_len)[0][0]
            else:
                _, block_size, heads, dim = tensor.shape
                slots = runtime.paged_slots(
                    torch.arange(length), self.block_table[row : row + 1].expand(length, -1), block_size
                )
                flat = tensor.reshape(-1, heads, dim).index_copy(
                    0, slots, new[row, :, :length].transpose(0, 1)
                )
                tensor = flat.view(tensor.shape)
            joined.append(tensor)
        return joined

    def run_decode(
        self, token: torch.Tensor, position: int | torch.Tensor, cache: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list]:
        """One decode step; ``position`` one for every row or ``[B]``, each row's own (ragged)."""
        rows = torch.full((token.shape[0],), position) if isinstance(position, int) else position
        positions = rows.view(-1, 1).to(torch.long)
        mask = runtime.additive_causal_mask(positions, self.max_cache_len, self.dtype)
        table = () if self.block_table is None else (self.block_table,)
        logits, *present = self.execute(
            "decode", (token, mask, positions, positions.view(-1), *table, *cache)
        )
        return logits, present


def _digest(inputs: tuple[torch.Tensor, ...]) -> str:
    """The inputs' dtypes, shapes and bytes, as one digest (two calls with equal digests are one call)."""
    digest = hashlib.blake2b(digest_size=20)
    for tensor in inputs:
        flat = tensor.detach().contiguous()
        digest.update(f"{flat.dtype}{tuple(flat.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return digest.hexdigest()
