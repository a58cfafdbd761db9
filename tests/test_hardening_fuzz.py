"""Fuzzing ``check_spec``: thousands of mutated specs, and not one exception may escape.

A seeded mutator (deterministic, so a failure reproduces from its seed and index) mutates the
bytes, lines, keys and values of every shipped spec (``specs/*.yaml``) and every example spec
(``tests/specs/``): control characters and NUL bytes, broken encodings, explicit tags on values
that do not fit them (``!!int ''``), anchors and aliases (including alias bombs), deep nesting,
duplicated/deleted/swapped/re-indented lines, keys and values spliced from other specs, config
paths that are FIFOs, directories, devices or hold NUL bytes. Every result must be a ``SpecCheck``
whose diagnostics are located one-line ``Diagnostic`` objects.

CI runs ``KADAPT_FUZZ_EXAMPLES`` examples (default 2,000: ~7 s on an idle core, ~15 s on a busy
one); a longer run on demand (the seed defaults to a fixed value, so runs are reproducible)::

    KADAPT_FUZZ_EXAMPLES=10000 KADAPT_FUZZ_SEED=7 python -m pytest tests/test_hardening_fuzz.py

On failure the offending inputs are saved under the test's temp folder (``failures/``) and listed,
with the exception kind and the last lines of its traceback, in the failure message.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from kimi_adapter_core.spec.diagnostics import Diagnostic
from kimi_adapter_core.spec.loader import SpecCheck, check_spec

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = int(os.environ.get("KADAPT_FUZZ_EXAMPLES", "2000"))
SEED = int(os.environ.get("KADAPT_FUZZ_SEED", "20240601"))

_KEY_LINE = re.compile(r"^(\s*(?:- )?)([A-Za-z_][\w.]*)(\s*:)(.*)$")

# Bytes that matter to YAML, UTF-8 and the OS, plus a few arbitrary ones.
_BYTES = [0x00, 0x07, 0x08, 0x09, 0x0A, 0x0D, 0x1B, 0x20, 0x21, 0x22, 0x23, 0x25, 0x26, 0x27, 0x2A]
_BYTES += [0x2C, 0x2D, 0x3A, 0x3E, 0x3F, 0x40, 0x5B, 0x5C, 0x5D, 0x60, 0x7B, 0x7C, 0x7D, 0x7F]
_BYTES += [0x80, 0x85, 0xA0, 0xC0, 0xC3, 0xE2, 0xEF, 0xF0, 0xFE, 0xFF]

# fmt: off
_SNIPPETS = [
    ": ", "- ", "-", "[", "]", "{", "}", ",", "? ", "&a ", "*a", "&b ", "*b", "*undefined", "<<: *a",
    "!!int ", "!!float ", "!!bool ", "!!null ", "!!str ", "!!binary ", "!!timestamp ", "!!set ",
    "!!omap ", "!!python/object/apply:os.system ['true'] ", "!custom ", "!<tag:x> ", "! ", "---\n",
    "...\n", "--- ", "%YAML 1.1\n", "%TAG !e! tag:example.com,2000:\n", '"\\0"', '"\\x00"', '"\\u0000"',
    "'", '"', "\t", "\x00", "\r", "\r\n", "\u2028", "\ufeff", "\x85", "|\n", ">-\n", "|+2\n", "#", "\n",
    "\n  ", "    ", "~", "null", "yes", "no", "on", ".nan", ".inf", "-.inf", "1e999", "0x", "0o", "0b",
    "0x1F", "1_000", "1:2:3", ":", "2024-01-01", "2024-01-01T00:00:00Z", "9" * 5000, "1" + "0" * 400,
    "x" * 2000, "é", "\U0001f600",
]
# fmt: on

# fmt: off
_VALUES = [
    "''", '""', "~", "null", "[]", "{}", "0", "-1", "1e400", "-0", ".nan", "true", "yes", "NO",
    "!!int ''", "!!int", "!!float ''", "!!float x", "!!bool maybe", "!!null x", "!!int 0x", "!!int 1:2",
    "!!int ':'", "!!int _", "!!str [1]", "!!binary aGk=", "!!timestamp x", '"a\\0b"', '"\\0"',
    '"nul\\x00.json"', "/dev/zero", "/dev/null", "/dev/stdin", "/", ".", "..", "fifo", "a_directory",
    "../../../../etc/hostname", "x" * 300, "9" * 5000, "&v 1", "*v", "builtin:", "builtin:nope",
    "remote:a:B.c", "m:C.f", "::", "a.b.c:D.e.f", "'(((((((((((('", "'a{4294967296}'", "'(' * 3",
    '">=1,<2"', "'==1.*.x'", "[" * 40 + "]" * 40, "{a: {b: {c: {}}}}",
]
# fmt: on


def _corpus() -> list[Path]:
    files = sorted(REPO.glob("specs/*.yaml")) + sorted(REPO.glob("tests/specs/*/*.yaml"))
    assert len(files) >= 10, files
    return files


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """Copies of the spec folders (configs included), plus a FIFO and a folder to point at."""
    root = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(REPO / "specs", root / "specs")
    shutil.copytree(REPO / "tests" / "specs", root / "tests" / "specs")
    copies = [root / path.relative_to(REPO) for path in _corpus()]
    for folder in {path.parent for path in copies}:
        (folder / "a_directory").mkdir(exist_ok=True)
        if hasattr(os, "mkfifo"):
            os.mkfifo(folder / "fifo")
        if os.path.exists("/dev/zero"):
            (folder / "zero.json").symlink_to("/dev/zero")
        (folder / "deep.json").write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
        (folder / "bigint.json").write_text('{"model_type": ' + "9" * 5000 + "}", encoding="utf-8")
    return root, copies


class Mutator:
    """Seeded structural and byte-level mutations of spec files."""

    def __init__(self, rng: random.Random, sources: list[bytes]) -> None:
        self.rng = rng
        self.sources = sources
        text = [s.decode("utf-8", "replace") for s in sources]
        self.keys = sorted(
            {m.group(2) for t in text for line in t.splitlines() if (m := _KEY_LINE.match(line))}
        )
        values = {m.group(4).strip() for t in text for line in t.splitlines() if (m := _KEY_LINE.match(line))}
        self.values = sorted(v for v in values if v) + _VALUES
        self.ops = [
            (self.flip_byte, 6),
            (self.insert_snippet, 8),
            (self.delete_span, 3),
            (self.delete_line, 4),
            (self.duplicate_line, 4),
            (self.swap_lines, 3),
            (self.reindent_line, 4),
            (self.replace_key, 6),
            (self.replace_value, 10),
            (self.splice_lines, 3),
            (self.truncate, 2),
            (self.nest_deep, 1),
            (self.alias_bomb, 1),
            (self.reencode, 1),
            (self.nasty_config, 2),
            (self.anchor_and_alias, 3),
        ]

    def mutate(self, data: bytes) -> bytes:
        ops, weights = zip(*self.ops, strict=True)
        for _ in range(self.rng.choice((1, 1, 1, 2, 2, 3, 5))):
            data = self.rng.choices(ops, weights)[0](data)
        return data

    def _pos(self, data: bytes) -> int:
        return self.rng.randint(0, len(data))

    def _lines(self, data: bytes) -> list[bytes]:
        return data.split(b"\n") or [b""]

    def flip_byte(self, data: bytes) -> bytes:
        if not data:
            return bytes([self.rng.choice(_BYTES)])
        pos = self.rng.randrange(len(data))
        byte = self.rng.choice(_BYTES) if self.rng.random() < 0.8 else self.rng.randrange(256)
        return data[:pos] + bytes([byte]) + data[pos + 1 :]

    def insert_snippet(self, data: bytes) -> bytes:
        pos = self._pos(data)
        return data[:pos] + self.rng.choice(_SNIPPETS).encode("utf-8") + data[pos:]

    def delete_span(self, data: bytes) -> bytes:
        pos = self._pos(data)
        return data[:pos] + data[pos + self.rng.randint(1, 40) :]

    def delete_line(self, data: bytes) -> bytes:
        lines = self._lines(data)
        del lines[self.rng.randrange(len(lines))]
        return b"\n".join(lines)

    def duplicate_line(self, data: bytes) -> bytes:
        lines = self._lines(data)
        index = self.rng.randrange(len(lines))
        lines.insert(index, lines[index])
        return b"\n".join(lines)

    def swap_lines(self, data: bytes) -> bytes:
        lines = self._lines(data)
        a, b = self.rng.randrange(len(lines)), self.rng.randrange(len(lines))
        lines[a], lines[b] = lines[b], lines[a]
        return b"\n".join(lines)

    def reindent_line(self, data: bytes) -> bytes:
        lines = self._lines(data)
        index = self.rng.randrange(len(lines))
        stripped = lines[index].lstrip(b" ")
        lines[index] = b" " * self.rng.choice((0, 1, 2, 3, 4, 6, 8, 12)) + stripped
        return b"\n".join(lines)

    def _key_lines(self, data: bytes) -> tuple[list[str], list[int]]:
        lines = data.decode("utf-8", "surrogateescape").split("\n")
        return lines, [i for i, line in enumerate(lines) if _KEY_LINE.match(line)]

    def replace_key(self, data: bytes) -> bytes:
        lines, candidates = self._key_lines(data)
        if not candidates:
            return self.insert_snippet(data)
        index = self.rng.choice(candidates)
        match = _KEY_LINE.match(lines[index])
        assert match is not None
        lines[index] = match.group(1) + self.rng.choice(self.keys) + match.group(3) + match.group(4)
        return "\n".join(lines).encode("utf-8", "surrogateescape")

    def replace_value(self, data: bytes) -> bytes:
        lines, candidates = self._key_lines(data)
        if not candidates:
            return self.insert_snippet(data)
        index = self.rng.choice(candidates)
        match = _KEY_LINE.match(lines[index])
        assert match is not None
        lines[index] = match.group(1) + match.group(2) + match.group(3) + " " + self.rng.choice(self.values)
        return "\n".join(lines).encode("utf-8", "surrogateescape")

    def splice_lines(self, data: bytes) -> bytes:
        other = self._lines(self.rng.choice(self.sources))
        start = self.rng.randrange(len(other))
        chunk = other[start : start + self.rng.randint(1, 8)]
        lines = self._lines(data)
        at = self.rng.randint(0, len(lines))
        return b"\n".join(lines[:at] + chunk + lines[at:])

    def truncate(self, data: bytes) -> bytes:
        return data[: self._pos(data)]

    def nest_deep(self, data: bytes) -> bytes:
        depth = self.rng.choice((20, 31, 32, 33, 64, 1000, 20000))
        opener, closer = self.rng.choice(((b"[", b"]"), (b"{a: ", b"}"), (b"- ", b"")))
        if opener == b"- ":
            nested = b"".join(b"  " * i + b"-\n" for i in range(min(depth, 200))) + b"  " * 200 + b"x\n"
        else:
            nested = opener * depth + b"1" + closer * depth
        return data + b"\nnested_fuzz: " + nested + b"\n"

    def alias_bomb(self, data: bytes) -> bytes:
        width, levels = self.rng.choice(((9, 9), (2, 40), (100, 3), (3, 3)))
        lines = [b"bomb0: &l0 [" + b", ".join([b'"lol"'] * width) + b"]"]
        for level in range(1, levels):
            items = b", ".join([f"*l{level - 1}".encode()] * width)
            lines.append(f"bomb{level}: &l{level} [".encode() + items + b"]")
        return data + b"\n" + b"\n".join(lines) + b"\n"

    def nasty_config(self, data: bytes) -> bytes:
        """Point ``source.config`` at something that is no small JSON file."""
        nasty = ["fifo", "a_directory", '"x\\0.json"', "zero.json", "deep.json", "bigint.json", "'.'", "''"]
        value = self.rng.choice(nasty).encode()
        lines = self._lines(data)
        hits = [i for i, line in enumerate(lines) if line.lstrip().startswith(b"config:")]
        if not hits:
            return data + b"\nsource:\n  config: " + value + b"\n"
        index = self.rng.choice(hits)
        indent = lines[index][: len(lines[index]) - len(lines[index].lstrip())]
        lines[index] = indent + b"config: " + value
        return b"\n".join(lines)

    def anchor_and_alias(self, data: bytes) -> bytes:
        """Anchor one value and alias it from another line (or from inside itself)."""
        lines, candidates = self._key_lines(data)
        if len(candidates) < 2:
            return self.insert_snippet(data)
        first, second = sorted(self.rng.sample(candidates, 2))
        if self.rng.random() < 0.2:
            second = first
        anchor = _KEY_LINE.match(lines[first])
        assert anchor is not None
        lines[first] = anchor.group(1) + anchor.group(2) + anchor.group(3) + " &z" + anchor.group(4)
        alias = _KEY_LINE.match(lines[second])
        assert alias is not None
        lines[second] = (
            alias.group(1) + alias.group(2) + alias.group(3) + self.rng.choice((" *z", " [*z, *z]"))
        )
        return "\n".join(lines).encode("utf-8", "surrogateescape")

    def reencode(self, data: bytes) -> bytes:
        text = data.decode("utf-8", "replace")
        encoding = self.rng.choice(("utf-16", "utf-16-le", "utf-32", "latin-1", "cp1252"))
        return text.encode(encoding, "replace")


def _check_result(result: object) -> None:
    assert isinstance(result, SpecCheck), type(result)
    assert isinstance(result.diagnostics, tuple)
    for diag in result.diagnostics:
        assert isinstance(diag, Diagnostic), type(diag)
        assert diag.line >= 1 and diag.col >= 1, diag
        rendered = diag.render()
        assert "\n" not in rendered and "\r" not in rendered, rendered
        assert "Traceback" not in rendered, rendered


class _Hung(Exception):
    """An example ran past ``_EXAMPLE_TIMEOUT`` (reading a FIFO blocks forever, a bomb runs away)."""


_EXAMPLE_TIMEOUT = 20.0


def _alarm(signum: int, frame: object) -> None:
    raise _Hung(f"check_spec ran over {_EXAMPLE_TIMEOUT:.0f}s")


@dataclass
class FuzzOutcome:
    failures: list[tuple[int, str, Path]]  # (index, "Kind: message\ntraceback tail", saved input)
    codes: Counter[str]  # diagnostic codes seen, over all examples
    slowest: tuple[float, int]  # (seconds, index)


def run_fuzz(workspace: tuple[Path, list[Path]], examples: int, seed: int) -> FuzzOutcome:
    """Check ``examples`` mutated specs; collect (not raise) every exception, each input saved."""
    root, copies = workspace
    originals = [path.read_bytes() for path in copies]
    rng = random.Random(seed)
    mutator = Mutator(rng, originals)
    failures: list[tuple[int, str, Path]] = []
    codes: Counter[str] = Counter()
    slowest = (0.0, -1)
    timer = hasattr(signal, "setitimer")
    previous = signal.signal(signal.SIGALRM, _alarm) if timer else None
    try:
        for index in range(examples):
            which = rng.randrange(len(copies))
            data = mutator.mutate(originals[which])
            target = copies[which].with_name(f"fuzz_{index % 8}.yaml")  # beside the original: configs resolve
            target.write_bytes(data)
            started = time.perf_counter()
            try:
                if timer:
                    signal.setitimer(signal.ITIMER_REAL, _EXAMPLE_TIMEOUT)
                try:
                    result = check_spec(target)
                finally:
                    if timer:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                _check_result(result)
                codes.update(d.code for d in result.diagnostics)
            except Exception as exc:  # noqa: BLE001 - every escape is a finding (RecursionError too)
                saved = root / "failures" / f"seed{seed}_{index}_{copies[which].name}"
                saved.parent.mkdir(exist_ok=True)
                saved.write_bytes(data)
                kind = f"{type(exc).__name__}: {str(exc)[:120]}"
                tail = "".join(traceback.format_exc().splitlines(True)[-4:])
                failures.append((index, f"{kind}\n{tail}", saved))
            slowest = max(slowest, (time.perf_counter() - started, index))
    finally:
        if timer:
            signal.signal(signal.SIGALRM, previous)
    return FuzzOutcome(failures, codes, slowest)


def test_fuzzed_specs_never_raise(workspace: tuple[Path, list[Path]]) -> None:
    started = time.perf_counter()
    outcome = run_fuzz(workspace, EXAMPLES, SEED)
    elapsed = time.perf_counter() - started
    kinds = Counter(kind.split(":")[0] for _, kind, _ in outcome.failures)
    seconds, slowest = outcome.slowest
    print(
        f"fuzz: {EXAMPLES} examples (seed {SEED}) in {elapsed:.1f}s, {len(outcome.failures)} crashes "
        f"{dict(kinds)}; slowest {seconds:.2f}s (#{slowest}); top codes {outcome.codes.most_common(12)}"
    )
    if outcome.failures:
        shown = "\n\n".join(f"#{index} ({path}):\n{kind}" for index, kind, path in outcome.failures[:5])
        pytest.fail(f"{len(outcome.failures)}/{EXAMPLES} fuzzed specs raised ({dict(kinds)}):\n{shown}")
    if EXAMPLES >= 500:  # the mutations must reach past the YAML layer, or this test proves little
        codes = outcome.codes
        assert codes["yaml-syntax"] and codes["yaml-character"] and codes["yaml-limit"], codes
        assert codes["config-unreadable"] and codes["yaml-tag-value"], codes
        later = sum(n for code, n in codes.items() if not code.startswith(("yaml", "encoding")))
        assert later > EXAMPLES // 10, codes
