"""The comparisons a verify runs: text prompts, dynamic sizes, ragged rows and the image prompt."""

from __future__ import annotations

import functools

import torch
from torch import nn

from ....errors import KadaptError
from ....spec.model import Spec
from ..options import ExtractionOptions
from . import multimodal as multimodal_verify
from .departure import localise, walk
from .reference import reference_run
from .replay import Replay
from .tolerance import Tolerance, compare
from .verdict import VerifyReport

# Greedy steps after the multimodal prefill: the decode graph itself is checked over the full
# decode_steps by the text prompt; these show the image prompt's KV continues into it.
MERGED_DECODE_STEPS = 8


def compare_prompt(
    report: VerifyReport,
    model: nn.Module,
    replay: Replay,
    prompt: torch.Tensor,
    steps: int,
    *,
    tolerance: Tolerance,
    suffix: str = "",
    prefill: multimodal_verify.Prefill | None = None,
    reference_inputs: dict[str, torch.Tensor] | None = None,
    label: str = "",
) -> None:
    """Prefill ``prompt`` (with ``prefill``, default the saved text prefill), decode ``steps`` greedy
    tokens with the saved decode graph, and compare each with transformers given ``reference_inputs``;
    check names start with ``label``."""
    ref_prefill, ref_tokens, ref_logits = reference_run(model, prompt, steps, **(reference_inputs or {}))
    logits, cache = (prefill or replay.run_prefill)(prompt)
    first = compare([(logits, ref_prefill)], tolerance)
    report.add(
        f"{label}prefill logits{suffix}", first.passed, f"over {tuple(logits.shape)}: {first.detail()}"
    )
    token = logits[:, -1].argmax(-1, keepdim=True)
    tokens = [token]
    steps_logits = [(logits[:, -1], ref_logits[0])]
    for step in range(steps):
        logits, cache = replay.run_decode(token, prompt.shape[1] + step, cache)
        steps_logits.append((logits[:, -1], ref_logits[step + 1]))
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    ir_tokens = torch.cat(tokens, dim=1)
    decoded = compare(steps_logits, tolerance)
    equal = torch.equal(ir_tokens, ref_tokens)
    if prefill is None and report.first_departure is None and not (first.passed and equal and decoded.passed):
        where = localise(model, replay, prompt, steps, tolerance)
        report.first_departure = f"{where} ({tolerance.dtype}, prompt {tuple(prompt.shape)})"
    if not suffix and not label:  # the fp32 text run is the one the report's tokens and max diff describe
        report.tokens_ir = ir_tokens.tolist()
        report.tokens_reference = ref_tokens.tolist()
        report.max_logit_diff = max(first.max_diff, decoded.max_diff)
    last = prompt.shape[1] + steps - 1
    report.add(
        f"{label}greedy generation{suffix}",
        equal,
        f"{ir_tokens.shape[1]} tokens (1 prefill + {steps} decode steps, "
        f"positions {prompt.shape[1]}..{last}) {'equal' if equal else 'DIFFER'} to model.generate",
    )
    report.add(
        f"{label}decode logits{suffix}", decoded.passed, f"over {steps + 1} tokens: {decoded.detail()}"
    )


