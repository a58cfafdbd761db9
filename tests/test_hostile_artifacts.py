"""Tampered artifacts fed back to their readers (issue 34): symbolic sizes and ranges of the IR, the KV
mapping's sections the binder reads, and the config the generated module loads. Every case of
``hostile/artifacts/`` states its exact outcome (a value, or the ``KadaptError``/``ConfigError`` message
or the part of it that does not depend on the Python version); a hypothesis fuzzer feeds
``symbolic.evaluate`` random text, which must give an int in bounds or a ``KadaptError``, nothing else.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_adapter_core.backends.extraction.runtime.symbolic import (
    MAX_VALUE,
    DimRange,
    Placeholders,
    bind_ir,
    decode_value_ranges,
    evaluate,
    ranges_from,
)
from kimi_adapter_core.errors import KadaptError

CASES = Path(__file__).parent / "hostile" / "artifacts"
RANGES = {"batch": DimRange(1, 4), "prefill_len": DimRange(1, 64)}


def cases(name: str, section: str | None = None) -> list[Any]:
    """The cases of ``hostile/artifacts/<name>`` (of one ``section`` of it), each with its ``about``
    as the test id."""
    data = json.loads((CASES / name).read_text(encoding="utf-8"))
    return [pytest.param(case, id=case["about"]) for case in (data if section is None else data[section])]


def refused(error: str) -> Any:
    """``pytest.raises`` for a ``KadaptError`` whose message holds ``error`` verbatim."""
    return pytest.raises(KadaptError, match=re.escape(error))


@pytest.mark.parametrize("case", cases("expressions.json"))
def test_symbolic_expression(case: dict[str, Any]) -> None:
    if "error" in case:
        with refused(case["error"]):
            evaluate(case["text"], case["sizes"])
    else:
        assert evaluate(case["text"], case["sizes"]) == case["value"]


@pytest.mark.parametrize("case", cases("ranges.json"))
def test_dynamic_ranges(case: dict[str, Any]) -> None:
    if "error" in case:
        with refused(case["error"]):
            ranges_from(case["dynamic"])
    else:
        expected = {name: DimRange(*ends) for name, ends in case["ranges"].items()}
        assert ranges_from(case["dynamic"]) == expected


def _ir(declared: list[Any], attrs: Any) -> SimpleNamespace:
    """A loaded prefill IR of one input ``input_ids`` and one node ``view`` (torch_ir's field names)."""
    meta = SimpleNamespace(name="input_ids", shape=declared, dtype="int64")
    return SimpleNamespace(graph_inputs=[meta], nodes=[SimpleNamespace(name="view", attrs=attrs)])


@pytest.mark.parametrize("case", cases("ir_nodes.json"))
def test_ir_node_attributes_and_declared_inputs(case: dict[str, Any]) -> None:
    """``bind_ir`` on inputs of shape [2, 5]: batch 2, prefill_len 5."""
    ir = _ir(case.get("declared", ["batch", "prefill_len"]), case["attrs"])
    tensor = SimpleNamespace(shape=(2, 5), dtype="int64")
    if "error" in case:
        with refused(case["error"]):
            bind_ir(ir, [tensor], RANGES, graph="prefill")
    else:
        assert bind_ir(ir, [tensor], RANGES, graph="prefill").nodes[0].attrs == case["bound"]


@pytest.mark.parametrize("case", cases("kv_sections.json", "placeholders"))
def test_placeholder_rule(case: dict[str, Any]) -> None:
    if "error" in case:
        with refused(case["error"]):
            Placeholders.from_document(case["section"])
    else:
        assert Placeholders.from_document(case["section"]) == Placeholders(*case["value"])


@pytest.mark.parametrize("case", cases("kv_sections.json", "decode_value_ranges"))
def test_decode_value_ranges(case: dict[str, Any]) -> None:
    names = ["input_ids", "mask", "position_ids", "cache_position", "block_table"]
    ir = SimpleNamespace(graph_inputs=[SimpleNamespace(name=name) for name in names])
    if "error" in case:
        with refused(case["error"]):
            decode_value_ranges(ir, case["mapping"])
    else:
        expected = {name: tuple(ends) for name, ends in case["value"].items()}
        assert decode_value_ranges(ir, case["mapping"]) == expected


CONFIGS = CASES / "config"
EXPECTED = json.loads((CONFIGS / "expected.json").read_text(encoding="utf-8"))["cases"]


def test_every_config_file_is_a_case() -> None:
    assert sorted(EXPECTED) == sorted(p.name for p in CONFIGS.glob("*.json") if p.name != "expected.json")


@pytest.fixture(scope="module")
def generated() -> dict[str, ModuleType]:
    """The generated extraction modules the config cases load with (imported once)."""
    adapters = sorted({case["adapter"] for case in EXPECTED.values()})
    return {name: importlib.import_module(f"adapters.{name}.extraction") for name in adapters}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_generated_module_config_loader(name: str, generated: dict[str, ModuleType]) -> None:
    case, path = EXPECTED[name], CONFIGS / name
    module = generated[case["adapter"]]
    if case["error"] is None:
        assert module.load_config(path).model_type == module.MODEL_TYPE
        return
    with pytest.raises(module.ConfigError) as raised:
        module.load_config(path)
    assert str(raised.value).startswith(f"config {path}: {case['error']}"), str(raised.value)
    assert isinstance(raised.value, ValueError)  # what callers caught before ConfigError existed


def test_generated_module_refuses_a_dtype_that_is_no_torch_dtype(generated: dict[str, ModuleType]) -> None:
    module = generated["llama"]
    with pytest.raises(ValueError, match=r"^dtype 'nn' is not a torch dtype$"):
        module.build_model(dtype="nn")
    assert str(module._torch_dtype("bfloat16")) == "torch.bfloat16"


# random text, and text built from the grammar's own tokens (which finds the deep, huge and zero cases)
TOKENS = ["batch", "prefill_len", "x", "max", "min", "(", ")", ",", " ", "+", "-", "*", "//", "%", "**"]
TOKENS += ["/", "0", "1", "7", "10", "9223372036854775807", "99999999999999999999", "True", "1.5", "'a'"]
EXPRESSIONS = st.one_of(
    st.text(max_size=60),
    st.lists(st.sampled_from(TOKENS), max_size=60).map("".join),
    st.integers(1, 300).map(lambda n: "(" * n + "batch" + ")" * n),
    st.integers(1, 3000).map(lambda n: "-" * n + "1"),
)


@settings(max_examples=400, deadline=None)
@given(EXPRESSIONS, st.integers(1, 2**31 - 1), st.integers(1, 2**31 - 1))
def test_evaluate_gives_a_bounded_int_or_a_kadapt_error(text: str, batch: int, prefill_len: int) -> None:
    try:
        value = evaluate(text, {"batch": batch, "prefill_len": prefill_len})
    except KadaptError as exc:
        assert "symbolic size" in str(exc)
    else:
        assert type(value) is int and abs(value) <= MAX_VALUE
