"""Spec and config text in the generated docs renders as text: no HTML, link, image or new block.

A spec is downloaded like a checkpoint, and ``docs/specs/<name>.md`` is rendered by GitHub and doc
sites: a ``description`` or ``why`` with ``<script>``, ``<img onerror=...>``, a raw HTML block, a
``[x](javascript:...)`` link or a line break that opens a heading or breaks a table must come out as
the text it is. The shipped specs' pages stay byte for byte what they were.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_adapter_core.cli import cli
from kimi_adapter_core.generate import render_spec
from kimi_adapter_core.generate.markdown import comment_text, md_cell, md_code, md_paragraph, mermaid_label
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.stem for p in (REPO / "docs" / "specs").glob("*.md"))
DESCRIPTION = (
    "<img src=x onerror=alert(1)>\n# Heading\n[click](javascript:alert(1)) ![i](javascript:x)\n"
    "<div>raw</div>\n| a | b |\n|---|---|\n- item\n"
)
UNESCAPED_PIPE = re.compile(r"(?<!\\)(?:\\\\)*\|")  # a pipe after an even number of backslashes


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_specs_docs_are_byte_identical(name: str) -> None:
    files, _ = render_spec(load_spec(REPO / "specs" / f"{name}.yaml"), ("docs",))
    (page,) = files
    assert page.text == (REPO / "docs" / "specs" / f"{name}.md").read_text(encoding="utf-8")


def hostile_spec(tmp_path: Path) -> Path:
    """The shipped Llama spec with markup in every free-text field the schema lets through."""
    shutil.copytree(REPO / "specs" / "llama", tmp_path / "llama")
    raw = yaml.safe_load((REPO / "specs" / "llama.yaml").read_text())
    raw["metadata"]["model"] = "Evil <script>alert(1)</script>"
    raw["metadata"]["description"] = DESCRIPTION
    raw["config_bridges"][0]["why"] = "pipe | breaks <script>x</script> \\| and \\"
    raw["config_bridges"].append(
        {
            "id": "X9",
            "why": "[x]: javascript:alert(1)",
            "op": "set",
            "path": "kadapt_note",
            "value": "`<b>x</b>`|y",
            "backends": ["extraction"],
        }
    )
    path = tmp_path / "evil.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def hostile_page(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("hostile")
    result = CliRunner().invoke(
        cli, ["generate", str(hostile_spec(tmp)), "--target", "docs", "--out", str(tmp / "out")]
    )
    assert result.exit_code == 0, result.output
    return (tmp / "out" / "docs" / "specs" / "llama.md").read_text(encoding="utf-8")


def test_a_hostile_spec_renders_as_escaped_text(hostile_page: str) -> None:
    lines = hostile_page.splitlines()
    assert lines[1] == "# Evil &lt;script&gt;alert(1)&lt;/script&gt; (`llama`)"
    assert lines[2:5] == [
        "",
        "&lt;img src=x onerror=alert(1)&gt; \\# Heading [click]\\(javascript:alert(1)) "
        "\\![i]\\(javascript:x) &lt;div&gt;raw&lt;/div&gt; \\| a \\| b \\| \\|---\\|---\\| - item",
        "",
    ]
    assert (
        "| X1 | set | `_attn_implementation` | `'eager'` | — | extraction | "
        "pipe \\| breaks &lt;script&gt;x&lt;/script&gt; \\\\\\| and \\\\ |"
    ) in lines
    assert (
        "| X9 | set | `kadapt_note` | <code>&#39;&#96;&#60;b&#62;x&#60;&#47;b&#62;&#96;&#124;y&#39;</code> "
        "| — | extraction | [x]\\: javascript:alert(1) |"
    ) in lines
    for markup in ("<script", "<img", "<div", "](javascript", "]: javascript", "\n#  Heading"):
        assert markup not in hostile_page


def test_every_table_row_keeps_its_cells(hostile_page: str) -> None:
    """A pipe in spec text, escaped or after a backslash of its own, never splits a cell."""
    tables: list[list[str]] = []
    previous = ""
    for line in hostile_page.splitlines():
        if line.startswith("|"):
            if not previous.startswith("|"):
                tables.append([])
            tables[-1].append(line)
        previous = line
    assert len(tables) > 5
    for table in tables:
        assert len({len(UNESCAPED_PIPE.findall(row)) for row in table}) == 1, table


def test_a_markdown_renderer_sees_no_html_and_no_link(hostile_page: str) -> None:
    markdown_it = pytest.importorskip("markdown_it")
    rendered = markdown_it.MarkdownIt("commonmark").enable("table").render(hostile_page)
    tags = set(re.findall(r"<(/?[a-z0-9]+)", rendered))
    # the page's own markup; <code> also for a value a backtick span cannot show
    allowed = {"p", "h1", "h2", "h3", "table", "thead", "tbody", "tr", "th", "td", "code", "pre"}
    assert tags <= allowed | {f"/{tag}" for tag in allowed}, tags - allowed
    assert "<!-- Generated by" in rendered  # the template's own comment, the only raw HTML
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in rendered


@pytest.mark.parametrize(
    ("description", "expected"),
    [
        ("- item", "\\- item"),
        ("+ item", "\\+ item"),
        ("* item", "\\* item"),
        ("1. first", "1\\. first"),
        ("12) twelfth", "12\\) twelfth"),
        ("    indented code", "indented code"),
        ("---", "\\---"),
        ("=== setext", "\\=== setext"),
        ("> quote", "&gt; quote"),
        ("```fence", "\\`\\`\\`fence"),
        ("[x]: javascript:alert(1)", "[x]\\: javascript:alert(1)"),
        ("Plain (shipped) text; 8 x 128.", "Plain (shipped) text; 8 x 128."),
    ],
)
def test_a_description_opens_no_block(description: str, expected: str) -> None:
    assert md_paragraph(description) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("^model\\.layers\\. -> x", "`^model\\.layers\\. -> x`"),
        ("a|b", "<code>a&#124;b</code>"),
        ("a`b", "<code>a&#96;b</code>"),
        ("two\nlines", "<code>two&#92;nlines</code>"),
        ("", "<code></code>"),
        (None, "—"),
        ([1, "x"], "`1`, `x`"),
    ],
)
def test_code_values_show_as_they_are(value: Any, expected: str) -> None:
    assert md_code(value) == expected


def test_comment_and_flowchart_text_cannot_end_their_container() -> None:
    assert comment_text("evil-->\n<script>") == "evil- -> <script>"
    assert mermaid_label('a"]\n<b>`x`') == "a#quot;] #lt;b#gt;#96;x#96;"


def one_cell_text(cell: str) -> tuple[int, str]:
    """How many cells markdown-it finds in a one-column table row holding ``cell``, and its text."""
    markdown_it = pytest.importorskip("markdown_it")
    tokens = markdown_it.MarkdownIt("commonmark").enable("table").parse(f"| h |\n|---|\n| {cell} |\n")
    body = tokens[[t.type for t in tokens].index("tbody_open") :]
    inline = [t for t in body if t.type == "inline"]
    children = [c for t in inline for c in t.children or []]
    assert not [c.type for c in children if c.type not in ("text", "softbreak", "em_open", "em_close",
                                                              "strong_open", "strong_close")]  # fmt: skip
    return sum(t.type == "td_open" for t in body), "".join(c.content for c in children if c.type == "text")


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="*_"), max_size=40))
def test_any_text_is_one_cell_showing_that_text(text: str) -> None:
    cells, shown = one_cell_text(md_cell(text))
    assert cells == 1
    expected = "".join(ch if ch.isprintable() else " " for ch in text).strip(" ") if text else "—"
    assert shown.strip(" ") == expected
