"""A spec's ``requires`` held against the installed packages, before anything is applied.

``validate`` checks that each entry is a PEP 440 specifier; this module checks that the installed
release satisfies it. A spec states a range because its patches were written (and pinned) against
that code: Llama-4-Scout's builtins replace 5.24's attention and rotary forwards, whose 5.23 sources
differ. Applying it elsewhere would fail later on a pin, or not at all for an unpinned patch; the
spec's own statement is the earlier, plainer reason. Versions come from the installed distributions'
metadata, so the check imports neither torch nor transformers.
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..errors import KadaptError
from .diagnostics import join_breadcrumb
from .model import Spec


def unmet(spec: Spec) -> list[tuple[str, str, str | None]]:
    """``(package, required, installed)`` for each ``requires`` entry the installed release does not
    satisfy (installed None: not installed). Pre-releases and local versions (``2.13.0+cpu``) count as
    the release they name."""
    found = []
    for package, required in sorted(spec.requires.items()):
        try:
            installed: str | None = metadata.version(package)
        except metadata.PackageNotFoundError:
            installed = None
        if installed is None or not _satisfies(installed, required):
            found.append((package, required, installed))
    return found


def _satisfies(installed: str, required: str) -> bool:
    try:
        release = Version(installed)
    except InvalidVersion:
        return False
    return SpecifierSet(required).contains(Version(release.base_version), prereleases=True)


def check_requirements(spec: Spec) -> None:
    """Refuse, at the spec's ``requires`` line, to apply a spec whose requirements are not installed."""
    missing = unmet(spec)
    if not missing:
        return
    package, required, installed = missing[0]
    others = "".join(f"; {p} {r} (installed: {i or 'none'})" for p, r, i in missing[1:])
    raise KadaptError(
        f"spec {spec.name} requires {package}{required}, installed: {installed or 'none'}{others}; "
        "install a release in that range, or review the spec's patches against this one and widen it",
        location=spec.locate(join_breadcrumb("requires", package)),
    )
