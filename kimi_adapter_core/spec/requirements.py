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
from typing import NamedTuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..errors import KadaptError
from .diagnostics import join_breadcrumb
from .model import Spec


class Unmet(NamedTuple):
    """A ``requires`` entry the installed release does not satisfy (installed None: not installed)."""

    package: str
    required: str
    installed: str | None

    def __str__(self) -> str:
        return f"{self.package}{self.required} (installed: {self.installed or 'none'})"


def unmet(spec: Spec) -> list[Unmet]:
    """Each ``requires`` entry the installed release does not satisfy. Pre-releases and local versions
    (``2.13.0+cpu``) count as the release they name."""
    found = []
    for package, required in sorted(spec.requires.items()):
        try:
            installed: str | None = metadata.version(package)
        except metadata.PackageNotFoundError:
            installed = None
        if installed is None or not _satisfies(installed, required):
            found.append(Unmet(package, required, installed))
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
    raise KadaptError(
        f"spec {spec.name} requires {'; '.join(map(str, missing))}; install a release in that range, "
        "or review the spec's patches against this one and widen it",
        location=spec.locate(join_breadcrumb("requires", missing[0].package)),
    )
