"""A click parameter type for comma-separated integers (``1,8,64``): batch sizes, layer ids."""

from __future__ import annotations

from typing import Any

import click


class IntList(click.ParamType):
    """A non-empty comma-separated list of integers, each at least ``minimum``; ``what`` names them in
    errors (``batch sizes``, ``layer ids``)."""

    name = "list"

    def __init__(self, minimum: int, what: str) -> None:
        self.minimum, self.what = minimum, what

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            values = tuple(int(part) for part in str(value).split(",") if part.strip())
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of {self.what}", param, ctx)
        if not values or min(values) < self.minimum:
            self.fail(f"{value!r}: {self.what} must be >= {self.minimum}", param, ctx)
        return values
