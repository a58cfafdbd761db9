"""``kadapt pin SPEC``: recompute the drift pins of a spec's patches and show the YAML diff.

Run it after reviewing a patch against new upstream code. Without ``--write`` it only prints the
unified diff; with ``--write`` it rewrites the spec atomically, touching nothing but pin lines.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import click

from ..errors import KadaptError
from .source_options import source_options
from .spec_argument import spec_argument


@click.command(name="pin")
@spec_argument()
@click.option(
    "--write", is_flag=True, help="Rewrite the spec file (atomically) instead of only showing the diff."
)
@source_options
def command(
    spec_path: Path, write: bool, trust_remote_code: bool, source_dir: Path | None, from_hub: bool
) -> None:
    """Recompute signature/source_sha256 pins of SPEC's patches and print the diff."""
    from ..atomic import atomic_write_text
    from ..patching import pins
    from ..patching.kinds import CALLABLE_KINDS
    from ..patching.pin_edit import rewrite_pins
    from ..patching.session import LOCK, Session
    from ..spec import load_spec

    spec = load_spec(spec_path)
    with LOCK:
        resolved = Session(
            spec, "none", trust_remote_code=trust_remote_code, source_dir=source_dir, from_hub=from_hub
        ).resolve_targets()
    fresh = {p.id: pins.compute(resolved[p.id].function()) for p in spec.patches if p.kind in CALLABLE_KINDS}
    old = spec_path.read_text(encoding="utf-8")
    new = rewrite_pins(old, spec, fresh)
    diff = "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            str(spec_path),
            f"{spec_path} (pinned)",
        )
    )
    if not diff:
        click.echo(f"{spec_path}: {len(fresh)} pins up to date")
        return
    click.echo(diff, nl=False)
    if not write:  # stale pins are a finding (exit 1), like a failing lint
        raise KadaptError(f"{spec_path}: pins are stale; review the patches, then run with --write")
    atomic_write_text(spec_path, new)
    click.echo(f"wrote {len(fresh)} pins to {spec_path}")
