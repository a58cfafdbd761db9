"""Locate the files kadapt ships: specs, templates and the JSON Schema.

In a checkout they live at the top of the repository; in an installed wheel they are copied to
``kimi_adapter_core/_shipped/`` (see ``pyproject.toml``). Both layouts resolve here, once.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def shipped_dir(name: str) -> Path:
    """Directory of shipped ``specs`` or ``templates``, installed copy first, then the checkout."""
    for candidate in (_PACKAGE_DIR / "_shipped" / name, _PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"kadapt's shipped '{name}' directory is missing from this installation")


def schema_path() -> Path:
    return _PACKAGE_DIR / "spec" / "schema" / "adapter-spec.v1.json"


def package_file(*parts: str) -> Path:
    """A data file inside the package (``package_file("structure", "config_keys.yaml")``)."""
    return _PACKAGE_DIR.joinpath(*parts)
