"""``kadapt doctor``: does kadapt work with the torch and transformers installed here?

Three findings, so that the day a new transformers release lands nobody has to guess what moved:

- the environment: Python, kadapt, torch and transformers (and whether they are a tested release),
  and the optional backends each command can use;
- every transformers contact point (``upstream.CONTACT_POINTS``): ok, or moved with what kadapt
  expected and what it found;
- every pin of the shipped specs' patches: ok, or moved (signature or source hash), or not checked
  (remote code; a spec whose ``requires`` excludes the installed release).

Exit 1 when anything moved (a finding, like a failing lint), 0 otherwise.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

import click

from .. import __version__, upstream
from ..errors import KadaptError
from .output import format_option, reporter, verbosity_options

# distribution -> what kadapt uses it for (the optional ones say which command needs them)
PACKAGES: dict[str, str] = {
    "torch": "apply, simulate, generate (model extra)",
    "transformers": "apply, simulate, generate (model extra)",
    "pytorch-ir": "apply --verify, generated modules' save/replay (test extra)",
    "safetensors": "weight_loader, checkpoints --verify writes",
    "compressed-tensors": "int4 checkpoints in the weight-map tests (test extra)",
    "aiconfigurator-core": "simulate --cost-model measured (measured extra)",
    "ruff": "generate (formats what it renders)",
}
TENSORCAST = ("KADAPT_TENSORCAST", "KADAPT_TENSORCAST_PYTHON")  # the opt-in real-TensorCast tests


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _tested(distribution: str, version: str | None) -> bool | None:
    """Whether ``version`` is a release kadapt is tested with (None: kadapt pins no list for it)."""
    tested = {"torch": upstream.TESTED_TORCH, "transformers": upstream.TESTED_TRANSFORMERS}.get(distribution)
    if tested is None or version is None:
        return None
    return version.split("+")[0] in tested


def _export_traces() -> int | None:
    """Traces per exported graph: 1 on a tested torch (``export.one_pass_export``), else 2; None
    without torch."""
    try:
        from ..backends.extraction.ir.export import one_pass_export
    except ImportError:
        return None
    return 1 if one_pass_export() is not None else 2


def environment() -> dict[str, Any]:
    packages = {}
    for name, used_for in PACKAGES.items():
        version = _version(name)
        packages[name] = {"version": version, "tested": _tested(name, version), "used_for": used_for}
    tensorcast = {var: os.environ.get(var) for var in TENSORCAST}
    from ..backends.extraction.job.cache import default_root, usage

    return {
        "export_traces": _export_traces(),
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "kadapt": __version__,
        "packages": packages,
        "tested": {"torch": list(upstream.TESTED_TORCH), "transformers": list(upstream.TESTED_TRANSFORMERS)},
        "tensorcast": {"configured": all(tensorcast.values()), **tensorcast},
        "extraction_cache": usage(default_root()),
    }


def pin_findings() -> list[dict[str, Any]]:
    """Every pinned patch of every shipped spec against the installed code (remote code is not run)."""
    from ..patching import pins
    from ..patching.targets import import_module, parse_target, resolve_in
    from ..resources import shipped_dir
    from ..spec import load_spec
    from ..spec.requirements import unmet

    rows = []
    for path in sorted(shipped_dir("specs").glob("*.yaml")):
        spec = load_spec(path)
        outside = unmet(spec)  # a spec for other releases: apply refuses it here, its pins do not apply
        for patch in spec.patches:
            if not patch.pins:
                continue
            row = {"spec": spec.name, "id": patch.id, "target": patch.target}
            if outside:
                rows.append({**row, "status": "not checked", "found": f"the spec requires {outside[0]}"})
                continue
            if patch.is_remote:
                rows.append(
                    {
                        **row,
                        "status": "not checked",
                        "found": "remote code runs only with --trust-remote-code",
                    }
                )
                continue
            ref = parse_target(patch.target)
            try:
                function = resolve_in(ref, import_module(ref)).function()
                drifts = [(pin, pins.drift(pin, function)) for pin in patch.pins]
            except KadaptError as exc:
                rows.append({**row, "status": "moved", "found": exc.message})
                continue
            matched = next((pin for pin, drifted in drifts if not drifted), None)  # any reviewed source
            if matched is not None:
                rows.append({**row, "status": "ok", "found": f"matches {pins.describe(matched)}"})
                continue
            found = "; ".join(
                f"{field} {now} (pinned {then}{f' for {pin.release}' if pin.release else ''})"
                for pin, drifted in drifts
                for field, then, now in drifted
            )
            rows.append({**row, "status": "moved", "found": found})
    return rows


def _render(env: dict[str, Any], points: list[upstream.Finding], pin_rows: list[dict[str, Any]]) -> str:
    lines = [f"kadapt {env['kadapt']} on Python {env['python']} ({env['platform']})"]
    for name, info in env["packages"].items():
        version = info["version"] or "not installed"
        tested = {True: "tested", False: "NOT a tested release", None: ""}[info["tested"]]
        lines.append(f"  {name:<20} {version:<14} {tested:<21} {info['used_for']}".rstrip())
    tensorcast = env["tensorcast"]
    lines.append(
        f"  {'TensorCast':<20} {'configured' if tensorcast['configured'] else 'not configured':<14} "
        f"{'':<21} set {' and '.join(TENSORCAST)} for the real-TensorCast tests"
    )
    cache = env["extraction_cache"]
    lines.append(
        f"  {'extraction cache':<20} {cache['entries']} entries, {cache['bytes'] / 1e6:.1f} MB in "
        f"{cache['path']} (kadapt apply restores a run extracted before; --no-cache skips it)"
    )
    if env["export_traces"] is not None:
        traces = {1: "one trace per graph", 2: "two traces per graph: torch is not a tested release"}
        lines.append(f"  {'export':<20} {traces[env['export_traces']]}")
    lines.append(
        f"tested with transformers {', '.join(env['tested']['transformers'])} and torch "
        f"{', '.join(env['tested']['torch'])}"
    )
    lines.append(f"transformers contact points ({upstream.COMPATIBILITY_DOC}):")
    for finding in points:
        detail = finding.found if finding.ok else f"expected {finding.expected}; found {finding.found}"
        lines.append(f"  {'ok' if finding.ok else 'MOVED':<6} {finding.name:<23} {detail}")
    lines.append("pins of the shipped specs' patches:")
    for row in pin_rows:
        status = {"ok": "ok", "moved": "MOVED"}.get(row["status"], "-")
        lines.append(f"  {status:<6} {row['spec']} {row['id']} {row['target']}: {row['found']}")
    return "\n".join(lines)


@click.command(name="doctor")
@format_option
@verbosity_options
def command(fmt: str) -> None:
    """Check this environment: versions, transformers contact points, pins of the shipped specs.

    Exits 1 when a contact point or a pin moved. JSON (--format json): {"ok", "environment":
    {"python", "platform", "kadapt", "packages": {NAME: {"version", "tested", "used_for"}}, "tested",
    "tensorcast", "extraction_cache": {"path", "entries", "bytes"}, "export_traces"}, "contact_points":
    [{"name", "symbol", "status", "found", "expected", "why", "used_by"}], "pins":
    [{"spec", "id", "target", "status", "found"}]}.

    \b
    Examples:
      kadapt doctor
      kadapt doctor --format json
    """
    out = reporter(fmt)
    out.detail(f"python: {sys.executable}")
    env = environment()
    missing = [name for name in ("torch", "transformers") if env["packages"][name]["version"] is None]
    if missing:
        raise KadaptError(
            f"kadapt doctor needs {' and '.join(missing)}, which is not installed; install the model "
            "extra: pip install torch==2.13.0 'kadapt[model]'"
        )
    with out.stage("contact points"):
        points = upstream.findings()
    with out.stage("pins"):
        pin_rows = pin_findings()
    moved = [f.name for f in points if not f.ok] + [
        f"{r['spec']}:{r['id']}" for r in pin_rows if r["status"] == "moved"
    ]
    if out.json:
        out.document(
            {
                "ok": not moved,
                "environment": env,
                "contact_points": [
                    {
                        **f.to_dict(),
                        "why": upstream.BY_NAME[f.name].why,
                        "used_by": list(upstream.BY_NAME[f.name].used_by),
                    }
                    for f in points
                ],
                "pins": pin_rows,
            }
        )
    else:
        out.result(_render(env, points, pin_rows))
    if moved:
        raise KadaptError(
            f"moved: {', '.join(moved)}; see {upstream.COMPATIBILITY_DOC} (tested: transformers "
            f"{', '.join(upstream.TESTED_TRANSFORMERS)})"
        )
    out.info(f"doctor: {len(points)} contact points ok, {sum(r['status'] == 'ok' for r in pin_rows)} pins ok")
