"""A reference serving engine written from kadapt's state mapping alone: continuous batching with
chunked prefill into the paged pool, prefix reuse and greedy decode, driving the packed step graph
(``<prefix>_step_ir.json``, ``abi.step``), with speculative decoding: drafts from the model's MTP draft
graph (``<prefix>_mtp_ir.json``, ``abi.step.mtp``) or from any cheap proposer (n-gram), verified ``k + 1``
tokens at a time in the same step calls.

It is the loop a vLLM- or SGLang-style runtime runs, kept small enough to read in one sitting, and the
test of the contract (``tests/test_reference_engine.py`` serves a seeded trace of requests through it
and holds every request's tokens to transformers' ``generate()``). It knows the model only through
the mapping: ``step`` (the graph's inputs and their order), ``contract.paged`` (block size, blocks per
row, pool size, the slot rule and the sharing rule) and the pools' shapes and dtypes in ``layers``.
How a call is executed is the caller's (``execute``: torch_ir's executor on a bound IR, the generated
module's ``run_graph``, or a compiled graph), so the engine imports neither kadapt nor transformers.

Each step packs, within the graph's token and logits budgets: one decode token of every request that
is decoding, then prefill chunks of the requests still reading their prompts (oldest first), then
newly arrived requests that get a free block-table row. A prompt's full blocks are registered in a
prefix cache once written (keyed by every token up to the block's end); a later request whose prompt
starts with them points its block table at them (read-only, reference-counted) and prefills only the
rest - at least its last prompt token, whose logits pick its first output token. A request's own
blocks come from a free list as it reaches them and go back when it finishes; a cached block goes back
when no request reads it. Unused tokens of a call go to a scratch row whose only block no request
owns.

Speculative decoding: a decoding request with drafts puts its last token and its ``k`` drafts in the step
(consecutive positions) and asks every one's logits; the longest prefix of drafts the greedy tokens
confirm is accepted, plus the token after it. Rewind is not advancing: ``computed`` moves past the
accepted tokens only, and the KV a rejected draft wrote is overwritten by the next call. With the MTP graph
(``mtp`` section), every position the main model verified - each prompt position too, so prefill chunks
ask every token's logits and final hidden state - is fed to it after the call (the hidden state, and the
token after it), and its row for the request's last position is the next draft. Its pools are paged
through the same block table, so a prefix block shared from the cache carries its MTP KV too; that KV
depends on the token after the block, so with the MTP graph a cached block is keyed one token further.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Execute = Callable[[tuple[torch.Tensor, ...]], Sequence[torch.Tensor]]  # call -> (logits, *pools)
Proposer = Callable[[list[int], int], list[int]]  # (a request's tokens, at most k) -> speculative tokens
Chunk = tuple["Request", int, list[int], int]  # (request, first position, tokens, trailing logits asked)


@dataclass
class Request:
    """One request of a trace: its prompt, how many tokens to generate, and the step it arrives at."""

    prompt: list[int]
    max_new: int
    arrival: int
    output: list[int] = field(default_factory=list)
    row: int | None = None  # its block-table row while it runs
    blocks: list[int] = field(default_factory=list)  # its logical blocks' physical ids
    shared: int = 0  # how many leading blocks are prefix-cache blocks it only reads
    computed: int = 0  # tokens whose KV its blocks hold
    draft: list[int] = field(default_factory=list)  # speculative tokens its next step verifies
    drafts: list[tuple[int, int]] = field(default_factory=list)  # (position, token) of every draft made

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new


class ReferenceEngine:
    """Serves requests through the packed step graph described by ``mapping`` (see the module
    docstring); ``execute`` runs one call's inputs and returns ``(logits, *pools)`` (``(logits, hidden,
    *pools)`` for a step graph that feeds an MTP graph). Drafts come from ``mtp`` (the MTP graph's call
    -> ``(logits, *pools)``) or ``propose`` (up to ``speculative`` tokens per step)."""

    def __init__(
        self,
        mapping: dict[str, Any],
        execute: Execute,
        *,
        mtp: Execute | None = None,
        propose: Proposer | None = None,
        speculative: int = 1,
    ) -> None:
        step, paged = mapping["step"], mapping["contract"]["paged"]
        shapes = {entry["name"]: entry["shape"] for entry in step["inputs"]}
        ids, _, _, table, indices = (entry["name"] for entry in step["inputs"])
        self.tokens, self.logit_rows = shapes[ids][0], shapes[indices][0]
        self.rows, self.per_row = shapes[table]
        self.block_size, self.num_blocks = paged["block_size"], paged["num_blocks"]
        pools = [e for layer in mapping["layers"] for key, e in layer.items() if key.endswith("_input")]
        self.pools = [torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"])) for e in pools]
        self.execute = execute
        self.scratch_row = self.rows - 1
        self.scratch_block, *free = range(self.num_blocks)
        self.free: list[int] = free[::-1]  # popped from the end: block 1 first
        self.cached: dict[tuple[int, ...], int] = {}  # prompt prefix up to a block's end -> its block
        self.readers: dict[int, int] = {}  # cached block -> requests reading it
        self.steps = 0
        self.shared_blocks = 0  # blocks a request read from the prefix cache instead of computing
        self.hidden = "hidden_states" in step  # the step graph returns final hidden states after logits
        self.mtp, self.propose, self.speculative = mtp, propose, speculative
        if mtp is not None:
            if "mtp" not in mapping or not self.hidden:
                raise ValueError("the state mapping has no MTP graph (abi.step.mtp)")
            draft_pools = mapping["mtp"]["pools"]
            self.mtp_pools = [torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"])) for e in draft_pools]
            self.hidden_size = mapping["mtp"]["inputs"][0]["shape"][1]
        self.extra = int(mtp is not None)  # a cached block's key reaches this many tokens past its end
        self.drafted = self.accepted = 0  # speculative tokens verified, and those that held

    # -- blocks ----------------------------------------------------------------------------------
    def _admit(self, request: Request, row: int) -> None:
        """Give ``request`` a row and the prefix-cache blocks its prompt starts with (keeping at least
        its last prompt token to compute)."""
        request.row = row
        size = self.block_size
        for end in range(size, len(request.prompt), size):  # full blocks before the last prompt token
            block = self.cached.get(tuple(request.prompt[: end + self.extra]))
            if block is None:
                break
            request.blocks.append(block)
            self.readers[block] += 1
        request.shared = request.computed = len(request.blocks)
        request.computed *= size
        self.shared_blocks += request.shared

    def _reach(self, request: Request, position: int) -> None:
        """Take blocks from the free list until ``request`` holds ``position``'s."""
        while len(request.blocks) <= position // self.block_size:
            if not self.free:
                raise RuntimeError("the pool is out of blocks: size it larger (--num-blocks)")
            request.blocks.append(self.free.pop())

    def _register(self, request: Request) -> None:
        """Put ``request``'s written, full prompt blocks it owns into the prefix cache."""
        size = self.block_size
        for index in range(request.shared, min(request.computed, len(request.prompt) - self.extra) // size):
            key = tuple(request.prompt[: (index + 1) * size + self.extra])
            if key not in self.cached:
                block = request.blocks[index]
                self.cached[key], self.readers[block] = block, 1
                request.shared = index + 1  # now read-only: another request may read it
            else:
                break

    def _release(self, request: Request) -> None:
        """Return ``request``'s own blocks; drop a cached block no request reads any more."""
        for index, block in enumerate(request.blocks):
            if index >= request.shared:
                self.free.append(block)
                continue
            self.readers[block] -= 1
            if self.readers[block] == 0:
                del self.readers[block]
                key = next(k for k, b in self.cached.items() if b == block)
                del self.cached[key]
                self.free.append(block)
        request.blocks, request.row = [], None

    # -- steps -----------------------------------------------------------------------------------
    def _plan(self, running: list[Request]) -> list[Chunk]:
        """This step's chunks: decode tokens (with their drafts) first, then prefill chunks, within the
        token and logits budgets. With the MTP graph a prefill chunk asks every token's logits (their
        hidden states feed it), otherwise only a prompt's last token's."""
        tokens, logits, plan = self.tokens, self.logit_rows, []
        for request in running:  # decoding: its next token and its drafts, every one's logits
            if request.computed >= len(request.prompt) and min(tokens, logits):
                chunk = [request.tokens[request.computed], *request.draft[: min(tokens, logits) - 1]]
                plan.append((request, request.computed, chunk, len(chunk)))
                tokens, logits = tokens - len(chunk), logits - len(chunk)
        for request in running:  # prefilling: the next chunk of its prompt
            left = len(request.prompt) - request.computed
            if left > 0 and tokens and (left > tokens or logits) and (self.mtp is None or logits):
                count = min(left, tokens, logits if self.mtp is not None else tokens)
                wanted = count if self.mtp is not None else int(count == left)
                plan.append((request, request.computed, request.prompt[request.computed :][:count], wanted))
                tokens, logits = tokens - count, logits - wanted
        return plan

    def _pack(self, chunks: list[tuple[Request, int, list[int], int]]) -> tuple[torch.Tensor, ...]:
        """``(input_ids, positions, token_rows, block_table, logit_indices)`` of ``chunks``: each chunk's
        tokens at consecutive positions of its request, the logits of its last ``n`` tokens asked."""
        table = torch.full((self.rows, self.per_row), self.scratch_block, dtype=torch.long)
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        indices: list[int] = []
        for request, start, tokens, wanted in chunks:
            assert request.row is not None
            self._reach(request, start + len(tokens) - 1)
            table[request.row, : len(request.blocks)] = torch.tensor(request.blocks)
            ids += tokens
            positions += range(start, start + len(tokens))
            rows += [request.row] * len(tokens)
            indices += range(len(ids) - wanted, len(ids))
        pad = self.tokens - len(ids)
        return (
            torch.tensor(ids + [0] * pad),
            torch.tensor(positions + [0] * pad),
            torch.tensor(rows + [self.scratch_row] * pad),
            table,
            torch.tensor(indices + [0] * (self.logit_rows - len(indices))),
        )

    def _verify(
        self, plan: list[Chunk], logits: torch.Tensor, hidden: torch.Tensor | None
    ) -> list[tuple[Chunk, torch.Tensor]]:
        """Advance each chunk's request by what the step verified; with ``hidden``, what the MTP graph is
        fed: each request's verified positions, the tokens after them (a chunk) and their hidden states."""
        feeds, row = [], 0
        for request, start, tokens, wanted in plan:
            picks = [int(row_logits.argmax()) for row_logits in logits[row : row + wanted]]
            if start >= len(request.prompt):  # a decode token and its drafts: the longest held prefix
                held = 0
                while held < len(tokens) - 1 and picks[held] == tokens[held + 1]:
                    held += 1
                self.drafted, self.accepted = self.drafted + len(tokens) - 1, self.accepted + held
                request.output += picks[: held + 1]
                request.computed = fed = start + held + 1
            else:  # a prefill chunk: the token after the prompt once its last chunk ran
                request.computed = fed = start + len(tokens)
                if request.computed == len(request.prompt):
                    request.output.append(picks[-1])
            request.output, request.draft = request.output[: request.max_new], []
            if hidden is not None:  # each verified position, the token after it, its hidden state
                after = request.tokens[start + 1 : fed + 1]
                feeds.append(((request, start, after, 1), hidden[row : row + len(after)]))
            row += wanted
        return feeds

    def _draft(self, running: list[Request], feeds: list[tuple[Chunk, torch.Tensor]]) -> None:
        """Each decoding request's drafts for its next step: the MTP graph's row for its last fed position
        (after feeding it every verified position), or the proposer's tokens."""
        capacity = self.per_row * self.block_size  # positions a row's blocks hold
        room = {id(r): min(r.max_new - len(r.output) - 1, capacity - 1 - r.computed) for r in running}
        if self.mtp is not None and feeds:
            fed = torch.cat([rows for _, rows in feeds])
            hidden = torch.cat([fed, fed.new_zeros(self.tokens - len(fed), self.hidden_size)])
            logits, *self.mtp_pools = self.mtp((hidden, *self._pack([c for c, _ in feeds]), *self.mtp_pools))
            for index, ((request, *_), _) in enumerate(feeds):
                if request.computed >= len(request.prompt) and room[id(request)] > 0:
                    request.draft = [int(logits[index].argmax())]
        elif self.propose is not None:
            for request in running:
                if request.computed >= len(request.prompt) and room[id(request)] > 0:
                    request.draft = self.propose(request.tokens, min(self.speculative, room[id(request)]))
        for request in running:
            request.drafts += [(len(request.tokens) + i, token) for i, token in enumerate(request.draft)]

    def serve(self, requests: Sequence[Request], max_steps: int = 10_000) -> int:
        """Serve ``requests`` to completion (each arrives at its ``arrival`` step); the steps taken."""
        waiting = sorted(requests, key=lambda r: r.arrival)
        running: list[Request] = []
        while waiting or running:
            if self.steps >= max_steps:
                raise RuntimeError(f"not done after {max_steps} steps")
            free_rows = sorted(set(range(self.scratch_row)) - {r.row for r in running})
            while waiting and waiting[0].arrival <= self.steps and free_rows:
                request = waiting.pop(0)
                self._admit(request, free_rows.pop(0))
                running.append(request)
            plan = self._plan(running)
            if plan:
                logits, *rest = self.execute((*self._pack(plan), *self.pools))
                hidden, self.pools = (rest[0], rest[1:]) if self.hidden else (None, rest)
                feeds = self._verify(plan, logits, hidden if self.mtp is not None else None)
                self._draft(running, feeds)
                for request, *_ in plan:
                    self._register(request)
                for request in [r for r in running if r.done]:
                    running.remove(request)
                    self._release(request)
            self.steps += 1
        return self.steps


def ngram_proposer(n: int = 2) -> Proposer:
    """Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the request's last
    ``n`` tokens (else of fewer, down to one), else the last token repeated: free, and right whenever the
    text repeats itself."""

    def propose(tokens: list[int], count: int) -> list[int]:
        for size in range(min(n, len(tokens) - 1), 0, -1):
            tail = tokens[-size:]
            for start in range(len(tokens) - size - 1, -1, -1):
                if tokens[start : start + size] == tail:
                    return tokens[start + size : start + size + count]
        return tokens[-1:] * count

    return propose
