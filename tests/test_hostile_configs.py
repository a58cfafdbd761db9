"""Hostile config values: every one is a located error (config file and key) from ``kadapt validate`` and
``kadapt plan``, never a traceback, a hang or a plan of a model that cannot exist (issue 34, item 3).

Cases live in ``tests/hostile/configs/negative/*.json``: a shipped spec's config (``base``) with the
values of ``set`` (dotted keys) put in, and the ``errors`` both commands must print (``{config}`` is
the config file). ``validate_passes`` marks a value only ``plan`` reads (the vision tower). The positive
examples are the shipped specs' own configs. Counts far beyond any published model are refused by a
bound (``structure.bounds``), which is what keeps both commands fast: the huge-count cases assert it.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.structure.bounds import ROPE_TYPES, ConfigValueError, rope_violations
from kimi_adapter_core.structure.derive import derive_structure

REPO = Path(__file__).resolve().parents[1]
NEGATIVE = REPO / "tests" / "hostile" / "configs" / "negative"
CASES = sorted(NEGATIVE.glob("*.json"))


def load_case(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def put(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        config = config[key]
    config[last] = value


def write_spec(folder: Path, base: str, values: dict[str, Any]) -> tuple[Path, Path]:
    """A copy of shipped spec ``base`` whose config carries ``values``; (spec, config) paths."""
    config = json.loads((REPO / "specs" / base / "config.json").read_text(encoding="utf-8"))
    for dotted, value in values.items():
        put(config, dotted, value)
    config_path = folder / "hostile" / "config.json"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(config), encoding="utf-8")  # NaN / Infinity as Python's json writes
    text = (REPO / "specs" / f"{base}.yaml").read_text(encoding="utf-8")
    spec = folder / f"{base}.yaml"
    text = text.replace(f"config: {base}/config.json", "config: hostile/config.json")
    spec.write_text(text, encoding="utf-8")
    return spec, config_path.resolve()


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def assert_clean_exit(result: Result) -> None:
    """Exit 0 or 1 through ``SystemExit``: a KadaptError or a diagnostic, never another exception; or 2,
    a usage error, where the config leaves an option to the user (``max_position_embeddings: -1``, no
    limit: plan needs ``--seq-len``)."""
    usage = result.exit_code == 2 and result.output.startswith("error: ") and "pass --" in result.output
    assert result.exit_code in (0, 1) or usage, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output


@pytest.mark.parametrize("case", CASES, ids=[p.stem for p in CASES])
def test_negative_config_is_a_located_error(case: Path, tmp_path: Path) -> None:
    data = load_case(case)
    spec, config = write_spec(tmp_path, data["base"], data["set"])
    expected = [line.format(config=config) for line in data["errors"]]
    validate, plan = run("validate", str(spec)), run("plan", str(spec))
    for result in (validate, plan):
        assert_clean_exit(result)
    if data.get("validate_passes"):  # a value only plan reads (the vision tower, the priced experts)
        assert validate.exit_code == 0, validate.output
    else:  # every violation, each its own diagnostic
        errors = f"{len(expected)} error{'s' * (len(expected) > 1)}"
        assert validate.output.strip().splitlines()[-1] == f"1 spec checked, 1 invalid, {errors}, 0 warnings"
        assert all(line in validate.output for line in expected), validate.output
    assert plan.exit_code == 1 and all(line in plan.output for line in expected), plan.output


LLAMA_LIKE = {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 10, "num_attention_heads": 4}
MOE = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_hidden_layers", 10**6),
        ("num_hidden_layers", 10**12),
        ("n_routed_experts", 10**9),
        ("num_attention_heads", 10**9),
        ("vocab_size", 10**9),
        ("max_position_embeddings", 10**12),
        ("moe_intermediate_size", 10**12),
    ],
)
def test_huge_counts_are_refused_by_a_bound(key: str, value: int) -> None:
    """Counts far beyond any published model are refused by their bound before anything is built per
    layer or per expert: that, not a timer, is what keeps validate and plan fast."""
    with pytest.raises(ConfigValueError) as raised:
        derive_structure({**LLAMA_LIKE, **MOE, key: value})
    [violation] = raised.value.violations
    assert violation.key == key and "of at most" in violation.problem


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "specs").glob("*.yaml")))
def test_shipped_configs_are_positive_examples(name: str) -> None:
    result = run("validate", str(REPO / "specs" / f"{name}.yaml"))
    assert result.exit_code == 0 and result.output.strip().endswith("0 errors, 0 warnings"), result.output


def test_derive_structure_collects_every_violation() -> None:
    """The API (and apply, on the built config object) goes through the same check: one error, every
    key, named after the text config when no file is known."""
    config = {"num_hidden_layers": 0, "hidden_size": 64, "vocab_size": math.nan, "num_attention_heads": 4}
    with pytest.raises(ConfigValueError) as raised:
        derive_structure(config)
    assert raised.value.message.splitlines() == [
        "text config: num_hidden_layers: expected a positive integer, found 0",
        "text config: vocab_size: expected a positive integer, found NaN",
    ]


def test_no_limit_positions_are_read_as_not_stated() -> None:
    """transformers' XLNet config says -1 for "no limit": accepted, and the structure states none."""
    assert derive_structure({**LLAMA_LIKE, "max_position_embeddings": -1}).max_positions == 0
    with pytest.raises(KadaptError, match="max_position_embeddings: expected a positive integer"):
        derive_structure({**LLAMA_LIKE, "max_position_embeddings": -2})


