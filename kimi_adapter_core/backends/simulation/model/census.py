"""The plan's parameter groups held against the model transformers builds from the same config.

``params.py`` sizes a model from its structure alone (no torch, no model), naming each tensor as the
checkpoint does. That is fast, and wrong when a family keeps a part the structure does not state
(Llama-4's shared expert has no config key) or names its parts otherwise (``feed_forward`` instead of
``mlp``). The census builds nothing itself: given the model transformers built (on the meta device),
it finds the tensors the plan invents and compares the counts, so the family matrix and the tests can
refuse a plan that does not describe the model.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ....resources import shipped_dir
from .params import Naming, ParamGroup

# The family matrix's findings (``python -m kimi_adapter_core.families --write`` writes them beside the
# page): model type -> how plan's inventory of its guide spec departs from the model transformers builds.
DEPARTURES = Path(__file__).with_name("plan_departures.json")

# the part of the model's text parameters a plan may leave out: biases, per-head q/k norms and other
# small tensors it does not price (under 1%); a missing block (an expert, an MLP) is far more
TOLERANCE = 0.01


@dataclass(frozen=True)
class Census:
    """The plan's text parameters beside the built model's, and the tensors only the plan names."""

    planned: int
    built: int
    invented: tuple[str, ...]  # checkpoint names the plan sizes that the built model does not have

    @property
    def departure(self) -> float:
        return abs(self.planned - self.built) / max(self.built, 1)

    def problems(self) -> list[str]:
        """What makes the plan not describe the model, each a sentence; empty when it does."""
        found = []
        if self.invented:
            more = f" (and {len(self.invented) - 1} more)" if len(self.invented) > 1 else ""
            found.append(f"plan sizes {self.invented[0]}{more}, which the model does not have")
        if self.departure > TOLERANCE:
            found.append(
                f"plan counts {self.planned:,} text parameters, the model has {self.built:,} "
                f"({self.departure:.1%} apart, more than {TOLERANCE:.0%})"
            )
        return found


def census(groups: Sequence[ParamGroup], names: Naming, model: Any) -> Census:
    """``groups`` (the text model's; vision groups are skipped) against ``model``, the model transformers
    built (a meta model will do): its persistent tensors, a tied tensor once, renamed as the checkpoint
    renames them."""
    text = [g for g in groups if not g.is_vision]
    planned_names = {name for g in text for row in g.checkpoint_names for name in row}
    text_roots = (f"{names.language_model}.", f"{names.lm_head}.")
    built: dict[str, int] = {}
    seen: set[int] = set()
    for path, tensor in model.state_dict(keep_vars=True).items():
        if path.startswith(text_roots) and id(tensor) not in seen:
            seen.add(id(tensor))
            built[names.checkpoint(path)] = tensor.numel()
    return Census(
        planned=sum(g.count for g in text),
        built=sum(built.values()),
        invented=tuple(sorted(planned_names - built.keys())),
    )


@functools.cache
def _departures() -> dict[str, str]:
    return json.loads(DEPARTURES.read_text(encoding="utf-8"))


def departure_note(model_type: str, spec_path: Path) -> str | None:
    """The warning plan and simulate print for a spec of a model type whose inventory the family matrix
    found departing from its model with the guide's spec (None for the others: exact, never censused,
    or a shipped spec, which ``tests/test_plan_census.py`` censuses itself)."""
    found = _departures().get(model_type)
    if found is None or spec_path.resolve().parent == shipped_dir("specs").resolve():
        return None
    return (
        f"plan's parameter inventory of {model_type} is not the model transformers builds (the family "
        f"matrix's spec, docs/families.md: {found.removeprefix('departs: ')}): its weight memory and "
        "tensor names are approximate"
    )