def compare_dynamic(
    report: VerifyReport,
    model: nn.Module,
    replay: Replay,
    prompt: torch.Tensor,
    options: ExtractionOptions,
    *,
    tolerance: Tolerance,
    suffix: str,
) -> None:
    """The same graphs at smaller sizes inside their ranges, and a refusal just outside them."""
    rows = 1 if "batch" in options.dynamic else prompt.shape[0]
    length = max(1, prompt.shape[1] // 2 - 1) if "prefill_len" in options.dynamic else prompt.shape[1]
    smaller = prompt[:rows, :length]
    where = f" (batch {rows}, prompt {length}{', ' + suffix.strip(' ()') if suffix else ''})"
    compare_prompt(report, model, replay, smaller, 4, tolerance=tolerance, suffix=where)
    for name, allowed in options.dynamic_ranges.items():
        shape = {"batch": prompt.shape[0], "prefill_len": prompt.shape[1], name: allowed.max + 1}
        check = f"{name} {allowed.max + 1} refused before execution{suffix}"
        try:
            replay.run_prefill(torch.zeros(shape["batch"], shape["prefill_len"], dtype=torch.long))
        except KadaptError as exc:
            report.add(check, f"({name})" in str(exc), str(exc))
        else:
            report.add(check, False, f"a {shape['batch']}x{shape['prefill_len']} prompt ran")


def compare_ragged(
    report: VerifyReport,
    model: nn.Module,
    replay: Replay,
    prompt: torch.Tensor,
    *,
    steps: int,
    tolerance: Tolerance,
    suffix: str,
) -> None:
    """Rows of different lengths in one batch, each decoding from its own position in every step (and,
    paged, through blocks out of order): every row's tokens equal ``generate`` on that row alone and its
    logits are within ``tolerance`` of generate's at every step."""
    rows, width = prompt.shape
    lengths = torch.tensor([max(1, width - 2 * row) for row in range(rows)])
    padded = torch.stack(
        [prompt[row].masked_fill(torch.arange(width) >= lengths[row], 0) for row in range(rows)]
    )
    logits, cache = replay.run_ragged_prefill(padded, lengths)
    step_logits = [logits[torch.arange(rows), lengths - 1]]  # [rows, vocab] per step
    token = step_logits[0].argmax(-1, keepdim=True)
    tokens = [token]
    for step in range(steps):
        logits, cache = replay.run_decode(token, lengths + step, cache)
        step_logits.append(logits[:, -1])
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    ours = torch.cat(tokens, dim=1)
    rows_ours = [(ours[row : row + 1], [step[row : row + 1] for step in step_logits]) for row in range(rows)]
    prompts = [prompt[row : row + 1, : int(lengths[row])] for row in range(rows)]
    passed, detail = rows_against_generate(model, prompts, rows_ours, steps, tolerance)
    paged = "" if replay.block_table is None else ", paged, blocks out of order"
    report.add(f"ragged batch{suffix}", passed, f"{rows} rows of lengths {lengths.tolist()}{paged}: {detail}")


def rows_against_generate(
    model: nn.Module,
    prompts: list[torch.Tensor],
    ours: list[tuple[torch.Tensor, list[torch.Tensor]]],
    steps: int,
    tolerance: Tolerance,
) -> tuple[bool, str]:
    """Each row's tokens ``[1, steps + 1]`` and per-step logits ``[1, vocab]`` against ``generate`` on
    that row's prompt alone: whether all are equal and within ``tolerance``, and what the report says."""
    differ, pairs = [], []
    for row, (prompt, (tokens, logits)) in enumerate(zip(prompts, ours, strict=True)):
        _, expected, expected_logits = reference_run(model, prompt, steps)
        if not torch.equal(tokens, expected):
            differ.append(row)
        pairs += list(zip(logits, expected_logits, strict=True))
    close = compare(pairs, tolerance)
    verdict = (
        f"DIFFER from model.generate on rows {differ}" if differ else "equal to model.generate row by row"
    )
    return not differ and close.passed, f"{steps + 1} tokens each {verdict}; logits {close.detail()}"


def compare_states(
    report: VerifyReport,
    model: nn.Module,
    replay: Replay,
    prompt: torch.Tensor,
    steps: int,
    *,
    tolerance: Tolerance,
    suffix: str,
) -> None:
    """Every state the graphs return against transformers' own cache, the prefill and each decode step
    fed the same tokens: the attention rows each step wrote (keys, values, a DSA layer's indexer keys),
    each linear layer's conv window and recurrent state whole. Run for stacks with states beyond a KV
    cache, which the logits alone cannot vouch for (a state carries into every later step; an indexer
    key only matters once it is among a query's top-k), and for layers caching KV of different shapes
    (each layer's own heads and widths, MiMo-V2-Flash)."""
    pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    graph_steps = 0
    for step in walk(model, replay, prompt, steps):
        graph_steps += 1
        roles = [role for layer_roles in replay.layer_roles for role in layer_roles]
        if len(step.ours) != len(step.expected):
            report.add(
                f"returned states{suffix}",
                False,
                f"{step.graph} returns {len(step.ours)} state tensors, transformers' layers hold "
                f"{len(step.expected)}",
            )
            return
        for role, ours, expected in zip(roles, step.ours, step.expected, strict=True):
            pairs.setdefault(role, []).append((ours, expected))
    results = {role: compare(role_pairs, tolerance) for role, role_pairs in pairs.items()}
    passed = all(result.passed for result in results.values())
    where = None if passed else localise(model, replay, prompt, steps, tolerance)
    if where is not None and report.first_departure is None:
        report.first_departure = f"{where} ({tolerance.dtype}, prompt {tuple(prompt.shape)})"
    counts = {kind: replay.kinds.count(kind) for kind in dict.fromkeys(replay.kinds)}
    report.add(
        f"returned states{suffix}",
        passed,
        ", ".join(f"{n} {kind} layers" for kind, n in counts.items())
        + f", prefill + {graph_steps - 1} decode steps against transformers' cache: "
        + "; ".join(f"{role} {result.size()}" for role, result in results.items())
        + f"; bound {tolerance.describe()}",
    )


def compare_joining(
    report: VerifyReport,
    model: nn.Module,
    replay: Replay,
    prompt: torch.Tensor,
    *,
    steps: int,
    tolerance: Tolerance,
    suffix: str,
) -> None:
    """Rows that join a running batch (the ragged case of a stack with linear layers, whose prompts are
    never padded): row ``r``'s request starts ``2 r`` steps after row 0's, its prefill outputs written
    into its row of the running states (``Replay.join``) while the others keep decoding, so every step
    has rows at different positions. Before it joins, a row decodes filler tokens into its own row.
    Every row's tokens equal ``generate`` on its prompt alone and its logits are within ``tolerance``."""
    rows, width = prompt.shape
    logits, present = replay.prefill_outputs(prompt, torch.full((rows,), width))
    states = replay.place(present, torch.full((rows,), width))
    joins = [2 * row for row in range(rows)]
    tokens: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    row_logits: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    token = torch.zeros(rows, 1, dtype=torch.long)
    for step in range(joins[-1] + steps + 1):
        for row in range(rows):
            if joins[row] == step:
                if step:
                    states = replay.join(states, row, present, width)
                row_logits[row].append(logits[row, -1])
                token[row, 0] = logits[row, -1].argmax()
                tokens[row].append(token[row].clone())
        if step == joins[-1] + steps:
            break
        positions = torch.tensor([width + max(0, step - joins[row]) for row in range(rows)])
        out, states = replay.run_decode(token, positions, states)
        for row in range(rows):
            if joins[row] <= step and len(tokens[row]) <= steps:
                row_logits[row].append(out[row, -1])
                token[row, 0] = out[row, -1].argmax()
                tokens[row].append(token[row].clone())
    rows_ours = [
        (
            torch.stack(tokens[row][: steps + 1], dim=1),
            [step.unsqueeze(0) for step in row_logits[row][: steps + 1]],
        )
        for row in range(rows)
    ]
    prompts = [prompt[row : row + 1] for row in range(rows)]
    passed, detail = rows_against_generate(model, prompts, rows_ours, steps, tolerance)
    paged = "" if replay.block_table is None else ", paged, blocks out of order"
    report.add(f"joining rows{suffix}", passed, f"{rows} rows joining at steps {joins}{paged}: {detail}")


def compare_merged(
    report: VerifyReport,
    spec: Spec,
    model: nn.Module,
    replay: Replay,
    options: ExtractionOptions,
    weights: dict[str, torch.Tensor],
    *,
    vocab_size: int,
    tolerance: Tolerance,
    suffix: str,
) -> None:
    """An image prompt through the saved vision, multimodal prefill and decode graphs vs transformers."""
    case = multimodal_verify.merged_case(
        spec,
        model,
        options,
        weights,
        text_len=options.verify_prefill_len,
        vocab_size=vocab_size,
        place=replay.place,
    )
    compare = functools.partial(
        compare_prompt,
        report,
        model,
        replay,
        tolerance=tolerance,
        prefill=case.prefill,
        reference_inputs=case.reference_inputs,
        label="multimodal ",
    )
    compare(case.prompt, MERGED_DECODE_STEPS, suffix=suffix)
    if options.dynamic:  # a shorter image prompt (and batch 1) through the same files
        rows = 1 if "batch" in options.dynamic else case.prompt.shape[0]
        text = 2 if "prefill_len" in options.dynamic else options.verify_prefill_len
        prompt = multimodal_verify.image_prompt(
            batch=rows,
            text_len=text,
            image_tokens=case.replay.feature_rows,
            placeholder=case.replay.placeholder,
            vocab_size=vocab_size,
        )
        where = f" (batch {rows}, prompt {prompt.shape[1]}{', ' + suffix.strip(' ()') if suffix else ''})"
        compare(prompt, 4, suffix=where)
    multimodal_verify.check_placeholder_refusal(report, case, suffix=suffix)
