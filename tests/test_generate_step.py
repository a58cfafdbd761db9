"""The generated extraction module gives a serving loop all it needs (issue 39 item 5: "the generated
extraction module exposes what such a loop needs"): ``save_ir(..., "step")`` names the packed step graph's
inputs and outputs as ``kadapt apply --step-tokens`` does, ``kv_mapping(step=..., num_blocks=...)`` is the
state mapping kadapt writes for the same sizes (a contiguous spec's cache paged for the step, as kadapt
pages it), and the reference engine (``examples/reference_engine.py``), reading nothing but that mapping
and calling the module's ``run_graph`` with every binder check and the ownership check on, serves a seeded
trace of requests whose tokens equal transformers' ``generate()`` of each request alone."""

from __future__ import annotations

import dataclasses
import json
import random
import types
from pathlib import Path

import pytest
import torch
import torch_ir
from click.testing import CliRunner
from fixtures.engine_trace import generate
from fixtures.modules import REPO, import_path

from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.job.documents import kv_mapping_document
from kimi_adapter_core.backends.extraction.options import bind_structure
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.cli import cli
from kimi_adapter_core.loading import load_config
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.derive import derive_structure

NAME = "llama"  # contiguous in its spec: the step pages it
ROWS, PREFILL, CACHE, BLOCK, BLOCKS, TOKENS, LOGITS = 9, 8, 32, 4, 40, 16, 8
REQUESTS = 16


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[types.ModuleType, dict]:
    module = import_path(REPO / "adapters" / NAME / "extraction.py", f"generated_{NAME}_step")
    spec = load_spec(REPO / "specs" / f"{NAME}.yaml")
    out = tmp_path_factory.mktemp("options")
    options = options_from_spec(spec, output_dir=out, prefill_len=PREFILL, max_cache_len=CACHE)
    return module, tiny_overrides(spec, options)


def test_the_generated_step_mapping_is_the_one_kadapt_writes(generated, tmp_path: Path) -> None:
    module, tiny = generated
    spec = load_spec(REPO / "specs" / f"{NAME}.yaml")
    options = options_from_spec(
        spec,
        output_dir=tmp_path,
        batch=ROWS,
        prefill_len=PREFILL,
        max_cache_len=CACHE,
        block_size=BLOCK,
        num_blocks=BLOCKS,
        step_tokens=TOKENS,
        step_logits=LOGITS,
    )
    text = load_config(spec, backend="extraction", overrides=tiny)
    structure = derive_structure(text, spec)
    bound = dataclasses.replace(bind_structure(options, structure), dtype=module.DTYPE)
    kadapt = kv_mapping_document(bound, types.SimpleNamespace(layers=[None] * structure.num_layers))  # type: ignore[arg-type]
    for key in ("format_version", "model_name", "prefill_graph", "decode_graph"):
        kadapt.pop(key)
    config = module.text_config(module.load_config(overrides=tiny))
    mapping = module.kv_mapping(
        config,
        batch=ROWS,
        prefill_len=PREFILL,
        max_cache_len=CACHE,
        step=(TOKENS, LOGITS),
        num_blocks=BLOCKS,
        block_size=BLOCK,
    )
    assert mapping == kadapt
    assert mapping["step"]["graph"] == options.path("step").name
    assert mapping["contract"]["paged"]["num_blocks"] == BLOCKS  # apart from rows x context (72)
    assert module.kv_mapping(config, max_cache_len=CACHE) == module.kv_mapping(
        config, max_cache_len=CACHE, step=None
    )
    assert "step" not in module.kv_mapping(config, max_cache_len=CACHE)
    for bad, match in (
        ({"step": (4, 8)}, "1 <= logits <= tokens"),
        ({"num_blocks": 8}, "give step too"),
        ({"step": (8, 4), "block_size": 5}, "not a whole number of 5-token blocks"),
    ):
        with pytest.raises(ValueError, match=match):
            module.kv_mapping(config, max_cache_len=CACHE, **bad)


def _trace(vocab: int) -> list[tuple[list[int], int, int]]:
    rng = random.Random(11)
    prefix = [rng.randrange(3, vocab) for _ in range(2 * BLOCK)]
    requests = []
    for _ in range(REQUESTS):
        own = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))]
        requests.append((prefix + own if rng.random() < 0.5 else own, rng.randint(1, 6), rng.randrange(20)))
    return requests


