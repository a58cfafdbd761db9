"""Bounded spec loading: alias bombs, deep nesting, huge files, non-regular files, bad scalars.

Each limit is one located ``yaml-limit`` diagnostic naming the limit; nothing raises, nothing hangs
(every test that could hang on a regression runs under an alarm or a subprocess timeout).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kimi_adapter_core.spec import yaml_loader
from kimi_adapter_core.spec.diagnostics import Diagnostic
from kimi_adapter_core.spec.loader import check_spec
from kimi_adapter_core.spec.yaml_loader import load_yaml, load_yaml_bytes

REPO = Path(__file__).resolve().parents[1]
LLAMA = (REPO / "specs" / "llama.yaml").read_text(encoding="utf-8")


@pytest.fixture
def alarm():
    """Fail (instead of hanging forever) if the test body blocks for more than 30 s."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def hung(signum, frame):
        raise TimeoutError("blocked for 30 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, 30)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _only(diagnostics: list[Diagnostic] | tuple[Diagnostic, ...]) -> Diagnostic:
    assert len(diagnostics) == 1, [d.render() for d in diagnostics]
    return diagnostics[0]


def _llama_copy(tmp_path: Path, extra: str = "", replace: tuple[str, str] | None = None) -> Path:
    """``specs/llama.yaml`` (its config beside it) with ``extra`` appended or a line replaced."""
    (tmp_path / "llama").mkdir(exist_ok=True)
    config = (REPO / "specs" / "llama" / "config.json").read_bytes()
    (tmp_path / "llama" / "config.json").write_bytes(config)
    text = LLAMA if replace is None else LLAMA.replace(*replace)
    assert replace is None or text != LLAMA
    path = tmp_path / "llama.yaml"
    path.write_text(text + extra, encoding="utf-8")
    return path


# -- limits -------------------------------------------------------------------------------------


def _bomb(levels: int = 9, width: int = 9) -> bytes:
    lines = ["l0: &l0 [" + ", ".join(['"lol"'] * width) + "]"]
    for level in range(1, levels):
        lines.append(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]")
    return ("\n".join(lines) + "\n").encode()


def test_billion_laughs_stops_at_the_alias_budget(alarm):
    started = time.perf_counter()
    diag = _only(load_yaml_bytes(_bomb(), "bomb.yaml").diagnostics)
    assert time.perf_counter() - started < 5
    assert diag.code == "yaml-limit"
    assert f"more than {yaml_loader.MAX_ALIAS_NODES:,} nodes" in diag.message
    # located at the alias whose expansion crossed the budget (a later line), not at the anchor
    assert diag.line > 1 and diag.render().startswith(f"bomb.yaml:{diag.line}:{diag.col}: ")
    assert _bomb().splitlines()[diag.line - 1][diag.col - 1 :].startswith(b"*l")


def test_a_few_aliases_are_fine():
    loaded = load_yaml_bytes(b"a: &x {b: [1, 2]}\nc: *x\nd: [*x, *x]\n", "ok.yaml")
    assert loaded.diagnostics == []
    assert loaded.data["d"] == [{"b": [1, 2]}, {"b": [1, 2]}]
    assert loaded.positions["c"] == (2, 1) and loaded.positions["d[1]"] == (3, 9)  # where used


def test_recursive_alias_is_located_at_the_alias():
    diag = _only(load_yaml_bytes(b"a: &x [1, *x]\n", "t.yaml").diagnostics)
    assert (diag.line, diag.col, diag.code, diag.breadcrumb) == (1, 11, "yaml-alias", "a[1]")


@pytest.mark.parametrize(
    "opener, closer", [(b"[", b"]"), (b"{a: ", b"}")], ids=["flow-sequence", "flow-mapping"]
)
def test_deep_nesting_is_a_located_limit_not_a_recursion_error(tmp_path, opener, closer):
    depth = 100_000
    path = tmp_path / "deep.yaml"
    path.write_bytes(b"apiVersion: kadapt/v1\nx: " + opener * depth + b"1" + closer * depth + b"\n")
    diag = _only(check_spec(path).diagnostics)
    assert diag.code == "yaml-limit" and f"more than {yaml_loader.MAX_DEPTH} levels" in diag.message
    assert diag.line == 2


def test_block_nesting_at_the_limit_loads_and_one_more_level_does_not():
    def nested(levels: int) -> bytes:
        return b"".join(b"  " * i + b"k:\n" for i in range(levels)) + b"  " * levels + b"v\n"

    ok = load_yaml_bytes(nested(yaml_loader.MAX_DEPTH), "ok.yaml")
    assert ok.diagnostics == []
    diag = _only(load_yaml_bytes(nested(yaml_loader.MAX_DEPTH + 1), "deep.yaml").diagnostics)
    assert diag.code == "yaml-limit" and diag.line == yaml_loader.MAX_DEPTH + 1


def test_nesting_through_aliases_is_limited_too():
    half = yaml_loader.MAX_DEPTH // 2 + 1
    text = b"a: &a " + b"[" * half + b"1" + b"]" * half + b"\nb: " + b"[" * half + b"*a" + b"]" * half + b"\n"
    diag = _only(load_yaml_bytes(text, "t.yaml").diagnostics)
    assert diag.code == "yaml-limit" and "once aliases are expanded" in diag.message and diag.line == 2


def test_a_50_mb_spec_is_refused_before_reading(tmp_path, alarm):
    path = tmp_path / "huge.yaml"
    with path.open("wb") as handle:
        handle.truncate(50 << 20)  # sparse: costs no disk, would cost 50 MB to read
    started = time.perf_counter()
    diag = _only(check_spec(path).diagnostics)
    assert time.perf_counter() - started < 2
    assert (diag.line, diag.col, diag.code) == (1, 1, "yaml-limit")
    assert "52,428,800 bytes" in diag.message and f"{yaml_loader.MAX_FILE_BYTES:,}-byte limit" in diag.message


def test_700k_entries_are_refused_quickly(tmp_path, alarm):
    """The audit's case (ran > 120 s): too big for a spec file, and fast to say so."""
    path = tmp_path / "entries.yaml"
    path.write_bytes(b"apiVersion: kadapt/v1\nlist:\n" + b"- 1\n" * 700_000)
    started = time.perf_counter()
    assert _only(check_spec(path).diagnostics).code == "yaml-limit"
    assert time.perf_counter() - started < 5


def test_node_count_limit_under_the_size_limit(tmp_path, alarm):
    path = tmp_path / "many.yaml"
    path.write_bytes(b"apiVersion: kadapt/v1\nlist: [" + b"1," * 400_000 + b"]\n")  # 800 KB
    assert path.stat().st_size < yaml_loader.MAX_FILE_BYTES
    started = time.perf_counter()
    diag = _only(check_spec(path).diagnostics)
    assert time.perf_counter() - started < 10
    assert diag.code == "yaml-limit" and f"more than {yaml_loader.MAX_NODES:,} YAML nodes" in diag.message
    assert diag.line == 2


def test_long_keys_over_many_nodes_hit_the_expanded_size_limit(alarm):
    """A 500k-character key over thousands of children would need gigabytes of breadcrumbs."""
    text = b"? " + b"k" * 500_000 + b"\n: [" + b"1," * 5_000 + b"]\n"
    diag = _only(load_yaml_bytes(text, "t.yaml").diagnostics)
    assert diag.code == "yaml-limit" and f"{yaml_loader.MAX_EXPANDED_CHARS:,} characters" in diag.message


def test_worst_case_spec_under_every_limit_validates_in_seconds(tmp_path, alarm):
    """Just under the node limit, every entry a schema error: bounded (the schema stage dominates)."""
    entries = yaml_loader.MAX_NODES - 300
    path = _llama_copy(tmp_path, "patches:\n" + "  - {}\n" * entries)
    started = time.perf_counter()
    result = check_spec(path)
    assert time.perf_counter() - started < 25
    assert len(result.diagnostics) >= entries


# -- files that are not regular files -----------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_is_refused_without_blocking(tmp_path, alarm):
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    diag = _only(check_spec(fifo).diagnostics)
    assert (diag.line, diag.col, diag.code) == (1, 1, "not-a-file")
    assert "FIFO" in diag.message


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_kadapt_validate_on_a_fifo_prints_one_located_line(tmp_path):
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    proc = subprocess.run(
        [sys.executable, "-m", "kimi_adapter_core", "validate", str(fifo)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 1
    assert f"{fifo}:1:1: not a regular file but a FIFO (named pipe)" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_directory_and_device_are_refused(tmp_path, alarm):
    diag = _only(load_yaml(tmp_path).diagnostics)
    assert diag.code == "not-a-file" and "a directory" in diag.message
    if os.path.exists("/dev/null"):
        diag = _only(load_yaml("/dev/null").diagnostics)
        assert diag.code == "not-a-file" and "character device" in diag.message


def test_missing_file_is_still_an_io_diagnostic(tmp_path):
    assert _only(load_yaml(tmp_path / "nope.yaml").diagnostics).code == "io"


# -- scalars, characters, encodings -------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["!!int ''", "!!int", "!!float ''", "!!float x", "!!float .", "!!bool x", "!!bool ''", "!!int x",
     "!!int 0x", "!!int _", "!!int ':'", "!!null x"],
)  # fmt: skip
def test_explicit_tag_that_does_not_fit_its_value_is_located(value):
    diag = _only(load_yaml_bytes(f"a: 1\nb: {value}\n".encode(), "t.yaml").diagnostics)
    assert (diag.line, diag.col, diag.breadcrumb, diag.code) == (2, 4, "b", "yaml-tag-value")
    assert "is not a valid !!" in diag.message


@pytest.mark.parametrize(
    "value, expected",
    [("!!float 1", 1.0), ("!!int '3'", 3), ("!!str 1", "1"), ("!!bool yes", True), ("!!null ''", None),
     ("!!int 0x1F", 31), ("!!float 1e999", float("inf")), ("!!float 1", 1.0), ("!!int 1_000", 1000)],
)  # fmt: skip
def test_explicit_tags_that_fit_still_load(value, expected):
    loaded = load_yaml_bytes(f"b: {value}\n".encode(), "t.yaml")
    assert loaded.diagnostics == [] and loaded.data == {"b": expected}


def test_integer_over_pythons_digit_limit_is_a_diagnostic():
    diag = _only(load_yaml_bytes(b"a:\n  b: " + b"9" * 5000 + b"\n", "t.yaml").diagnostics)
    assert (diag.line, diag.col, diag.code) == (2, 6, "yaml-tag-value")
    assert len(diag.message) < 300


@pytest.mark.parametrize(
    "char, line, col",
    [("\x07", 3, 9), ("\x00", 3, 9), ("\x1b", 3, 9), ("\x7f", 3, 9), ("\ufffe", 3, 9), ("\x0c", 3, 9)],
)
def test_invalid_character_is_one_line_at_its_real_position(tmp_path, char, line, col):
    path = tmp_path / "chars.yaml"
    path.write_bytes(f"apiVersion: kadapt/v1\nkind: AdapterSpec\nmeta: é{char}x\n".encode())
    # é is two bytes and one column: the column counts characters
    diag = _only(check_spec(path).diagnostics)
    assert (diag.line, diag.col, diag.code) == (line, col - 1, "yaml-character")
    rendered = diag.render()
    assert "\n" not in rendered and f"U+{ord(char):04X}" in rendered
    assert rendered.startswith(f"{path}:{line}:{col - 1}: ")


def test_reader_error_fallback_is_located(monkeypatch):
    """If the parser itself rejects a character the pre-scan let through, still one located line."""
    monkeypatch.setattr(yaml_loader, "_NOT_PRINTABLE", __import__("re").compile("(?!)"))
    diag = _only(load_yaml_bytes("a: 1\nb: é\x07\n".encode(), "t.yaml").diagnostics)
    assert (diag.line, diag.col, diag.code) == (2, 5, "yaml-character")
    assert "\n" not in diag.render()


def test_syntax_errors_render_on_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"a: [1, 2\nb: {c: d\n")
    for diag in check_spec(path).diagnostics:
        assert "\n" not in diag.render()


