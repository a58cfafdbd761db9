"""An engine's recorded steps, priced one by one: ``kadapt simulate SPEC --steps TRACE.json``.

A serving engine does not run uniform prefill or decode batches: each call of the packed step graph
(issue 39: ``abi.step``) carries, per request row, a query of any length at its own position - a
prompt chunk, one decode token, or k+1 speculative tokens - and asks logits of the tokens it needs.
The request sweep prices a steady state of such steps (``request_pricing.mixed_step``); this prices the
steps an engine actually ran (``tests/test_generate_step.py`` records ``examples/reference_engine.py``'s),
with the same split of a step into the kernels that run once over all its tokens and those that follow
each request:

- a step whose rows are all one-token queries runs the decode path: the decode step of its ``n`` rows
  at their mean context (a decode attention's work is linear in each row's context), exactly ``simulate
  --decode --batch n --context-len c`` when every row is at ``c``;
- any other step runs the prefill path (engines run a pass that holds prompt tokens on their prefill
  path): the row kernels of a prefill over all ``T`` tokens of the step at no context (projections,
  experts and their communication, norms), plus per multi-token row what its context adds - its
  attention over the context and its own tokens, and the row kernels that grow with the context (MLA
  expanding the cached latents) - plus the one-token rows' attention as a decode at their mean
  context, plus the logits of the rows asked for.

A step of one ``q``-token row at context ``c`` asking one logits row is thus exactly ``simulate --batch 1
--query-len q --context-len c``. The trace is one engine's: one attention group (``--dp 1``). MTP draft
passes are not steps of the trace (an engine's draft graph is its own call).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from ....errors import KadaptError, UsageError
from ....safe_files import FileRefused, read_regular_file
from ....spec.model import Spec
from ..estimate.cost import Priced
from ..estimate.simulator import simulate
from ..model.deployment import Deployment
from ..model.inputs import ModelInputs
from ..tables.device import Device
from .request_pricing import rows_and_requests

SCHEMA = Path(__file__).with_name("engine_trace.schema.json")
MAX_TRACE_BYTES = 64 << 20  # ~1M rows of a long serving run
MAX_REPORTED = 20  # schema errors listed before "and N more"


@dataclass(frozen=True)
class TraceRow:
    """One request's part of a step: ``query`` tokens after ``context`` cached ones, ``logits`` rows asked."""

    query: int
    context: int
    logits: int = 1


Step = tuple[TraceRow, ...]


@cache
def _validator() -> Draft202012Validator:
    return Draft202012Validator(json.loads(SCHEMA.read_text(encoding="utf-8")))


def _breadcrumb(path: Iterable[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def read_trace(path: str | Path) -> tuple[Step, ...]:
    """The steps of the trace at ``path``, or a ``KadaptError`` naming the file and every key that is
    wrong (``steps[3].rows[0].query: ...``); nothing is priced before the whole file is valid."""
    name = str(path)
    try:
        raw = read_regular_file(path, MAX_TRACE_BYTES, "trace file")
    except FileRefused as exc:
        raise KadaptError(exc.message, location=name) from None
    except OSError as exc:
        raise KadaptError(f"cannot read: {exc.strerror or exc}", location=name) from None
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise KadaptError(f"not valid UTF-8 (byte {exc.start})", location=name) from None
    except json.JSONDecodeError as exc:
        raise KadaptError(f"not valid JSON: {exc.msg}", location=f"{name}:{exc.lineno}:{exc.colno}") from None
    except (ValueError, RecursionError) as exc:  # an int past str()'s 4300 digits; nesting past the stack
        problem = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
        raise KadaptError(f"not valid JSON: {problem}", location=name) from None
    problems = [
        f"{_breadcrumb(error.absolute_path)}: {error.message}"
        for error in sorted(_validator().iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path])
    ]
    problems += _too_many_logits(data)  # with the schema's findings: every error of the file at once
    if problems:
        more = len(problems) - MAX_REPORTED
        listed = problems[:MAX_REPORTED] + ([f"... and {more} more"] if more > 0 else [])
        raise KadaptError(
            "not a valid engine trace (schema: engine_trace.schema.json):\n  " + "\n  ".join(listed),
            location=name,
        )
    # JSON Schema's integers include 1000.0 and 1e3 (a float with no fraction): priced as the int they are
    return tuple(
        tuple(
            TraceRow(int(row["query"]), int(row["context"]), int(row.get("logits", 1)))
            for row in step["rows"]
        )
        for step in data["steps"]
    )


def _too_many_logits(data: Any) -> list[str]:
    """Rows asking for more logits than they have tokens (a rule the schema cannot state), among the
    rows whose ``query`` and ``logits`` are numbers, whatever else in the file the schema refuses."""
    steps = data.get("steps") if isinstance(data, dict) else None
    found = []
    for i, step in enumerate(steps if isinstance(steps, list) else ()):
        rows = step.get("rows") if isinstance(step, dict) else None
        for j, row in enumerate(rows if isinstance(rows, list) else ()):
            if not isinstance(row, dict) or "logits" not in row:  # the default, one, is the schema's
                continue
            query, logits = row.get("query"), row["logits"]
            numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (query, logits))
            if numbers and logits > query:
                found.append(
                    f"steps[{i}].rows[{j}].logits: {logits} logits rows of a {query}-token query "
                    "(at most one per token)"
                )
    return found


@dataclass(frozen=True)
class Parts:
    """A priced step split into its row kernels, its attention and its other per-request kernels (the
    logits): seconds each."""

    rows: float
    attention: float
    logits: float

    @property
    def total(self) -> float:
        return self.rows + self.attention + self.logits


