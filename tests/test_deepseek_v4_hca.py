"""DeepSeek-V4's heavily compressed attention (issue 36): the ``hca`` state kind, proven.

A tiny random DeepSeek-V4 whose layers are ``[sliding, hca, hca]`` (its compressed sparse layers are
``tests/test_deepseek_v4_csa.py``'s), compress rate 4, so the prompt closes windows and the
decode closes several more. Each hca layer keeps its sliding K=V window, a ring of the open window's raw
``kv_proj || gate_proj`` (slot ``p % rate``) and its compressed entries (slot ``w``: window ``w``), kept by
the pinned ``deepseek_v4_hca_compressor`` builtin through the static cache's
``compressed_window``/``write_compressed`` protocol. The wrappers' logits and every state equal
transformers' own ``DynamicCache`` (``DeepseekV4HCACache``) at every step; kadapt's export verifies,
rows joining a running batch, contiguous and paged; plan sizes the entries and counts the compressor's
tensors exactly; simulate prices the attention over the window and the entries. transformers 5.23 has the
family too: the guide's pin lists both releases' sources.
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from fixtures.modules import import_path
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction import options_from_spec, verify
from kimi_adapter_core.backends.extraction.ir import export
from kimi_adapter_core.backends.extraction.job.documents import kv_mapping_document
from kimi_adapter_core.backends.extraction.options import bind_structure
from kimi_adapter_core.backends.extraction.runtime import abi
from kimi_adapter_core.backends.extraction.tiny_model import randomize_constants
from kimi_adapter_core.backends.simulation.model.census import census
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.builtins.deepseek_v4 import deepseek_v4_hca_compressor
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError, Refusal
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import module_paths, write_spec
from kimi_adapter_core.generate import render_spec
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.structure.derive import derive_structure

RATE, WINDOW = 4, 4
BATCH, CAPACITY, STEPS = 2, 32, 20
TOLERANCE = 1e-4
HCA = "heavily_compressed_attention"
KINDS = ["attention", "hca", "hca"]


def _config() -> dict[str, Any]:
    """The family matrix's tiny DeepSeek-V4 with a sliding layer and two hca layers of rate 4."""
    config = tiny_config("deepseek_v4")
    config.update(
        num_hidden_layers=3,
        layer_types=["sliding_attention", HCA, HCA],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        hc_mult=2,
        sliding_window=WINDOW,
        compress_rates={"compressed_sparse_attention": 4, HCA: RATE},
    )
    return config


def _spec(folder: Path, batch: int = 1, paged: bool = False) -> Spec:
    config = _config()
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    path = write_spec(folder, "deepseek_v4", config, module_paths(built))
    text = path.read_text().replace("batch: 1", f"batch: {batch}")
    pool = "dtype: float32\n  kv_cache: {kind: paged, block_size: 8}\n"
    path.write_text(text.replace("dtype: float32\n", pool) if paged else text)
    return load_spec(path)


def test_the_structure_states_the_compressed_layers() -> None:
    """hca layers slide and compress (their rate, one entry of the K=V head's width); a compressed layer
    without its rate is refused by name."""
    s = derive_structure(_config())
    assert s.layer_kinds == ("attention", "hca", "hca") and s.windows == (WINDOW,) * 3
    assert s.compressor is not None and (s.compressor.rate, s.compressor.head_dim) == (RATE, 16)
    assert "2/3 compressed layers (a compressor of every 4 tokens into one 16-wide entry)" in s.describe()
    assert s.to_dict()["compressor"] == {"rate": RATE, "head_dim": 16, "overlap": 1, "indexer": None}
    missing = {**_config(), "compress_rates": {}}
    with pytest.raises(Refusal, match=r"compress_rates\['heavily_compressed_attention'\]"):
        derive_structure(missing)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**_config())).eval()
    randomize_constants(model)
    return model


def _wrappers(model: torch.nn.Module) -> tuple[abi.PrefillWrapper, abi.DecodeWrapper]:
    stack = model.model
    options: dict[str, Any] = {
        "kv_layout": "heads",
        "cache_keyword": upstream.cache_keyword(stack.layers[0]),
        "windows": [WINDOW] * 3,
        "rope_layer_types": upstream.rope_layer_types(stack),
        "layer_kinds": KINDS,
    }
    return (
        abi.PrefillWrapper.from_language_model(stack, model.lm_head, **options),
        abi.DecodeWrapper.from_language_model(stack, model.lm_head, **options),
    )


def _assert_compressor_states(states: list[torch.Tensor], cache: DynamicCache, written: int) -> None:
    """Each hca layer's entries are transformers' ``compressed_kv`` (the rest of the slots zeros) and the
    ring's live slots (the open window) its buffer."""
    for index in (1, 2):
        layer = cache.layers[index]
        ring, entries = states[2 + 4 * (index - 1) + 2 : 2 + 4 * (index - 1) + 4]
        closed = layer.entry_count["compressor"]
        assert closed == written // RATE
        expected = torch.zeros_like(entries)
        if closed:
            expected[:, 0, :closed] = layer.compressed_kv["compressor"]
        assert (entries - expected).abs().max() <= TOLERANCE, (index, written)
        buffered = layer.buffer_kv["compressor"]
        live = ring[:, 0, : buffered.shape[1], :16]  # the open window starts at a multiple of the rate
        assert live.shape[1] == written % RATE and torch.allclose(live, buffered, atol=TOLERANCE), index