# -- source.config: what the semantic checks read ------------------------------------------------


@pytest.mark.parametrize("config", ['"model\\0.json"', '"\\0"'], ids=["inside", "only"])
def test_nul_byte_in_source_config_is_a_diagnostic(tmp_path, config):
    path = _llama_copy(tmp_path, replace=("config: llama/config.json", f"config: {config}"))
    diag = _only([d for d in check_spec(path).diagnostics if d.breadcrumb == "source.config"])
    assert diag.code == "config-unreadable" and "NUL" in diag.message.upper()


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_source_config_that_is_not_a_regular_file_is_refused(tmp_path, alarm, kind):
    if kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("needs FIFOs")
        os.mkfifo(tmp_path / "pipe.json")
        target = "pipe.json"
    elif kind == "directory":
        (tmp_path / "folder.json").mkdir()
        target = "folder.json"
    else:
        if not os.path.exists("/dev/zero"):
            pytest.skip("needs /dev/zero")
        (tmp_path / "zero.json").symlink_to("/dev/zero")  # reading it would never end
        target = "zero.json"
    path = _llama_copy(tmp_path, replace=("config: llama/config.json", f"config: {target}"))
    diag = _only([d for d in check_spec(path).diagnostics if d.breadcrumb == "source.config"])
    assert diag.code == "config-unreadable" and "not a regular file" in diag.message