def split(kernels: Sequence[Priced]) -> Parts:
    """``kernels`` split as the request sweep splits a step (``rows_and_requests``), the per-request
    part further into attention and the rest."""
    rows, requests = rows_and_requests(kernels)
    attention = sum(k.total - k.module_time * k.op.repeat for k in kernels if k.op.kind == "attention")
    return Parts(rows, attention, requests - attention)


@dataclass(frozen=True)
class PricedStep:
    index: int
    rows: int  # request rows
    tokens: int
    logits: int
    path: str  # decode | prefill
    parts: Parts

    @property
    def time(self) -> float:
        return self.parts.total


class StepPricer:
    """Prices trace steps on one deployment (``base``: its layout, KV dtype and routing), each distinct
    shape simulated once."""

    def __init__(
        self,
        inputs: ModelInputs,
        spec: Spec,
        device: Device,
        base: Deployment,
        *,
        cost_model: str = "roofline",
        framework: str = "trtllm",
    ) -> None:
        if base.parallel.dp != 1:
            raise UsageError(
                "--steps prices one engine's steps, one attention group: --dp must be 1 "
                f"(got {base.parallel.dp})"
            )
        # the layout is the engine's, not a step's: refused once, before any step (not as "steps[0]: ...")
        base.parallel.check(inputs.arch.structure)
        self.inputs, self.spec, self.device = inputs, spec, device
        self.base = replace(base, mtp=0)
        self.cost_model, self.framework = cost_model, framework
        self._priced: dict[tuple[int, int, int, bool], Parts] = {}

    def _parts(self, batch: int, query: int, context: int, decode: bool) -> Parts:
        key = (batch, query, context, decode)
        if key not in self._priced:
            dep = replace(self.base, batch=batch, query_len=query, context_len=context, decode=decode)
            sim = simulate(
                self.inputs, self.spec, dep, self.device, cost_model=self.cost_model, framework=self.framework
            )
            self._priced[key] = split(sim.kernels)
        return self._priced[key]

    def price(self, index: int, step: Step) -> PricedStep:
        tokens, logits = sum(r.query for r in step), sum(r.logits for r in step)
        singles = [r.context for r in step if r.query == 1]
        mean = round(sum(singles) / len(singles)) if singles else 0
        try:
            if len(singles) == len(step):  # the decode path
                parts = self._parts(len(step), 1, mean, True)
                return PricedStep(index, len(step), tokens, logits, "decode", parts)
            rows = self._parts(1, tokens, 0, False).rows
            attention = 0.0
            for r in step:
                if r.query > 1:
                    own, bare = self._parts(1, r.query, r.context, False), self._parts(1, r.query, 0, False)
                    rows += own.rows - bare.rows  # row kernels that grow with the context
                    attention += own.attention
            if singles:
                own, bare = self._parts(len(singles), 1, mean, True), self._parts(len(singles), 1, 0, True)
                rows += own.rows - bare.rows
                attention += own.attention
            head = self._parts(logits, 1, 0, False).logits if logits else 0.0
        except KadaptError as exc:
            kind = UsageError if isinstance(exc, UsageError) else KadaptError  # keeps the exit status
            raise kind(f"steps[{index}]: {exc.message}", location=exc.location) from None
        return PricedStep(index, len(step), tokens, logits, "prefill", Parts(rows, attention, head))


def price_trace(pricer: StepPricer, steps: Sequence[Step]) -> list[PricedStep]:
    return [pricer.price(i, step) for i, step in enumerate(steps)]


def trace_json(
    priced: Sequence[PricedStep], *, trace: str, model: str, device: str, base: Deployment, cost_model: str
) -> dict[str, Any]:
    total = sum(s.time for s in priced)
    emitted = sum(s.logits for s in priced)
    par = base.parallel
    return {
        "trace": trace,
        "model": model,
        "device": device,
        "parallel": {"tp": par.tp, "dp": par.dp, "ep": par.ep, "moe_tp": par.moe_tp},
        "kv_dtype": base.kv_dtype,
        "routing": base.routing,
        "cost_model": cost_model,
        "total_s": total,
        "tokens": sum(s.tokens for s in priced),
        "logits_rows": emitted,
        "logits_rows_per_s": emitted / total if total else 0.0,
        "steps": [
            {
                "index": s.index,
                "path": s.path,
                "rows": s.rows,
                "tokens": s.tokens,
                "logits": s.logits,
                "time_s": s.time,
                "rows_s": s.parts.rows,
                "attention_s": s.parts.attention,
                "logits_s": s.parts.logits,
            }
            for s in priced
        ],
    }


def trace_text(priced: Sequence[PricedStep], *, header: str, top: int | None) -> str:
    total = sum(s.time for s in priced)
    lines = [header, f"{len(priced)} steps, {sum(s.tokens for s in priced)} tokens: {total * 1e3:.2f} ms"]
    for path in ("decode", "prefill"):
        some = [s for s in priced if s.path == path]
        if some:
            spent = sum(s.time for s in some)
            mean = spent / len(some)
            lines.append(f"  {path} path: {len(some)} steps, {spent * 1e3:.2f} ms (mean {mean * 1e3:.3f} ms)")
    emitted = sum(s.logits for s in priced)
    if total:
        lines.append(f"logits rows (tokens the engine sampled): {emitted}, {emitted / total:.1f} per s")
    slowest = sorted(priced, key=lambda s: s.time, reverse=True)[:top]
    lines.append(f"{'step':>6} {'path':<8} {'rows':>5} {'tokens':>7} {'logits':>6} {'ms':>9} {'attn ms':>9}")
    lines += [
        f"{s.index:>6} {s.path:<8} {s.rows:>5} {s.tokens:>7} {s.logits:>6} {s.time * 1e3:>9.3f} "
        f"{s.parts.attention * 1e3:>9.3f}"
        for s in slowest
    ]
    return "\n".join(lines)
