"""The ``SPEC`` argument: a spec file's path, or the name of a shipped spec (``kimi_k25``).

Names make an installed kadapt usable outside the checkout (``kadapt apply kimi_k25``); a bad
value is a usage error (exit 2) that lists the shipped names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import KadaptError


class SpecReference(click.ParamType):
    name = "spec"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        from ..spec.loader import resolve_spec_path

        if isinstance(value, Path):
            value = str(value)
        try:
            path = resolve_spec_path(value)
        except KadaptError as exc:
            self.fail(exc.message, param, ctx)
        if not path.is_file():
            self.fail(f"{value!r} is not a spec file", param, ctx)
        return path


def spec_argument(name: str = "spec_path") -> Any:
    """``@spec_argument()``: the command's positional ``SPEC``."""
    return click.argument(name, metavar="SPEC", type=SpecReference())