@pytest.mark.filterwarnings(
    "ignore:Skipping .* meta-device constant:UserWarning"
)  # rotary buffers: no values
def test_an_engine_serves_requests_from_the_generated_modules_files_alone(generated, tmp_path: Path) -> None:
    module, tiny = generated
    meta = module.build_model(device="meta", overrides=tiny, dtype=None)
    config = module.text_config(meta.config)
    example = module.step_example_inputs(
        config,
        tokens=TOKENS,
        logits=LOGITS,
        rows=ROWS,
        max_cache_len=CACHE,
        block_size=BLOCK,
        num_blocks=BLOCKS,
        dtype=None,
    )
    with torch.no_grad(), module.patches_applied():
        ir = torch_ir.extract_ir(module.step_wrapper(meta), example)
    path = module.save_ir(ir, tmp_path / f"{module.FILE_PREFIX}_step_ir.json", "step")
    written = module.write_kv_mapping(
        tmp_path,
        config,
        batch=ROWS,
        prefill_len=PREFILL,
        max_cache_len=CACHE,
        dtype=None,
        step=(TOKENS, LOGITS),
        num_blocks=BLOCKS,
        block_size=BLOCK,
    )
    mapping = json.loads(written.read_text())
    loaded = torch_ir.load_ir(str(path))
    layers = config.num_hidden_layers
    assert (
        [t.name for t in loaded.graph_inputs],
        [t.name for t in loaded.graph_outputs],
    ) == module.graph_names("step", layers)
    assert [i["name"] for i in mapping["step"]["inputs"]] == module.graph_names("step", layers)[0][:5]

    torch.manual_seed(0)
    cpu = module.build_model(device="cpu", overrides=tiny, dtype=None).eval()
    with module.patches_applied():
        weights = module.graph_weights(module.step_wrapper(cpu))
    engine_module = import_path(REPO / "examples" / "reference_engine.py", "reference_engine")

    def execute(call: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        return module.run_graph(loaded, weights, call, "step", mapping=mapping, check_ownership=True)

    class RecordingEngine(engine_module.ReferenceEngine):
        """The engine, recording each call's rows as ``kadapt simulate --steps`` reads them."""

        recorded: list[dict] = []

        def _plan(self, running):
            plan = super()._plan(running)
            if plan:
                rows = [
                    {"query": len(tokens), "context": start, "logits": wanted}
                    for _request, start, tokens, wanted in plan
                ]
                self.recorded.append({"rows": rows})
            return plan

    requests = [engine_module.Request(p, n, a) for p, n, a in _trace(config.vocab_size)]
    engine = RecordingEngine(mapping, execute)
    engine.serve(requests)
    for index, request in enumerate(requests):  # transformers unpatched: outside patches_applied()
        assert request.output == generate(cpu, request.prompt, request.max_new), index
    assert engine.shared_blocks >= 2  # the shared prefix was read from the cache
    assert len({tuple(r.output) for r in requests}) > REQUESTS // 2

    # kadapt simulate prices the same trace's steps, on the full-size model the spec ships
    trace = tmp_path / "engine_trace.json"
    trace.write_text(
        json.dumps({"source": "examples/reference_engine.py", "steps": RecordingEngine.recorded})
    )
    result = CliRunner().invoke(
        cli, ["simulate", f"specs/{NAME}.yaml", "--device", "h100", "--steps", str(trace), "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    priced = json.loads(result.output)
    fed = sum(row["query"] for step in RecordingEngine.recorded for row in step["rows"])
    assert len(priced["steps"]) == len(RecordingEngine.recorded) and priced["tokens"] == fed
    prompts = sum(len(r.prompt) for r in requests)
    assert fed < prompts + sum(r.max_new for r in requests)  # cached prefix blocks were not fed again
    assert priced["logits_rows"] == sum(r.max_new for r in requests)  # one sampled token per logits row
    paths = {step["path"] for step in priced["steps"]}
    assert paths == {"decode", "prefill"} and all(step["time_s"] > 0 for step in priced["steps"])
