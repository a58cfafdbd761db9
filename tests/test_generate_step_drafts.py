"""The generated extraction module serves an EAGLE-3 and an MTP draft as ``kadapt apply`` does (issue 39).

Aux layers (``aux_layers``, default the spec's ``abi.step.aux_layers``): the module's step graph, saved
by its ``save_ir``, has the inputs and outputs kadapt's step graph has, its state mapping equals kadapt's
(``step.aux_hidden_states`` included), and one call packing a prompt chunk beside another request's
prompt and then a last chunk beside two speculative tokens returns what kadapt's graph returns and, for
each asked token, transformers' ``hidden_states[i + 1]`` of the named layers (unpatched, fp32, tiny
random model; a forward hook for the last layer, whose ``hidden_states`` entry is after the final norm).

The MTP draft graph (a config with one MTP layer: DeepSeek-V3): the module's step graph with ``mtp`` and
its MTP graph, fed every prompt position, draft what kadapt's graphs draft and what transformers'
``MtpModel`` drafts after each prefix; its mapping's ``mtp`` section is kadapt's; and the reference
engine (``examples/reference_engine.py``), drafting with the module's MTP graph, serves requests (a
shared prefix block among them) whose tokens are ``generate()``'s and whose every draft is ``MtpModel``'s
after the tokens before it. Refused as kadapt
refuses: without ``MtpModel`` in transformers, with a config that has no MTP layer, and at generate time
for a spec asking ``abi.step.mtp`` of such a config, located there.
"""

from __future__ import annotations

import json
import random
import shutil
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch_ir
from fixtures.engine_trace import generate
from fixtures.modules import REPO, import_path
from fixtures.step_graph import (
    Sizes,
    StepGraph,
    extract_step,
    layer_outputs,
    mtp_executor,
    mtp_reference_draft,
    step_executor,
)

from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.generate.common import NotExpressible
from kimi_adapter_core.generate.extraction import render_extraction
from kimi_adapter_core.spec import load_spec

SIZES = Sizes(rows=3, cache=24, block=4, blocks=17, tokens=12, logits=12)
REQUESTS = 8  # served by the reference engine from the module's graphs, drafting with its MTP graph
LONG, SHORT = 10, 6  # request 0: chunks of 6 and 4; request 1: a 4-token prompt, then 2 speculative tokens
QUIET = pytest.mark.filterwarnings("ignore:Skipping .* meta-device constant:UserWarning")


def _module(name: str, graph: StepGraph, tmp_path: Path) -> tuple[types.ModuleType, dict[str, Any]]:
    """The generated module of ``name`` and the tiny overrides ``extract_step`` built its model with."""
    module = import_path(REPO / "adapters" / name / "extraction.py", f"generated_{name}_drafts")
    spec = load_spec(name)
    options = options_from_spec(
        spec,
        output_dir=tmp_path / "options",
        batch=SIZES.rows,
        prefill_len=SIZES.prefill,
        max_cache_len=SIZES.cache,
        block_size=SIZES.block,
        num_blocks=SIZES.blocks,
    )
    return module, tiny_overrides(spec, options)


def _kadapt_names(graph: StepGraph, kind: str) -> tuple[list[str], list[str]]:
    document = json.loads((graph.out / graph.mapping[kind]["graph"]).read_text())
    return [t["name"] for t in document["graph_inputs"]], [t["name"] for t in document["graph_outputs"]]


def _sizes() -> dict[str, Any]:
    return {"rows": SIZES.rows, "max_cache_len": SIZES.cache, "block_size": SIZES.block}


def _mapping(module: types.ModuleType, config: Any, **drafts: Any) -> dict[str, Any]:
    return module.kv_mapping(
        config,
        batch=SIZES.rows,
        prefill_len=SIZES.prefill,
        max_cache_len=SIZES.cache,
        dtype=None,
        step=(SIZES.tokens, SIZES.logits),
        num_blocks=SIZES.blocks,
        block_size=SIZES.block,
        **drafts,
    )


def _without_files(mapping: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v
        for k, v in mapping.items()
        if k not in ("format_version", "model_name", "prefill_graph", "decode_graph")
    }


def _saved(module: types.ModuleType, ir: Any, path: Path, kind: str, **drafts: Any) -> Any:
    return torch_ir.load_ir(str(module.save_ir(ir, path, kind, **drafts)))