@pytest.mark.compat
@pytest.mark.parametrize("prompt_len", [3, 6, 8])
def test_the_wrappers_states_are_transformers_cache(prompt_len: int) -> None:
    """Prefill (a prompt shorter than a window, one ending inside one, one ending on a boundary) and 20
    decode steps, batch 2: logits equal transformers' with its own DynamicCache at every step and every
    hca layer's entries and open window equal its DeepseekV4HCACache's."""
    model = _model()
    prefill, decode = _wrappers(model)
    original = modeling.DeepseekV4HCACompressor.forward
    keyword = upstream.cache_keyword(model)
    prompt = torch.randint(3, 128, (BATCH, prompt_len), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    _, mask, positions = abi.prefill_inputs(
        batch=BATCH, prefill_len=prompt_len, dtype=torch.float32, device="cpu"
    )
    try:
        modeling.DeepseekV4HCACompressor.forward = (  # the patch kadapt installs (a wrap of upstream's)
            lambda *args: deepseek_v4_hca_compressor(original, *args)
        )
        with torch.no_grad():
            reference = model(prompt, **{keyword: cache}, use_cache=True).logits
            logits, *present = prefill(prompt, mask, positions)
        assert (logits - reference).abs().max() <= TOLERANCE * reference.abs().max()
        assert present[4].shape == (BATCH, 1, RATE, 32) and present[5].shape == (
            BATCH,
            1,
            prompt_len // RATE,
            16,
        )
        states = abi.place_prefill_kv(present, CAPACITY, KINDS)
        assert states[5].shape == (BATCH, 1, CAPACITY // RATE, 16)
        _assert_compressor_states(states, cache, prompt_len)
        token = logits[:, -1:].argmax(-1)
        for step in range(STEPS):
            position = prompt_len + step
            positions = torch.full((BATCH, 1), position)
            mask = abi.additive_causal_mask(positions, CAPACITY, torch.float32)
            with torch.no_grad():
                reference = model(token, **{keyword: cache}, position_ids=positions, use_cache=True).logits
                logits, *states = decode(token, mask, positions, positions.view(-1), *states)
            assert (logits - reference).abs().max() <= TOLERANCE * reference.abs().max(), step
            _assert_compressor_states(states, cache, position + 1)
            token = logits[:, -1:].argmax(-1)
    finally:
        modeling.DeepseekV4HCACompressor.forward = original


@pytest.mark.compat
@pytest.mark.parametrize("paged", [False, True])
def test_kadapt_exports_and_verifies_rows_joining(tmp_path: Path, paged: bool) -> None:
    """kadapt's own export and verify, batch 2, contiguous and paged: prefill and 24 decode steps equal
    transformers' logits and generation, every returned state (the rings and entries too) equals its
    cache, and rows join a running batch (compressed stacks' prompts are never padded); the state
    mapping names the rings and entries and states their contract."""
    spec = _spec(tmp_path, batch=2, paged=paged)
    out = tmp_path / "out"
    options = dataclasses.replace(options_from_spec(spec, output_dir=out), verify_dtypes=("float32",))
    report = verify(spec, options, echo=lambda line: None, keep_in=out)
    checks = {check.name: check for check in report.checks}
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    states = checks["returned states"].detail
    assert "2 hca layers" in states and "comp_src max" in states and "comp max" in states
    assert "2 rows joining" in checks["joining rows"].detail
    mapping = json.loads((out / "deepseek_v4_kv_mapping.json").read_text())
    layer = mapping["layers"][1]
    assert layer["kind"] == "hca" and layer["compress_rate"] == RATE
    assert layer["prefill_comp_src_output"]["shape"] == [2, 1, RATE, 32]
    assert layer["prefill_comp_output"]["shape"] == [2, 1, 8 // RATE, 16]
    assert layer["decode_comp_input"]["shape"] == [2, 1, mapping["max_cache_len"] // RATE, 16]
    contract = mapping["contract"]
    assert contract["padding"]["supported"] == "none" and contract["compressed"]["rates"] == {"hca": RATE}
    assert "w < (p + 1) // rate" in contract["compressed"]["visibility"]


def test_a_spec_without_the_builtin_is_refused_at_the_compressors_cache_read(tmp_path: Path) -> None:
    """Upstream's compressor reads cache.layers (a Python-int entry count, growing buffers): without the
    builtin the layer probe refuses it, naming the read."""
    path = _spec(tmp_path).path
    text = path.read_text()
    path.write_text(text[: text.index("patches:")] + text[text.index("abi:") :])
    spec = load_spec(path)
    with pytest.raises(upstream.LayersUnsupported, match="reads cache.layers"):
        verify(spec, options_from_spec(spec, output_dir=tmp_path / "out"), echo=lambda line: None)


def test_plan_sizes_the_entries_and_counts_the_compressor(tmp_path: Path) -> None:
    """Every tensor of the built model in plan's inventory (the compressor's projections, its float32
    position bias and norm); one sequence keeps floor(T / rate) entries and a ring per hca layer."""
    spec = _spec(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**_config()))
    inputs = model_inputs(spec, None)
    assert census(inputs.groups, inputs.naming, model).problems() == []
    names = {group.name: group for group in inputs.groups}
    assert names["attn.compressor.position_bias"].dtype == "fp32"
    assert len(names["attn.compressor.projections"].checkpoint_names) == 2
    result = CliRunner().invoke(cli, ["plan", str(spec.path), "--seq-len", "256", "--format", "json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output[result.output.index("{") :])
    entries = plan["states"]["compressed_entries"]
    assert entries["kinds"]["hca"]["entries_per_sequence"] == 256 // RATE and entries["layer_ids"] == [1, 2]
    # bf16: 2 layers x (64 entries x 16 + a ring of 4 x 32) x 2 B
    assert entries["bytes_per_sequence"] == 2 * (64 * 16 + 4 * 32) * 2


def _attention_flops(spec: Spec, *args: str) -> float:
    command = ["simulate", str(spec.path), "--device", "h200", *args, "--format", "json"]
    result = CliRunner().invoke(cli, command)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{") :])
    return sum(op["flops"] for op in report["ops"] if "attention" in op["op"])


def test_simulate_prices_attention_over_the_window_and_the_entries(tmp_path: Path) -> None:
    """Decode at context 200: the sliding layer reads its 4 keys, each hca layer 4 plus the 50 entries
    closed by then (201 // 4); 4 heads x 2 (scores and values) x 2 x 16 FLOPs per key."""
    spec = _spec(tmp_path)
    flops = _attention_flops(spec, "--decode", "--context-len", "200")
    assert flops == 4 * 2 * 2 * 16 * (WINDOW + 2 * (WINDOW + 201 // RATE))


def test_generate_carries_the_compressed_layers(tmp_path: Path) -> None:
    """The generated extraction module carries the hca layers (their kind and rate, no indexer: the
    shipped DeepSeek-V4-Flash's module runs end to end in tests/test_generated_deepseek_v4.py), its
    config readers agreeing with kadapt's structure, and ``kadapt generate`` notes no skip."""
    spec = _spec(tmp_path)
    files, notes = render_spec(spec, ["extraction"], skip_inexpressible=True)
    assert notes == []
    path = tmp_path / "extraction.py"
    path.write_text(next(item.text for item in files if item.path.name == "extraction.py"))
    module = import_path(path, "generated_deepseek_v4_hca")
    assert module.LAYER_KINDS == module.layer_kinds(module.SOURCE_CONFIG) == ("attention", "hca", "hca")
    assert module.COMPRESS_RATES == module.compress_rates(module.SOURCE_CONFIG) == {"hca": RATE}
    assert [kind for _, kind, *_ in module.PATCHES] == ["wrap"] and not hasattr(module, "INDEX_DIM")


def test_the_generated_modules_paged_state_mapping_is_kadapts(tmp_path: Path) -> None:
    """Paged, the module's state mapping is the one ``kadapt apply`` writes (the rings and entries per
    request, never paged, beside the KV block pools), and its example decode inputs the export's."""
    spec = _spec(tmp_path, paged=True)
    files, _ = render_spec(spec, ["extraction"])
    path = tmp_path / "extraction.py"
    path.write_text(next(item.text for item in files if item.path.name == "extraction.py"))
    module = import_path(path, "generated_deepseek_v4_hca_paged")
    options = bind_structure(
        options_from_spec(spec, output_dir=tmp_path / "out"), derive_structure(_config())
    )
    expected = kv_mapping_document(options, types.SimpleNamespace(layers=[None] * 3))  # type: ignore[arg-type]
    for key in ("format_version", "model_name", "prefill_graph", "decode_graph"):
        expected.pop(key)
    config = module.text_config(module.load_config())
    assert module.kv_mapping(config) == expected
    got = module.decode_example_inputs(config)
    want = export.example_inputs("decode", types.SimpleNamespace(device="meta"), options, 3)  # type: ignore[arg-type]
    assert [t.shape for t in got] == [t.shape for t in want]


def test_a_cache_that_is_not_a_multiple_of_the_rate_is_refused_before_export(tmp_path: Path) -> None:
    """The entries take max_cache_len / rate slots: another capacity is refused, naming the rate."""
    options = dataclasses.replace(options_from_spec(_spec(tmp_path), output_dir=tmp_path), max_cache_len=30)
    with pytest.raises(
        KadaptError, match="max_cache_len 30 is not a multiple of the compressed layers' rate 4"
    ):
        bind_structure(options, derive_structure(_config()))
