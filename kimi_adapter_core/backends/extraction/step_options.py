"""The serving options beside ``options_from_spec``'s: the pool size and the packed step graph.

``--num-blocks`` (``abi.kv_cache.num_blocks``) sizes each layer's paged pool independently of batch and
context: a pool smaller than ``batch x max_cache_len / block_size`` serves an engine that admits requests
while blocks remain and shares the blocks of common prefixes between them. ``abi.step`` /
``--step-tokens`` adds the packed step graph (``runtime/step.py``), which reads and writes that pool, so
it implies a paged cache; ``abi.step.mtp`` / ``--step-mtp`` adds the MTP draft graph beside it
(``runtime/mtp.py``), for which the step graph also returns its asked tokens' final hidden states, and
``abi.step.aux_layers`` / ``--step-aux-layers`` the hidden states of chosen layers an EAGLE-3 draft
reads. Torch-free, like ``options``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from ...errors import KadaptError
from ...spec.model import Spec, paged_name_problems, paged_size_problems
from ...spec.semantic import aux_layer_order_problem
from .names import GraphNames
from .paged import PagedOptions

STEP = "step"  # graph kind (and file name part) of the packed step graph
MTP = "mtp"  # graph kind (and file name part) of the MTP draft graph
HIDDEN = "hidden_states"  # the step graph's output after its logits when it feeds an MTP draft
AUX = "aux_hidden_states"  # then the chosen layers' hidden states, concatenated (abi.step.aux_layers)
# The MTP graph's fixed inputs (``runtime.mtp.MTP_FIXED``) and its pools' name templates
MTP_FIXED = ("hidden_states", "input_ids", "positions", "token_rows", "{block_table}", "logit_indices")
MTP_PAST, MTP_PRESENT = "mtp_past.{layer}.{role}", "mtp_present.{layer}.{role}"
# The step graph's fixed inputs, in order (``runtime.step.STEP_FIXED``, torch-free here); the block
# table takes the name the paged decode graph gives it.
STEP_FIXED = ("input_ids", "positions", "token_rows", "{block_table}", "logit_indices")


@dataclass(frozen=True)
class StepOptions:
    """The packed step graph: ``tokens`` tokens per call, ``logits`` of them returned, ``rows`` requests
    (the block table's rows: ``batch``), its ABI names (the decode graph's state names)."""

    tokens: int
    logits: int
    rows: int
    names: GraphNames
    where: str | None = None  # spec location of abi.step, when the spec asked for it
    mtp: GraphNames | None = None  # the MTP draft graph's names (None: not exported)
    # decoder layers whose output hidden states the step graph also returns, concatenated (EAGLE-3)
    aux_layers: tuple[int, ...] = ()


class Serving(NamedTuple):
    """What ``serving_options`` decides: the paged cache (None: contiguous), the decode graph's names
    (a block table when paged) and the step graph (None: not exported)."""

    paged: PagedOptions | None
    decode_names: GraphNames
    step: StepOptions | None


def serving_options(
    spec: Spec,
    *,
    batch: int,
    max_cache_len: int,
    paged: PagedOptions | None,
    decode_names: GraphNames,
    num_blocks: int | None = None,
    step_tokens: int | None = None,
    step_logits: int | None = None,
    step_mtp: bool | None = None,
    step_aux_layers: tuple[int, ...] | None = None,
) -> Serving:
    """The pool size and the step graph of ``spec.abi`` and the CLI (its values win), over the paged
    cache ``options_from_spec`` read. A multimodal spec gets it too: its text requests (and the decode of
    every request) run in it; a prompt with images is prefilled by the merged prefill graph, and the
    step mapping names the placeholder token the binder refuses in the step's token ids."""
    assert spec.abi is not None
    stated = spec.abi.step
    located = spec.locate("abi.step") if "abi.step" in spec.positions else None
    tokens = step_tokens if step_tokens is not None else (stated.tokens if stated else None)
    if paged is None and (tokens is not None or num_blocks is not None):  # the step reads a paged pool
        cache = spec.abi.kv_cache
        problems = [
            *paged_size_problems(cache.block_size, None, max_cache_len),
            *paged_name_problems(cache.block_table, decode_names.inputs(1)),
        ]
        if problems:
            why = "the step graph" if tokens is not None else "--num-blocks"
            raise KadaptError(f"kv_cache (paged for {why}): {problems[0][1]}", location=located)
        paged = PagedOptions(cache.block_size, batch * (max_cache_len // cache.block_size), cache.block_table)
        fixed = (*decode_names.fixed_inputs, cache.block_table)
        decode_names = dataclasses.replace(decode_names, fixed_inputs=fixed)
    if paged is not None and num_blocks is not None:
        problems = paged_size_problems(paged.block_size, num_blocks, max_cache_len)
        if problems:
            raise KadaptError(f"--num-blocks: kv_cache {problems[0][1]}")
        paged = dataclasses.replace(paged, num_blocks=num_blocks)
    if tokens is None:
        for flag, given, reader in (
            ("--step-mtp", step_mtp, "the MTP draft graph reads the step graph's hidden states"),
            ("--step-aux-layers", step_aux_layers, "the step graph returns the aux layers' hidden states"),
        ):
            if given:
                raise KadaptError(f"{flag}: {reader}: give --step-tokens (or abi.step)")
        return Serving(paged, decode_names, None)
    assert paged is not None
    logits = step_logits if step_logits is not None else (stated.logits if stated else None)
    logits = logits if logits is not None else min(batch, tokens)
    for name, value in (("tokens", tokens), ("logits", logits)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KadaptError(f"step {name} must be a positive integer, got {value!r}", location=located)
    if logits > tokens:
        raise KadaptError(
            f"step logits {logits} exceed its tokens {tokens}: logits are returned for tokens of the call",
            location=located,
        )
    names = tuple(name.format(block_table=paged.block_table) for name in STEP_FIXED)
    mtp = step_mtp if step_mtp is not None else bool(stated and stated.mtp)
    aux = tuple(step_aux_layers if step_aux_layers is not None else (stated.aux_layers if stated else ()))
    problem = aux_layer_order_problem(aux)
    if problem is not None:
        where = "--step-aux-layers" if step_aux_layers is not None else "abi.step.aux_layers"
        raise KadaptError(f"{where}: {problem}", location=None if step_aux_layers is not None else located)
    step_names = dataclasses.replace(  # then the decode graph's pools
        decode_names, fixed_inputs=names, hidden=HIDDEN if mtp else None, aux=AUX if aux else None
    )
    mtp_names = mtp_graph_names(paged.block_table) if mtp else None
    step = StepOptions(tokens, logits, batch, step_names, located, mtp_names, aux)
    return Serving(paged, decode_names, step)


def mtp_graph_names(block_table: str) -> GraphNames:
    """The MTP draft graph's ABI names: its fixed inputs, its one layer's pools, its draft logits."""
    past, present = (
        {role: template.format(layer="{layer}", role=role) for role in ("key", "value")}
        for template in (MTP_PAST, MTP_PRESENT)
    )
    fixed = tuple(name.format(block_table=block_table) for name in MTP_FIXED)
    return GraphNames(fixed, past["key"], past["value"], "mtp_logits", present["key"], present["value"])
