"""Which release's facts priced a request: the lines ``--isl/--osl`` reports add (text and JSON).

A framework's step budget and prompt steps move between releases (``search/frameworks.yaml``
``releases``); a report says the releases whose source its facts were read in, and says so loudly when
``--framework-version`` named a release no entry covers. Its own module because both request reports
(the sweep's and ``--concurrency``'s) print it. Nothing here imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..backends.simulation.search.launch_rules import Framework


def release_json(fw: Framework) -> dict[str, str]:
    """The releases whose source the framework's step budget and prompt steps were read in, and the
    note saying what they leave out for the release asked for (not read; a release entry's caveat)."""
    return {"facts_read_in": fw.read, **({"release_note": fw.note} if fw.note else {})}


def release_text(fw: Framework) -> list[str]:
    """``release_json`` as report lines."""
    return [
        f"{fw.title} step budget and prompt steps as read in {fw.read}",
        *([f"NOTE: {fw.note}"] if fw.note else []),
    ]
