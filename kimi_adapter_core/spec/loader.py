"""Load one spec file into a typed ``Spec``.

PROVISIONAL: plain ``yaml.safe_load`` with no schema check and no positions. Being replaced by the
positioned loader + schema + semantic checks (issue 2); the signature stays.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ..errors import KadaptError
from .model import Spec, build_spec


def load_spec(path: str | Path) -> Spec:
    """Load and validate ``path``; raise ``KadaptError`` describing every problem found."""
    spec_path = Path(path).resolve()
    try:
        raw = yaml.safe_load(spec_path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KadaptError(f"cannot read spec {path}: {exc.strerror or exc}") from exc
    return build_spec(spec_path, raw, {})
