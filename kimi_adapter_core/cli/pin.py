"""``kadapt pin SPEC``: recompute the drift pins of a spec's patches and show the YAML diff.

Run it after reviewing a patch against new upstream code. Without ``--write`` it only prints the
unified diff and exits 1 when pins are stale (a finding, like a failing lint); with ``--write`` it
rewrites the spec atomically, touching nothing but pin lines. A per-release pin (a list, one entry
per transformers release reviewed) is stale only when no entry accepts the installed source; then it
gains (or has replaced) the installed release's entry, the others kept. The stale diff is the finding, so
``-q`` keeps it; what ``--write`` did and "up to date" are informational.
"""

from __future__ import annotations

import difflib
from importlib import metadata
from pathlib import Path

import click

from ..errors import KadaptError
from .output import format_option, reporter, verbosity_options
from .source_options import source_options
from .spec_argument import spec_argument


@click.command(name="pin")
@spec_argument()
@click.option(
    "--write", is_flag=True, help="Rewrite the spec file (atomically) instead of only showing the diff."
)
@source_options
@format_option
@verbosity_options
def command(
    spec_path: Path, write: bool, trust_remote_code: bool, source_dir: Path | None, from_hub: bool, fmt: str
) -> None:
    """Recompute signature/source_sha256 pins of SPEC's patches and print the diff.

    A per-release pin (a list of entries, each with its transformers release) gains the installed
    release's entry when none of its entries accepts the installed source; the others are kept.

    JSON (--format json): {"spec", "up_to_date", "written", "pins": {ID: {"target",
    "signature", "source_sha256"}}, "diff"}; stale pins without --write exit 1 after it.

    \b
    Examples:
      kadapt pin specs/kimi_k25.yaml
      kadapt pin specs/kimi_k25_remote.yaml --trust-remote-code --source-dir ./model --write
    """
    from ..atomic import atomic_write_text
    from ..patching import pins
    from ..patching.kinds import CALLABLE_KINDS
    from ..patching.pin_edit import rewrite_pins
    from ..patching.session import LOCK, Session
    from ..spec import load_spec

    out = reporter(fmt)
    out.detail(f"spec: {spec_path.resolve()}")
    spec = load_spec(spec_path)
    with LOCK:
        resolved = Session(
            spec, "none", trust_remote_code=trust_remote_code, source_dir=source_dir, from_hub=from_hub
        ).resolve_targets()
    callables = [p for p in spec.patches if p.kind in CALLABLE_KINDS]
    fresh = {p.id: pins.compute(resolved[p.id].function()) for p in callables}
    release = metadata.version("transformers")
    for patch in callables:
        pin = fresh[patch.id]
        out.detail(f"{patch.id} {patch.target}: signature {pin.signature}, sha256 {pin.source_sha256}")
    old = spec_path.read_text(encoding="utf-8")
    new = rewrite_pins(old, spec, {p.id: pins.repinned(p.pins, fresh[p.id], release) for p in callables})
    diff = "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            str(spec_path),
            f"{spec_path} (pinned)",
        )
    )
    if diff and write:
        atomic_write_text(spec_path, new)
    if out.json:
        out.document(
            {
                "spec": str(spec_path),
                "up_to_date": not diff,
                "written": bool(diff and write),
                "pins": {
                    p.id: {
                        "target": p.target,
                        "signature": fresh[p.id].signature,
                        "source_sha256": fresh[p.id].source_sha256,
                    }
                    for p in callables
                },
                "diff": diff,
            }
        )
    elif not diff:
        out.info(f"{spec_path}: {len(fresh)} pins up to date")
    elif write:
        out.info(diff.rstrip("\n"))
        out.info(f"wrote {len(fresh)} pins to {spec_path}")
    else:
        out.result(diff, nl=False)
    if diff and not write:
        raise KadaptError(f"{spec_path}: pins are stale; review the patches, then run with --write")
