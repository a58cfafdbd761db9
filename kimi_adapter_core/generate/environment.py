"""The one Jinja2 environment every target renders through.

Strict on purpose: an undefined name is an error (``StrictUndefined``), never an empty string
that would silently produce a wrong adapter; templates keep their trailing newline so outputs
end in exactly one.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jinja2

from ..errors import KadaptError
from ..resources import shipped_dir
from .literals import py_comment, py_docstring_text, py_literal


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """Environment over the shipped ``templates/`` (checkout or installed wheel)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(shipped_dir("templates"))),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        extensions=["jinja2.ext.do"],
    )
    env.filters["py"] = py_literal
    env.filters["comment"] = py_comment
    env.filters["doc"] = py_docstring_text
    return env


def render(template: str, context: dict, *, spec_name: str, target: str) -> str:
    """Render one template; any Jinja failure becomes a ``KadaptError`` naming spec, target, template."""
    try:
        return environment().get_template(template).render(**context)
    except jinja2.TemplateError as exc:
        raise KadaptError(
            f"cannot generate target '{target}' for spec '{spec_name}': "
            f"template {_template_line(exc, template)}: {exc.message}"
        ) from exc


def _template_line(exc: jinja2.TemplateError, template: str) -> str:
    """``name.j2:line`` of the failure: syntax errors carry it, render errors only in the traceback."""
    lineno = getattr(exc, "lineno", None)
    name = getattr(exc, "name", None) or template
    if lineno is None:
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.endswith(".j2"):
                name, lineno = Path(tb.tb_frame.f_code.co_filename).name, tb.tb_lineno
            tb = tb.tb_next
    return f"{name}:{lineno}" if lineno is not None else name