def _pack(items: list[tuple[int, list[int], list[int]]], table: torch.Tensor, pools: list[torch.Tensor]):
    """One step call of ``(row, positions, sequence)`` items, every token asked; ``(row, position)`` of
    each asked row."""
    ids, positions, rows = [], [], []
    for row, where, sequence in items:
        ids += [sequence[p] for p in where]
        positions += where
        rows += [row] * len(where)
    pad = SIZES.tokens - len(ids)
    call = (
        torch.tensor(ids + [0] * pad),
        torch.tensor(positions + [0] * pad),
        torch.tensor(rows + [SIZES.rows - 1] * pad),  # the scratch row
        table,
        torch.arange(SIZES.logits),
        *pools,
    )
    return call, list(zip(rows, positions, strict=True))


def _table(mapping: dict[str, Any]) -> torch.Tensor:
    order = torch.randperm(SIZES.blocks, generator=torch.Generator().manual_seed(3))
    per_row = mapping["contract"]["paged"]["blocks_per_row"]
    table = torch.full((SIZES.rows, per_row), int(order[0]), dtype=torch.long)  # the scratch block
    for row in range(SIZES.rows - 1):
        table[row] = order[1 + row * per_row : 1 + (row + 1) * per_row]
    return table


def _pools(mapping: dict[str, Any]) -> list[torch.Tensor]:
    entries = [e for layer in mapping["layers"] for key, e in layer.items() if key.endswith("_input")]
    return [torch.zeros(e["shape"]) for e in entries]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))


@QUIET
@pytest.mark.slow
def test_the_generated_step_graph_returns_aux_layers_as_kadapt_and_transformers(tmp_path: Path) -> None:
    aux = (0, 2)  # a middle layer and the last (before the final norm)
    graph = extract_step("llama", tmp_path / "kadapt", SIZES, aux_layers=aux)
    module, tiny = _module("llama", graph, tmp_path)
    assert module.STEP_AUX_LAYERS == ()  # the spec states none: the caller's override
    meta = module.build_model(device="meta", overrides=tiny, dtype=None)
    config = module.text_config(meta.config)
    example = module.step_example_inputs(
        config, tokens=SIZES.tokens, logits=SIZES.logits, num_blocks=SIZES.blocks, dtype=None, **_sizes()
    )
    with torch.no_grad(), module.patches_applied():
        ir = torch_ir.extract_ir(module.step_wrapper(meta, aux_layers=aux), example)
    loaded = _saved(module, ir, tmp_path / "llama_step_ir.json", "step", aux_layers=aux)
    layers = config.num_hidden_layers
    names = module.graph_names("step", layers, aux_layers=aux)
    assert ([t.name for t in loaded.graph_inputs], [t.name for t in loaded.graph_outputs]) == names
    assert names == _kadapt_names(graph, "step") and names[1][:2] == ["logits", "aux_hidden_states"]
    mapping = _mapping(module, config, aux_layers=aux)
    assert mapping == _without_files(graph.mapping)
    assert mapping["step"]["aux_hidden_states"]["layers"] == list(aux)
    assert "aux_hidden_states" not in _mapping(module, config)["step"]  # the default: the spec's ()
    with pytest.raises(ValueError, match=r"aux layers \[3\] are not among the 3 layers"):
        module.step_wrapper(meta, aux_layers=(3,))

    cpu = module.build_model(device="cpu", overrides=tiny, dtype=None)
    cpu.load_state_dict(graph.model.state_dict())
    with module.patches_applied():
        weights = module.graph_weights(module.step_wrapper(cpu, aux_layers=aux))
    kadapt = step_executor(graph, check_ownership=True)
    generator = torch.Generator().manual_seed(6)
    long, short = (
        torch.randint(3, config.vocab_size, (n,), generator=generator).tolist() for n in (LONG, SHORT)
    )
    table, pools, kadapt_pools = _table(mapping), _pools(mapping), _pools(mapping)
    outputs = {0: layer_outputs(graph.model, long), 1: layer_outputs(graph.model, short)}
    checked = 0
    for items in (
        [(0, list(range(6)), long), (1, list(range(4)), short)],  # a chunk beside a whole prompt
        [(0, list(range(6, LONG)), long), (1, [4, 5], short)],  # the last chunk, 2 speculative tokens
    ):
        call, asked = _pack(items, table, pools)
        logits, hidden, *pools = module.run_graph(
            loaded, weights, call, "step", mapping=mapping, check_ownership=True
        )
        theirs = kadapt((*call[:5], *kadapt_pools))
        kadapt_pools = theirs[2:]
        assert _close(logits, theirs[0]) and _close(hidden, theirs[1])
        assert all(_close(a, b) for a, b in zip(pools, kadapt_pools, strict=True))
        for index, (row, position) in enumerate(asked):
            expected = torch.cat([outputs[row][layer][position] for layer in aux])
            assert _close(hidden[index], expected), (row, position)
            checked += 1
    assert checked == LONG + SHORT


