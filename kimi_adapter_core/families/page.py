"""``docs/families.md``: the family matrix as a page, and the rows read back from it.

The table has one row per model type: ``| model type | outcome | code | plan | detail |``. The test
compares outcome, code and whether plan's inventory is exact (what a user can rely on), not the detail
text (measured differences, messages).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from ..errors import REFUSALS
from .catalog import ModelType
from .trial import ADAPTED, FAILED, PLAN_EXACT, REFUSED, UNTESTED, Row

HEADER = "| model type | outcome | code | plan | detail |"
_ROW = re.compile(
    r"^\| `(?P<type>[^`]+)` \| (?P<outcome>\w+) \| (?P<code>[\w-]*) \| (?P<plan>(?:[^|\\]|\\.)*) \| "
    r"(?P<detail>.*) \|$"
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(rows: Iterable[Row], excluded: Iterable[ModelType], transformers_version: str) -> str:
    rows = sorted(rows)
    counts = Counter(row.outcome for row in rows)
    codes = Counter(row.code for row in rows if row.outcome == REFUSED)
    exact = sum(row.plan == PLAN_EXACT for row in rows)
    lines = [
        "# Every decoder model of transformers: adapted and proven, or refused",
        "",
        f"Written by `python -m kimi_adapter_core.families` against transformers {transformers_version}; "
        "`tests/test_family_matrix_*.py` fail when a row's outcome or code changes. Each decoder-only "
        "model type of transformers' causal-LM auto mapping gets the spec `docs/writing-a-spec.md` "
        "describes, on its own default config made small, and goes through `kadapt validate --resolve`, "
        "`kadapt apply` and `--verify` (float32; bfloat16 is proven on the shipped families). The model "
        "is already small, so apply and verify share one extraction: apply's checks run on it (every "
        "refusal where apply raises it), then verify's tiny random model is applied and its files are "
        "the ones replayed:",
        "",
        "- **adapted**: the files were exported and `--verify` replayed them against transformers' "
        "`generate()` on a tiny random model (every weight random, a whole period of the layer pattern, "
        "decode steps past the window): tokens equal, logits within 1e-4;",
        "- **refused**: stopped before anything was written, with a documented reason (the codes below);",
        "- **failed**: anything else. The matrix's promise is that there is none;",
        "- **untested**: transformers' own default config for the type does not build a model (small "
        "or not), or the model it builds does not run its own forward (unpatched, where the trial "
        "failed), so there is nothing to try it with or to compare against.",
        "",
        f"**{len(rows)} model types: {counts[ADAPTED]} adapted, {counts[REFUSED]} refused, "
        f"{counts[FAILED]} failed, {counts[UNTESTED]} untested.**",
        "",
        "The **plan** column says whether `kadapt plan`'s parameter inventory, which it computes from the "
        "config alone, is the model transformers builds (`census`: no tensor the model lacks, the count "
        f"within 1%): **{exact} of the {counts[ADAPTED]} adapted types are exact**. For the others, `plan` "
        "and `simulate`'s memory figures name tensors by the usual Llama/DeepSeek layout and miss or "
        "misname parts of theirs; verify's equivalence is not affected (it replays the real model).",
        "",
        "## Refusal codes",
        "",
        "| code | what kadapt does not model | model types |",
        "|---|---|---|",
    ]
    lines += [f"| `{code}` | {_cell(text)} | {codes.get(code, 0)} |" for code, text in REFUSALS.items()]
    lines += ["", "## The matrix", "", HEADER, "|---|---|---|---|---|"]
    lines += [
        f"| `{row.model_type}` | {row.outcome} | {row.code} | {_cell(row.plan)} | {_cell(row.detail)} |"
        for row in rows
    ]
    excluded = sorted(excluded)
    if excluded:
        lines += ["", "## Not decoder-only (not in the matrix)", ""]
        lines += [f"- `{m.name}` ({m.causal_lm_class}): {m.excluded}" for m in excluded]
    return "\n".join(lines) + "\n"


def read_rows(path: Path) -> dict[str, Row]:
    """The rows of a written page, by model type."""
    rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _ROW.match(line)
        if match:
            plan, detail = (match[cell].replace("\\|", "|") for cell in ("plan", "detail"))
            rows[match["type"]] = Row(match["type"], match["outcome"], match["code"], detail, plan)
    return rows


def plan_departures(rows: Iterable[Row]) -> dict[str, str]:
    """Adapted model type -> how plan's inventory departs from its model, for the types where it does
    (``plan_departures.json``: plan and simulate warn for them)."""
    return {r.model_type: r.plan for r in sorted(rows) if r.outcome == ADAPTED and r.plan != PLAN_EXACT}