# Each size key of a llama-like and of a deepseek-v3-like config, fuzzed one at a time.
SIZE_KEYS = {
    "llama": [
        "num_hidden_layers", "hidden_size", "vocab_size", "max_position_embeddings", "num_attention_heads",
        "num_key_value_heads", "intermediate_size", "rope_theta", "tie_word_embeddings", "rope_scaling",
        "rope_scaling.factor", "rope_scaling.rope_theta", "layer_types",
    ],
    "deepseek_v3": [
        "num_hidden_layers", "hidden_size", "num_attention_heads", "kv_lora_rank", "q_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
        "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
        "routed_scaling_factor", "vocab_size",
    ],
}  # fmt: skip
VALUES = st.one_of(
    st.integers(min_value=-3, max_value=3),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([10**6, 10**9, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(min_value=-2, max_value=2), max_size=3),
    st.none(),
    st.booleans(),
)


@pytest.mark.parametrize("base", sorted(SIZE_KEYS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_config_values_never_escape(base: str, data: st.DataObject) -> None:
    """Whatever a size key holds, validate and plan either work or end in a KadaptError / diagnostic."""
    key = data.draw(st.sampled_from(SIZE_KEYS[base]), label="key")
    value = data.draw(VALUES, label="value")
    with tempfile.TemporaryDirectory() as folder:
        spec, _ = write_spec(Path(folder), base, {key: value})
        for command in ("validate", "plan"):
            assert_clean_exit(run(command, str(spec)))


@pytest.mark.compat
def test_rope_types_are_the_ones_transformers_builds() -> None:
    """``bounds.ROPE_TYPES`` is the list of rope types the installed transformers validates (and so
    builds): a release that adds or drops one fails here, not in a user's ``apply``."""
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    prefix, suffix = "_validate_", "_rope_parameters"
    validated = {
        name[len(prefix) : -len(suffix)]
        for name in dir(RotaryEmbeddingConfigMixin)
        if name.startswith(prefix) and name.endswith(suffix)
    }
    assert validated == set(ROPE_TYPES)


def test_remote_code_names_its_own_rope_types() -> None:
    """A spec that loads remote code is not held to transformers' rope types (its classes name their
    own); the factor of a scaling type still is."""
    params = {"rope_type": "deepseek_yarn", "factor": 40.0}
    assert rope_violations("rope_scaling", params, remote_code=True) == []
    assert [v.key for v in rope_violations("rope_scaling", params)] == ["rope_scaling.rope_type"]
    null = {"type": "yarn", "factor": None}
    assert [v.key for v in rope_violations("rope_scaling", null, remote_code=True)] == ["rope_scaling.factor"]
