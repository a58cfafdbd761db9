"""What a user sees of every shipped spec, as sha256 digests: the record a refactor must keep.

Issue 35 moves code between packages and promises that nothing a user sees changes. This module
names those outputs and digests them the one way both sides use:

- ``artifacts/<spec>/<file>``: every file ``kadapt apply specs/<spec>.yaml`` writes (IR, KV mapping,
  weight map), taken from the suite's shared full-size run (``fixtures/shared_apply.py``), so the
  comparison costs no extra export;
- ``plan/<spec>``: ``kadapt plan SPEC --format json``;
- ``simulate/<spec>/<case>``: ``kadapt simulate SPEC --format json`` for a prefill and a decode step
  (``SIMULATIONS``);
- generated modules and docs are not here: ``kadapt generate --check`` (``test_generate``) already
  compares every committed one with what the code renders.

``python tests/user_outputs.py --write`` records the digests of the code checked out (apply runs
here without ``--verify``: verify writes nothing to the folder). Record again only in a commit
that means to change an output, and say which and why in its message.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "tests" / "recorded" / "user_outputs.json"
# every shipped spec with an ABI (kimi_k25_remote runs remote code and has none)
SPECS = (
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_v4_flash",
    "gemma3_text",
    "gemma4_31b",
    "gemma4_e2b",
    "glm5",
    "glm4_moe",
    "gpt_oss",
    "kimi_k25",
    "kimi_linear",
    "llama",
    "llama4_scout",
    "minimax_text_01",
    "mistral",
    "mixtral",
    "nemotron_h",
    "qwen2",
    "qwen3_5_moe",
    "qwen3_moe",
    "qwen3_next",
)
SIMULATIONS = {
    "prefill_h200_tp8": ("--device", "h200", "--tp", "8"),
    "decode_h200_tp8": (
        "--device",
        "h200",
        "--tp",
        "8",
        "--decode",
        "--batch",
        "16",
        "--context-len",
        "4096",
    ),
}

Invoke = Callable[[list[str]], tuple[int, str]]  # CLI arguments -> (exit code, stdout)


def digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def artifact_digests(spec: str, files: dict[str, bytes]) -> dict[str, str]:
    return {f"artifacts/{spec}/{name}": digest(blob) for name, blob in sorted(files.items())}


def _checked(invoke: Invoke, args: list[str]) -> str:
    code, stdout = invoke(args)
    if code != 0:
        raise AssertionError(f"kadapt {' '.join(args)} exited {code}:\n{stdout}")
    return stdout


def command_digests(invoke: Invoke, specs: Iterable[str] = SPECS) -> dict[str, str]:
    """``plan`` and ``simulate`` of every spec in ``specs`` through ``invoke``."""
    out = {}
    for spec in specs:
        path = str(REPO / "specs" / f"{spec}.yaml")
        out[f"plan/{spec}"] = digest(_checked(invoke, ["plan", path, "--format", "json"]))
        for case, options in SIMULATIONS.items():
            stdout = _checked(invoke, ["simulate", path, *options, "--format", "json"])
            out[f"simulate/{spec}/{case}"] = digest(stdout)
    return out


def cli_invoke(args: list[str]) -> tuple[int, str]:
    """One in-process ``kadapt`` call (torch is imported once for all of them)."""
    from click.testing import CliRunner

    from kimi_adapter_core.cli import cli

    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    return result.exit_code, result.stdout


def _applied_files(spec: str, out: Path) -> dict[str, bytes]:
    _checked(
        cli_invoke, ["apply", str(REPO / "specs" / f"{spec}.yaml"), "--output-dir", str(out), "--no-cache"]
    )
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def record() -> dict[str, str]:
    """Every digest of the code checked out (what ``--write`` stores)."""
    found = command_digests(cli_invoke)
    with tempfile.TemporaryDirectory() as tmp:
        for spec in SPECS:
            found.update(artifact_digests(spec, _applied_files(spec, Path(tmp) / spec)))
    return dict(sorted(found.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"record into {RECORD.relative_to(REPO)}")
    args = parser.parse_args(argv)
    found = record()
    if args.write:
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(found, indent=1) + "\n")
        print(f"recorded {len(found)} digests in {RECORD}")
        return 0
    recorded = json.loads(RECORD.read_text())
    changed = sorted(k for k in found.keys() | recorded.keys() if found.get(k) != recorded.get(k))
    print("\n".join(changed) or f"all {len(found)} outputs as recorded")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