@pytest.mark.parametrize(
    "text, problem",
    [("[" * 100_000 + "]" * 100_000, "nested too deeply"), ("9" * 5000, "digits")],
    ids=["deep", "huge-int"],
)
def test_source_config_json_that_python_cannot_hold_is_a_diagnostic(tmp_path, text, problem):
    path = _llama_copy(tmp_path)
    (tmp_path / "llama" / "config.json").write_text(text, encoding="utf-8")
    diag = _only([d for d in check_spec(path).diagnostics if d.breadcrumb == "source.config"])
    assert diag.code == "config-json" and problem in diag.message


def test_weight_rename_regex_that_overflows_is_a_diagnostic(tmp_path):
    renames = (
        "    output_dir: out/llama\n    weight_renames:\n"
        "      - {from: 'a{4294967296}', to: b}\n"
        f"      - {{from: '{'(' * 2000}{')' * 2000}', to: b}}\n"
    )
    path = _llama_copy(tmp_path, replace=("    output_dir: out/llama\n", renames))
    found = [d for d in check_spec(path).diagnostics if d.code == "weight-rename-regex"]
    assert len(found) == 2, [d.render() for d in check_spec(path).diagnostics]


def test_a_truncated_source_config_names_where_it_breaks(tmp_path):
    path = _llama_copy(tmp_path)
    (tmp_path / "llama" / "config.json").write_text('{\n "hidden_size": "x', encoding="utf-8")
    diag = _only([d for d in check_spec(path).diagnostics if d.breadcrumb == "source.config"])
    assert diag.code == "config-json"
    assert "is not valid JSON (Unterminated string starting at: line 2, column 17)" in diag.message