@QUIET
@pytest.mark.slow
def test_the_generated_mtp_graph_drafts_as_kadapt_and_transformers_mtp_model(tmp_path: Path) -> None:
    aux = (1,)
    graph = extract_step("deepseek_v3", tmp_path / "kadapt", SIZES, mtp=True, aux_layers=aux)
    module, tiny = _module("deepseek_v3", graph, tmp_path)
    assert (module.STEP_MTP, module.STEP_AUX_LAYERS) == (False, ())  # the spec asks neither
    drafts = {"aux_layers": aux, "mtp": True}
    meta = module.build_model(device="meta", overrides=tiny, dtype=None)
    config = module.text_config(meta.config)
    sizes = {
        "tokens": SIZES.tokens,
        "logits": SIZES.logits,
        "num_blocks": SIZES.blocks,
        "dtype": None,
        **_sizes(),
    }
    meta_mtp = module.mtp_module(meta, dtype=None)
    with torch.no_grad(), module.patches_applied():
        step_ir = torch_ir.extract_ir(
            module.step_wrapper(meta, **drafts), module.step_example_inputs(config, **sizes)
        )
        mtp_ir = torch_ir.extract_ir(
            module.mtp_wrapper(meta, meta_mtp), module.mtp_example_inputs(config, **sizes)
        )
    step = _saved(module, step_ir, tmp_path / "step.json", "step", **drafts)
    mtp = _saved(module, mtp_ir, tmp_path / "mtp.json", "mtp")
    for kind, loaded in (("step", step), ("mtp", mtp)):
        names = module.graph_names(kind, config.num_hidden_layers, **drafts)
        assert ([t.name for t in loaded.graph_inputs], [t.name for t in loaded.graph_outputs]) == names
        assert names == _kadapt_names(graph, kind), kind
    mapping = _mapping(module, config, **drafts)
    assert mapping == _without_files(graph.mapping)
    assert mapping["mtp"]["graph"] == graph.mapping["mtp"]["graph"] == "deepseek_v3_mtp_ir.json"

    cpu = module.build_model(device="cpu", overrides=tiny, dtype=None)
    cpu.load_state_dict(graph.model.state_dict())
    cpu_mtp = module.mtp_module(cpu, dtype=None)
    cpu_mtp.layers.load_state_dict(graph.mtp.layers.state_dict())
    with module.patches_applied():
        step_weights = module.graph_weights(module.step_wrapper(cpu, **drafts))
        mtp_weights = module.graph_weights(module.mtp_wrapper(cpu, cpu_mtp))
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=generator).tolist() for n in (7, 4)]
    table = _table(mapping)
    call, asked = _pack(
        [(row, list(range(len(p))), p) for row, p in enumerate(prompts)], table, _pools(mapping)
    )
    logits, hidden, _aux, *_ = module.run_graph(
        step, step_weights, call, "step", mapping=mapping, check_ownership=True
    )
    theirs = step_executor(graph, check_ownership=True)(call)
    assert all(_close(a, b) for a, b in zip((logits, hidden, _aux), theirs[:3], strict=True))
    # every prompt position fed to the MTP graph: its hidden state and the token after it (the greedy
    # token after the last)
    sequences = [
        p + [int(logits[len(asked) - 1 if row else len(p) - 1].argmax())] for row, p in enumerate(prompts)
    ]
    ids = torch.tensor(
        [sequences[row][position + 1] for row, position in asked] + [0] * (SIZES.tokens - len(asked))
    )
    pools = [torch.zeros(p["shape"]) for p in mapping["mtp"]["pools"]]
    mtp_call = (hidden, ids, *call[1:5], *pools)
    draft, *_ = module.run_graph(mtp, mtp_weights, mtp_call, "mtp", mapping=mapping, check_ownership=True)
    assert _close(draft, mtp_executor(graph, check_ownership=True)(mtp_call)[0])
    for index, (row, position) in enumerate(asked):  # row i drafts position + 2, after the tokens up to + 1
        reference = mtp_reference_draft(graph, sequences[row][: position + 2])
        assert _close(draft[index], reference) and int(draft[index].argmax()) == int(reference.argmax())

    # the reference engine drafts from the module's graphs alone (its step calls' aux output unread)
    engine_module = import_path(REPO / "examples" / "reference_engine.py", "reference_engine")

    def execute(call: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        logits, hidden, _aux, *pools = module.run_graph(
            step, step_weights, call, "step", mapping=mapping, check_ownership=True
        )
        return [logits, hidden, *pools]

    def draft(call: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        return module.run_graph(mtp, mtp_weights, call, "mtp", mapping=mapping, check_ownership=True)

    rng = random.Random(7)
    prefix = [rng.randrange(3, config.vocab_size) for _ in range(2 * SIZES.block)]  # one block shareable
    requests = []
    for _ in range(REQUESTS):
        own = [rng.randrange(3, config.vocab_size) for _ in range(rng.randint(2, 7))]
        prompt = prefix + own if rng.random() < 0.5 else own
        requests.append(engine_module.Request(prompt, rng.randint(1, 6), rng.randrange(10)))
    engine = engine_module.ReferenceEngine(mapping, execute, mtp=draft)
    engine.serve(requests)
    assert engine.drafted > REQUESTS and engine.shared_blocks >= 1
    for request in requests:
        assert request.output == generate(graph.model, request.prompt, request.max_new), request.prompt
        for position, token in request.drafts:
            assert token == int(mtp_reference_draft(graph, request.tokens[:position]).argmax())

    # refused as kadapt refuses: a config without an MTP layer, a transformers without MtpModel
    no_layer = module.build_model(
        device="meta", overrides={**tiny, "num_nextn_predict_layers": 0}, dtype=None
    )
    with pytest.raises(
        module.KadaptError, match="^no MTP draft graph: the deepseek_v3 config has no MTP layers"
    ):
        module.mtp_module(no_layer)
    with pytest.raises(
        module.KadaptError, match="^no MTP draft graph: the deepseek_v3 config has no MTP layers"
    ):
        _mapping(module, module.text_config(no_layer.config), mtp=True)
    assert "mtp" not in _mapping(module, module.text_config(no_layer.config))  # the default: the spec's off


def test_without_transformers_mtp_model_the_module_refuses_the_mtp_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import transformers.modeling_layers

    module = import_path(REPO / "adapters" / "glm4_moe" / "extraction.py", "generated_glm4_moe_drafts")
    meta = module.build_model(device="meta", overrides={"num_hidden_layers": 2}, dtype=None)
    monkeypatch.delattr(transformers.modeling_layers, "MtpModel")
    with pytest.raises(
        module.KadaptError,
        match=r"^no MTP draft graph: transformers .* has no transformers\.modeling_layers\.MtpModel",
    ):
        module.mtp_module(meta)


def test_only_configs_with_an_mtp_layer_get_the_mtp_graph() -> None:
    """transformers' config decides, as for ``kadapt apply``: DeepSeek-V3.2 states
    ``num_nextn_predict_layers: 1``, which its config class does not read (its model builds none)."""
    for name, has in (
        ("deepseek_v3", True),
        ("glm4_moe", True),
        ("deepseek_v32", False),
        ("kimi_k25", False),
        ("llama", False),
    ):
        text = (REPO / "adapters" / name / "extraction.py").read_text()
        assert ("def mtp_wrapper(" in text) is has and ('"mtp": (MTP_INPUTS, MTP_OUTPUTS)' in text) is has, (
            name
        )


def test_generate_refuses_an_mtp_graph_of_a_config_without_one_located_at_the_spec_entry(
    tmp_path: Path,
) -> None:
    shutil.copytree(REPO / "specs" / "llama", tmp_path / "llama")
    text = (REPO / "specs" / "llama.yaml").read_text(encoding="utf-8")
    assert "\n  max_cache_len: 2048\n" in text
    path = tmp_path / "llama.yaml"
    step = "\n  max_cache_len: 2048\n  step: {tokens: 8, mtp: true}\n"
    path.write_text(text.replace("\n  max_cache_len: 2048\n", step), encoding="utf-8")
    spec = load_spec(path)
    with pytest.raises(
        NotExpressible, match="no MTP draft graph: the llama config has no MTP layers"
    ) as refused:
        render_extraction(spec)
    assert refused.value.location == spec.locate("abi.step.mtp")


def test_a_spec_stating_aux_layers_and_mtp_bakes_them_in(tmp_path: Path) -> None:
    shutil.copytree(REPO / "specs" / "deepseek_v3", tmp_path / "deepseek_v3")
    text = (REPO / "specs" / "deepseek_v3.yaml").read_text(encoding="utf-8")
    path = tmp_path / "deepseek_v3.yaml"
    path.write_text(
        text.replace(
            "\n  max_cache_len: 2048\n",
            "\n  max_cache_len: 2048\n  step: {tokens: 8, mtp: true, aux_layers: [1, 60]}\n",
        ),
        encoding="utf-8",
    )
    (rendered, *_) = render_extraction(load_spec(path))
    assert "STEP_AUX_LAYERS: tuple[int, ...] = (1, 60)\n" in rendered.text
    assert "STEP_MTP = True\n" in rendered.text
