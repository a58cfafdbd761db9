"""One trace instead of two (``export.one_pass_export``): the artifacts are the bytes that
``torch.export.export(...).run_decompositions({})`` gives, for the shipped specs that hold every
feature (``fixtures/archetypes.py``) and the options that change what is traced (dynamic sizes, a
paged cache, the MLA variants, the vision graph)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from fixtures.archetypes import covering

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction import options_from_spec, run
from kimi_adapter_core.backends.extraction.ir import export
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied, load_config, load_model
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
# every feature a shipped spec has (fixtures/archetypes.py)
SHIPPED = covering(sorted(p.stem for p in (REPO / "specs").glob("*.yaml") if p.stem != "kimi_k25_remote"))
OPTIONS = [
    ("llama", {"dynamic": ("prefill_len", "batch"), "batch": 4}),
    ("llama", {"batch": 2, "kv_cache": "paged", "block_size": 4}),
    ("deepseek_v3", {"kv_layout": "latent", "mla_attention": "absorbed"}),
    ("kimi_k25", {"dynamic": ("prefill_len",)}),
]


def artifacts(name: str, sizes: dict[str, Any], out: Path) -> dict[str, bytes]:
    """The files ``run`` writes for spec ``name`` shrunk to ``--verify``'s tiny sizes (every kind of
    layer, cache and graph the spec has, at a fraction of the full-size trace), at the spec's dtype."""
    spec = load_spec(name)
    options = options_from_spec(spec, output_dir=out, prefill_len=8, max_cache_len=16, **sizes)
    config = load_config(spec, backend="extraction", overrides=tiny_overrides(spec, options))
    with applied(spec):
        run(spec, load_model(spec, device="meta", config=config), options, echo=lambda _: None)
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.parametrize(("spec", "sizes"), [*((s, {}) for s in SHIPPED), *OPTIONS])
def test_one_trace_writes_the_bytes_of_export_then_run_decompositions(
    spec: str, sizes: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two export paths on the same tiny model: its graphs hold every op the full-size graphs
    hold, only fewer of them (the full-size bytes are pinned by ``test_user_outputs``)."""
    assert export.one_pass_export() is not None  # the tested torch takes the one-trace path
    one = artifacts(spec, sizes, tmp_path / "one")
    monkeypatch.setattr(export, "one_pass_export", lambda: None)  # the two public calls
    two = artifacts(spec, sizes, tmp_path / "two")
    assert one.keys() == two.keys() and len(one) >= 4
    assert [name for name in one if one[name] != two[name]] == []


def test_an_untested_torch_takes_the_two_public_calls_and_doctor_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert torch.__version__.split("+")[0] in upstream.TESTED_TORCH
    assert "export               one trace per graph" in CliRunner().invoke(cli, ["doctor"]).output
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    assert export.one_pass_export() is None
    doctor = CliRunner().invoke(cli, ["doctor"]).output
    assert "export               two traces per graph: torch is not a tested release" in doctor


class _Raises(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def test_graphs_are_traced_without_node_stack_traces_and_the_setting_is_restored() -> None:
    import torch.fx.config

    before = torch.fx.config.do_not_emit_stack_traces
    program = export.export_program(torch.nn.Linear(4, 3), (torch.zeros(2, 4),), "prefill")
    assert [n.name for n in program.graph.nodes if n.op == "call_function"]  # something was traced
    assert [n.name for n in program.graph.nodes if n.meta.get("stack_trace")] == []
    assert torch.fx.config.do_not_emit_stack_traces is before
    with pytest.raises(KadaptError, match="torch.export failed on the decode wrapper"):
        export.export_program(_Raises(), (torch.zeros(2, 4),), "decode")
    assert torch.fx.config.do_not_emit_stack_traces is before


def test_the_kept_ops_table_is_rebuilt_when_an_op_is_registered() -> None:
    from torch.export.exported_program import _split_decomp_table_to_cia_and_python_decomp as split

    first = export._preserved_ops(split)
    assert export._preserved_ops(split) is first  # built once per set of registered ops
    assert set(first) == set(split({})[0])
    library = torch.library.Library("kadapt_test", "FRAGMENT")
    library.define("twice(Tensor x) -> Tensor")
    library.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
    again = export._preserved_ops(split)
    assert torch.ops.kadapt_test.twice.default in again and again is not first
    assert set(again) == set(split({})[0])


def test_exports_together_install_the_preserved_ops_once_and_remove_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.export.exported_program as exported_program

    real, installs = exported_program._override_composite_implicit_decomp, []

    def counted(preserved: Any) -> Any:
        installs.append(preserved)
        return real(preserved)

    monkeypatch.setattr(exported_program, "_override_composite_implicit_decomp", counted)
    linear = torch.ops.aten.linear.default
    kernels_before = dict(linear.py_kernels)
    model, inputs = torch.nn.Linear(4, 3), (torch.zeros(2, 4),)
    alone = [export.export_program(model, inputs, "prefill") for _ in range(2)]
    assert len(installs) == 2
    with export.exports_together():
        together = [export.export_program(model, inputs, "prefill") for _ in range(2)]
        assert len(installs) == 3 and dict(linear.py_kernels) != kernels_before  # installed, held
        library = torch.library.Library("kadapt_test_together", "FRAGMENT")
        library.define("twice(Tensor x) -> Tensor")
        library.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
        export.export_program(model, inputs, "prefill")
        assert len(installs) == 4 and torch.ops.kadapt_test_together.twice.default in installs[-1]
    assert dict(linear.py_kernels) == kernels_before  # removed on the way out
    assert [str(p.graph) for p in together] == [str(p.graph) for p in alone]
    with pytest.raises(KadaptError), export.exports_together():
        export.export_program(_Raises(), inputs, "decode")
    assert dict(linear.py_kernels) == kernels_before  # also after an error
