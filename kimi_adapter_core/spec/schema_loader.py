"""The shipped JSON Schema, and schema errors turned into short located diagnostics.

The schema file is the single source of truth for the spec's shape (editors read it through
yaml-language-server, CI can use check-jsonschema). jsonschema's own messages print whole
sub-schemas; here each error becomes one line naming the key, the allowed keys or the choices.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from functools import cache
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

from ..resources import schema_path
from .diagnostics import Diagnostic, Locator, join_breadcrumb

_JSON_TYPES = {dict: "mapping", list: "list", str: "string", bool: "boolean", int: "integer", float: "number"}


@cache
def load_schema() -> dict[str, Any]:
    """The spec schema as a mapping (read once per process)."""
    return json.loads(schema_path().read_text(encoding="utf-8"))


@cache
def validator() -> Draft202012Validator:
    return Draft202012Validator(load_schema())


def schema_diagnostics(data: Any, locator: Locator) -> list[Diagnostic]:
    """Every schema violation in ``data``, one diagnostic per problem."""
    found: list[Diagnostic] = []
    for error in validator().iter_errors(data):
        found.extend(_diagnose(error, locator))
    return found


def _diagnose(error: ValidationError, locator: Locator) -> Iterator[Diagnostic]:
    breadcrumb = _breadcrumb(error.absolute_path)
    code = f"schema-{error.validator}"
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        for key in sorted(set(error.instance) - set(allowed)):
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            hint += f"; allowed keys: {', '.join(allowed)}" if allowed else ""
            yield locator.at(join_breadcrumb(breadcrumb, key), f"unknown key {key!r}{hint}", code)
        return
    if error.validator in ("anyOf", "oneOf") and error.context:
        yield from _diagnose_alternatives(error, breadcrumb, code, locator)
        return
    yield locator.at(breadcrumb, _message(error), code)


def _breadcrumb(path: Any) -> str:
    crumb = ""
    for part in path:
        crumb = join_breadcrumb(crumb, part)
    return crumb


def _diagnose_alternatives(
    error: ValidationError, breadcrumb: str, code: str, locator: Locator
) -> Iterator[Diagnostic]:
    """An anyOf/oneOf failure: report inside the branch whose type matched, else summarise the branches."""
    context = error.context or []
    required = [e for e in context if e.validator == "required" and not e.relative_path]
    if required and len(required) == len(context):
        keys = sorted({key for e in required for key in e.validator_value})
        yield locator.at(breadcrumb, f"needs at least one of: {', '.join(keys)}", code)
        return
    wrong_type = [e for e in context if e.validator == "type" and not e.relative_path]
    matched = [e for e in context if e not in wrong_type]
    if matched:
        yield from _diagnose(best_match(matched), locator)
        return
    kinds = " or ".join(_type_names(e.validator_value) for e in wrong_type)
    yield locator.at(breadcrumb, f"expected {kinds}, got {_describe(error.instance)}", code)


def _message(error: ValidationError) -> str:
    kind, expected, instance = error.validator, error.validator_value, error.instance
    hint = error.schema.get("errorMessage")
    if kind == "not" and expected == {}:  # a key the if/then branch forbids
        return f"key {error.path[-1]!r} is not used{_condition(error)}"
    if kind == "required":
        missing = [key for key in expected if key not in instance]
        keys = ", ".join(repr(key) for key in missing)
        noun = "key" if len(missing) == 1 else "keys"
        return f"missing required {noun} {keys}{_condition(error)}"
    if kind == "type":
        return f"expected {_type_names(expected)}, got {_describe(instance)}"
    if kind == "enum":
        return f"{instance!r} is not one of: {', '.join(str(choice) for choice in expected)}"
    if kind == "const":
        return f"must be {expected!r}, got {instance!r}"
    if kind == "pattern":
        return f"{instance!r}: {hint}" if hint else f"{instance!r} does not match {expected}"
    if kind in ("minimum", "exclusiveMinimum", "maximum"):
        sign = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<="}[kind]
        return f"must be {sign} {expected}, got {instance!r}"
    if kind == "minLength":
        return "must not be empty"
    if kind == "minItems":
        return f"needs at least {expected} item{'s' if expected != 1 else ''}"
    if kind == "minProperties":
        return f"needs at least {expected} key{'s' if expected != 1 else ''}"
    if kind == "uniqueItems":
        return "items must be unique"
    if kind == "dependentRequired":
        return error.message.replace("is a dependency of", "is required together with")
    return error.message


def _condition(error: ValidationError) -> str:
    """`` when op is rename`` if the error comes from an ``if``/``then`` branch, else ``""``."""
    path = list(error.schema_path)
    if "then" not in path:
        return ""
    to_branch = path[: len(path) - 1 - path[::-1].index("then")]
    if "$ref" in to_branch:  # the branch lives in a $defs entry: keep the message unconditional
        return ""
    branch: Any = validator().schema
    for part in to_branch:
        branch = branch[part]
    conditions = [
        f"{name} is {rule['const']}"
        for name, rule in branch.get("if", {}).get("properties", {}).items()
        if isinstance(rule, dict) and "const" in rule
    ]
    return f" when {' and '.join(conditions)}" if conditions else ""


def _type_names(expected: str | list[str]) -> str:
    names = {"object": "mapping", "array": "list"}
    kinds = [expected] if isinstance(expected, str) else expected
    return " or ".join(names.get(kind, kind) for kind in kinds)


def _describe(instance: Any) -> str:
    if instance is None:
        return "null"
    kind = _JSON_TYPES.get(type(instance), type(instance).__name__)
    return f"{kind} {instance!r}" if isinstance(instance, (str, int, float)) else kind
