"""plan's parameter inventory against the model transformers builds from the same config (on meta).

plan sizes a model from its structure alone; the census is what shows that inventory is the model's:
no tensor the model lacks, and the count within 1% (stricter than the names-only check on a shortened
model it replaces). Llama-4 was the case that needed it: its shared expert has no config key and its
MLP is ``feed_forward``, so plan had sized 101.7B of Scout's 107.8B.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from kimi_adapter_core.backends.simulation.model.census import census
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.loading import applied, load_model
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
SPECS = sorted(p for p in (REPO / "specs").glob("*.yaml") if p.stem != "kimi_k25_remote")


def built(path: Path):  # noqa: ANN201 - (ModelInputs, meta model)
    spec = load_spec(path)
    with applied(spec, backend="simulation"):
        return model_inputs(spec, None), load_model(spec, device="meta")


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_plan_sizes_the_model_transformers_builds(path: Path) -> None:
    inputs, model = built(path)
    found = census(inputs.groups, inputs.naming, model)
    assert found.problems() == []
    assert found.departure < 0.001  # what plan leaves out (biases, q/k norms) is tiny


def test_llama4_scout_counts_its_shared_expert() -> None:
    inputs, model = built(REPO / "specs" / "llama4_scout.yaml")
    moe = inputs.arch.structure.moe
    assert moe is not None and (moe.num_shared_experts, moe.shared_intermediate_size) == (1, 8192)
    groups = {g.name: g for g in inputs.groups}
    assert "router_bias" not in groups  # Llama4Router: sigmoid of the top-1 logit, no correction bias
    assert (
        groups["shared_experts"].checkpoint_names[0][0]
        == "model.layers.0.feed_forward.shared_expert.gate_proj.weight"
    )
    assert census(inputs.groups, inputs.naming, model).planned == pytest.approx(107.77e9, rel=1e-4)


def test_census_finds_a_missing_block_and_an_invented_tensor() -> None:
    inputs, model = built(REPO / "specs" / "llama.yaml")
    without_mlp = [g for g in inputs.groups if g.name != "dense_mlp"]
    (problem,) = census(without_mlp, inputs.naming, model).problems()
    assert "apart, more than 1%" in problem
    renamed = [
        dataclasses.replace(
            g,
            checkpoint_names=tuple(
                tuple(n.replace(".mlp.", ".ffn.") for n in row) for row in g.checkpoint_names
            ),
        )
        for g in inputs.groups
    ]
    (problem,) = census(renamed, inputs.naming, model).problems()
    assert problem.startswith("plan sizes model.layers.0.ffn.down_proj.weight (and ")


def test_plan_warns_for_a_model_type_the_family_matrix_found_departing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kimi_adapter_core.backends.simulation.model import census as module

    shipped = load_spec(REPO / "specs" / "llama.yaml")
    copy = tmp_path / "llama.yaml"  # the same spec outside the shipped folder: a user's
    copy.write_text(shipped.path.read_text())
    shutil.copytree(shipped.path.parent / "llama", tmp_path / "llama")
    user = load_spec(copy)
    assert not [n for n in model_inputs(user, None).notes if "inventory" in n]
    monkeypatch.setattr(
        module, "_departures", lambda: {"llama": "departs: plan sizes x, which the model lacks"}
    )
    assert not [n for n in model_inputs(shipped, None).notes if "inventory" in n]  # censused by the tests
    (note,) = [n for n in model_inputs(user, None).notes if "inventory" in n]
    assert note.startswith("plan's parameter inventory of llama is not the model transformers builds")
    assert "plan sizes x, which the model lacks" in note


def test_the_departures_file_is_the_pages_plan_column() -> None:
    from kimi_adapter_core.backends.simulation.model.census import DEPARTURES
    from kimi_adapter_core.families.page import plan_departures, read_rows

    rows = read_rows(REPO / "docs" / "families.md").values()
    assert json.loads(DEPARTURES.read_text(encoding="utf-8")) == plan_departures(rows)
