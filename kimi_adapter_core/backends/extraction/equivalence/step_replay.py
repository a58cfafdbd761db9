"""``--verify`` of the packed step graph (``abi.step``): replayed the way a serving engine feeds it.

The step graph is what an engine runs most, and its claim is the strongest: any mix of prompt chunks,
decode tokens and requests at their own positions, read and written through a block table, gives each
request transformers' own logits. So verify drives it as an engine does: the verify prompt's rows but
the last are requests of different lengths (the ragged check's), each call packs the decoding requests'
next tokens first, then prompt chunks within the call's token and logits budgets; blocks come out of
order from the pool; unused tokens go to the last block-table row, a scratch row whose blocks no request
owns (the state mapping's rule). Every call is bound through ``bind_step`` with the ownership check on.
Each request's greedy tokens must equal ``generate`` on its prompt alone, and every logits row asked
for must be within the tolerance of generate's at that position. A step graph returning aux layers'
hidden states (``abi.step.aux_layers``) has each asked row of them compared with transformers'
``hidden_states[i + 1]`` of the request's tokens (untied from the final norm: the last layer's output).

A step graph of one block-table row (``--batch 1``) has no scratch row for unused tokens, so it cannot
be fed as an engine feeds it; verify says so instead of claiming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch import nn

from ..ir.export import step_example
from ..options import ExtractionOptions
from ..runtime import step as runtime_step
from ..runtime.step_bind import bind_step
from .comparisons import rows_against_generate
from .tolerance import Tolerance, compare
from .verdict import VerifyReport

NO_SCRATCH_ROW = (
    "the step graph is not replayed: its block table has one row, so a call's unused tokens have no "
    "scratch row to go to (export with --batch 2 or more to have it checked as an engine feeds it)"
)


@dataclass
class _Request:
    prompt: list[int]
    row: int
    fed: int = 0  # tokens whose KV the pool holds
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    aux: list[torch.Tensor] = field(default_factory=list)  # the asked rows' aux hidden states


def compare_step(
    report: VerifyReport,
    model: nn.Module,
    options: ExtractionOptions,
    weights: dict[str, torch.Tensor],
    prompt: torch.Tensor,
    *,
    steps: int,
    tolerance: Tolerance,
    suffix: str,
) -> None:
    """Serve the requests of ``prompt``'s rows (all but the last) through the saved step graph until
    each has ``steps + 1`` tokens, and compare them with ``generate`` (see the module docstring)."""
    import torch_ir

    step, paged = options.step, options.paged
    assert step is not None and paged is not None, "the step graph reads a paged pool"
    if step.rows < 2:
        report.notes.append(NO_SCRATCH_ROW)
        return
    width = prompt.shape[1]
    lengths = [max(1, width - 2 * row) for row in range(step.rows - 1)]
    requests = [_Request(prompt[row, :length].tolist(), row) for row, length in enumerate(lengths)]
    ir = torch_ir.load_ir(str(options.path("step")))
    mapping = json.loads(options.path("kv_mapping").read_text())
    example = step_example(options, len(options.layer_kinds), "cpu")
    pools = list(example[len(runtime_step.STEP_FIXED) :])
    per_row = options.max_cache_len // paged.block_size
    order = torch.randperm(paged.num_blocks, generator=torch.Generator().manual_seed(7))
    table = order[: step.rows * per_row].view(step.rows, per_row)  # blocks out of order in the pool
    heads = len(step.names.heads)  # the logits (and hidden states), then the pools
    calls = mixed = 0
    while any(len(r.output) <= steps for r in requests):
        plan = _plan(requests, step.tokens, step.logits, steps)
        ids, positions, rows, indices, wanted = [], [], [], [], []
        for request, count in plan:
            sequence = request.prompt + request.output
            for position in range(request.fed, request.fed + count):
                ids.append(sequence[position])
                positions.append(position)
                rows.append(request.row)
            if request.fed + count >= len(request.prompt):  # its last prompt token, or a decode token
                indices.append(len(ids) - 1)
                wanted.append(request)
        pad = step.tokens - len(ids)
        call = (
            torch.tensor(ids + [0] * pad),
            torch.tensor(positions + [0] * pad),
            torch.tensor(rows + [step.rows - 1] * pad),
            table,
            torch.tensor(indices + [0] * (step.logits - len(indices))),
            *pools,
        )
        bound = bind_step(ir, call, mapping, check_ownership=True)
        outputs = torch_ir.IRExecutor(bound, weights).execute(call)
        logits, pools = outputs[0].reshape(step.logits, -1), outputs[heads:]
        aux = outputs[heads - 1] if step.aux_layers else None  # the last output before the pools
        for request, count in plan:
            request.fed += count
        for index, request in enumerate(wanted):
            request.logits.append(logits[index : index + 1])
            request.output.append(int(logits[index].argmax()))
            if aux is not None:
                request.aux.append(aux[index])
        calls += 1
        mixed += len({count > 1 for _, count in plan}) > 1
    ours = [(torch.tensor([r.output]), r.logits) for r in requests]
    prompts = [torch.tensor([r.prompt]) for r in requests]
    passed, detail = rows_against_generate(model, prompts, ours, steps, tolerance)
    if step.aux_layers:
        close = compare(_aux_pairs(model, requests, step.aux_layers), tolerance)
        passed = passed and close.passed
        detail += f"; aux hidden states of layers {list(step.aux_layers)} {close.detail()}"
    report.add(
        f"step graph{suffix}",
        passed,
        f"{len(requests)} requests of lengths {lengths} in {calls} calls of {step.tokens} tokens ({mixed} "
        f"mixing prompt chunks with decode tokens), blocks out of order, ownership checked: {detail}",
    )


def _aux_pairs(
    model: nn.Module, requests: list[_Request], layers: tuple[int, ...]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each request's asked aux rows (its last prompt position, then each decode position) beside
    transformers' ``hidden_states[i + 1]`` there, concatenated as the graph does: one forward of the
    tokens it was fed, ``tie_last_hidden_states`` off so the last layer's is its output, not the final
    norm's."""
    text = model.config.get_text_config()
    before = getattr(text, "tie_last_hidden_states", None)
    text.tie_last_hidden_states = False
    pairs = []
    try:
        for request in requests:
            fed = request.prompt + request.output[:-1]
            with torch.no_grad():
                states = model(torch.tensor([fed]), output_hidden_states=True).hidden_states
            asked = range(len(request.prompt) - 1, len(fed))
            expected = torch.cat([states[layer + 1][0, asked[0] :] for layer in layers], dim=-1)
            pairs.append((torch.stack(request.aux), expected))
    finally:
        text.tie_last_hidden_states = before
    return pairs


def _plan(requests: list[_Request], tokens: int, logits: int, steps: int) -> list[tuple[_Request, int]]:
    """One call's ``(request, tokens fed)``: each decoding request's next token first, then prompt
    chunks, oldest first, within the token and logits budgets."""
    plan: list[tuple[_Request, int]] = []
    for request in requests:
        if request.fed >= len(request.prompt) and len(request.output) <= steps and tokens and logits:
            plan.append((request, 1))
            tokens, logits = tokens - 1, logits - 1
    for request in requests:
        left = len(request.prompt) - request.fed
        if left > 0 and tokens and (left > tokens or logits):
            count = min(left, tokens)
            plan.append((request, count))
            tokens -= count
            logits -= count == left
    return plan
