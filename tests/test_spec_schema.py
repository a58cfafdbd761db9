"""The shipped JSON Schema: valid draft 2020-12, usable without kadapt, documented everywhere."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

from kimi_adapter_core.resources import schema_path

REPO = Path(__file__).resolve().parents[1]


def schema() -> dict[str, Any]:
    return json.loads(schema_path().read_text(encoding="utf-8"))


def test_schema_is_valid_draft_2020_12() -> None:
    document = schema()
    Draft202012Validator.check_schema(document)
    assert document["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert document["$id"] == "https://kadapt.dev/schema/adapter-spec.v1.json"


def test_shipped_spec_passes_plain_jsonschema() -> None:
    """What check-jsonschema does: no kadapt code involved beyond the schema file."""
    data = yaml.safe_load((REPO / "specs" / "kimi_k25.yaml").read_text(encoding="utf-8"))
    errors = [e.message for e in Draft202012Validator(schema()).iter_errors(data)]
    assert errors == []


def test_plain_jsonschema_rejects_unknown_keys() -> None:
    data = yaml.safe_load((REPO / "specs" / "kimi_k25.yaml").read_text(encoding="utf-8"))
    data["patches"][0]["optoins"] = {}
    assert not Draft202012Validator(schema()).is_valid(data)


def _objects(node: Any, where: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node:
            yield where, node
        for key, value in node.items():
            if key != "if":  # if-branches only test values; they are not documentation
                yield from _objects(value, f"{where}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _objects(value, f"{where}/{index}")


def test_every_object_is_closed_and_every_property_described() -> None:
    objects = list(_objects(schema()))
    assert len(objects) > 20
    for where, node in objects:
        assert node.get("additionalProperties") is False, where
        for name, prop in node["properties"].items():
            assert isinstance(prop, dict) and prop.get("description"), f"{where}/properties/{name}"
