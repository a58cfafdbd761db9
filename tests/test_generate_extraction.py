"""The generated extraction modules, used the way other tools use them: imported by path, no kadapt.

For every shipped spec with an ABI (discovered from ``specs/*.yaml``, so a new spec is covered
without editing this file) the committed ``adapters/<spec>/extraction.py`` is imported by path and
checked against kadapt itself:

- what it bakes in (attention kind, KV layout, KV dims, sliding windows, structure) is kadapt's
  structure of the shipped config, and its config readers agree with kadapt's ``derive_structure`` on
  the shipped and on a tiny config;
- on a tiny random-weight model of the family (shrunk the way ``--verify`` shrinks it) its prefill
  and a few greedy decode steps equal kadapt's own runtime wrappers bit for bit and transformers'
  eager forward within ``--verify``'s tolerance;
- for one GQA family with sliding windows and one MLA family, the module goes through
  ``torch_ir.extract_ir`` exactly as its docstring says, torch_ir's executor replays the IR, and the
  file the module's ``save_ir`` writes loads and replays the same (``save_ir``'s encoding is kadapt's
  IR writer's; it refuses the wrong graph and writes atomically; ``torch_ir.save_ir`` cannot write
  these graphs at all).

``test_generated_module_roundtrip.py`` runs the module's documented flow vendored outside the
checkout, without kadapt, against transformers' ``generate()``.

The committed files equal a fresh render (``test_generate.py``), so this tests what ``kadapt
generate`` produces.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import json
import math
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch_ir
from fixtures.modules import import_path, outside_runtime
from torch_ir.executor import ExecutionError

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.ir import encoding
from kimi_adapter_core.backends.extraction.job.documents import kv_mapping_document
from kimi_adapter_core.backends.extraction.names import state_roles
from kimi_adapter_core.backends.extraction.options import ExtractionOptions, bind_structure
from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.generate.embed import split_module
from kimi_adapter_core.loading import applied, load_config, load_model, submodule
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.structure.derive import derive_structure
from kimi_adapter_core.structure.model import ModelStructure
from kimi_adapter_core.structure.of_spec import structure_of_config
from kimi_adapter_core.structure.states import RecurrentState

REPO = Path(__file__).resolve().parents[1]
SPEC_PATHS = sorted((REPO / "specs").glob("*.yaml"))
# Specs without an `abi` have no extraction target (test_generate.py checks the skip note), nor those
# whose module generate skips (test_generated_probes.py's NOT_GENERATED).
EXTRACTABLE = [
    p.stem
    for p in SPEC_PATHS
    if load_spec(p).abi is not None and (REPO / "adapters" / p.stem / "extraction.py").is_file()
]
# torch_ir.extract_ir end to end: GQA with a sliding window on every layer, and MLA + MoE.
TORCH_IR = ("mistral", "kimi_k25")
PREFILL, CACHE, STEPS = 8, 16, 3
TOLERANCE = 1e-4  # --verify's default for logits against transformers
# Families whose transformers decode step departs from a full forward over the same tokens: their
# decode is checked against transformers' own cached step (the path generate() takes) instead.
# NemotronH's Mamba2 chunk scan clamps dt at time_step_min, its recurrent step does not
# (modeling_nemotron_h: mamba2_chunk_scan takes dt_limit, mamba2_selective_state_update ignores it);
# test_nemotron_h_decode_departs_only_by_the_dt_clamp shows that this is the whole departure.
CACHED_PATH_ONLY = {"nemotron_h"}
MLA_WORDS = ("mla", "latent", "reexpand", "absorbed", "kv_lora")
# torch_ir notes that the rotary buffers of a meta model have no values (they come with the weights)
QUIET_META_CONSTANTS = pytest.mark.filterwarnings("ignore:Skipping .* meta-device constant:UserWarning")


@dataclass(frozen=True)
class Family:
    """One shipped spec, its generated module and kadapt's view of a tiny model of it."""

    spec: Spec
    module: types.ModuleType
    path: Path
    tiny: dict[str, Any]
    options: ExtractionOptions  # bound to the tiny structure, verify sizes
    shipped: ModelStructure  # kadapt's structure of the shipped config (extraction bridges)
    structure: ModelStructure  # kadapt's structure of the tiny config


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Family]:
    cache: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in cache:
            spec = load_spec(REPO / "specs" / f"{name}.yaml")
            path = REPO / "adapters" / name / "extraction.py"
            module = import_path(path, f"generated_{name}_extraction")
            options = options_from_spec(
                spec, output_dir=tmp_path_factory.mktemp(name), prefill_len=PREFILL, max_cache_len=CACHE
            )
            tiny = tiny_overrides(spec, options)
            text = kadapt_text_config(spec, load_config(spec, backend="extraction", overrides=tiny))
            structure = derive_structure(text, spec)
            shipped = structure_of_config(spec, load_config(spec, backend="extraction"))
            bound = dataclasses.replace(bind_structure(options, structure), dtype="float32")
            cache[name] = Family(spec, module, path, tiny, bound, shipped, structure)
        return cache[name]

    return get


def kadapt_text_config(spec: Spec, config: Any) -> Any:
    return getattr(config, spec.abi.config) if spec.abi is not None and spec.abi.config else config


# -- what the module bakes in ---------------------------------------------------------------------


@pytest.mark.parametrize("name", EXTRACTABLE)
def test_module_is_standalone_and_bakes_in_kadapts_structure(
    family: Callable[[str], Family], name: str
) -> None:
    fam = family(name)
    module, shipped = fam.module, fam.shipped
    tree = ast.parse(fam.path.read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(i.startswith("kimi_adapter_core") for i in imported), imported

    layout = fam.spec.abi.kv_layout or shipped.attention.default_kv_layout
    assert module.ATTENTION == shipped.attention.kind
    assert module.KV_LAYOUT == layout
    assert module.KV_DIMS == shipped.attention.kv_dims(layout)
    assert module.WINDOWS == shipped.windows
    expected = shipped.to_dict()
    expected["attention"] = {k: v for k, v in expected["attention"].items() if v is not None}
    for run in expected["layers"]:  # a layer's own attention (per-layer KV shapes), its fields alike
        if "attention_shape" in run:
            run["attention_shape"] = {k: v for k, v in run["attention_shape"].items() if v is not None}
    # model_type is the shipped config's (Kimi's text_config says kimi_k2, which transformers builds
    # as its deepseek_v3 config class); every structural fact is the built config's
    baked = dict(module.STRUCTURE)
    source = module.SOURCE_CONFIG[module.ABI_CONFIG] if module.ABI_CONFIG else module.SOURCE_CONFIG
    assert baked.pop("model_type") == source["model_type"]
    expected.pop("model_type")
    assert baked == expected
    # the module's own config readers give the baked values for the config it ships
    text = module.text_config(module.load_config())
    assert module.kv_dims(text) == module.KV_DIMS
    assert module.windows(text) == module.WINDOWS
    assert hasattr(module, "MLA_ATTENTION") == shipped.attention.is_mla
    # each layer's own KV dims, where the layers cache different shapes (Gemma-4-31B)
    per_layer = shipped.layer_kv_dims(layout)
    assert getattr(module, "LAYER_KV_DIMS", None) == per_layer
    if per_layer is not None:
        assert module.layer_kv_dims(text) == per_layer
    # a stack of several layer kinds: each layer's, and a compressed kind's rate (DeepSeek-V4)
    if hasattr(module, "LAYER_KINDS"):
        assert module.LAYER_KINDS == module.layer_kinds(text) == shipped.layer_kinds
    rates = {kind: compressor.rate for kind, compressor in shipped.compressors.items()}
    assert getattr(module, "COMPRESS_RATES", {}) == rates
    if rates:
        assert module.compress_rates(text) == rates
    if not shipped.attention.is_mla:
        words = outside_runtime(fam.path.read_text(encoding="utf-8")).lower()
        assert not [w for w in MLA_WORDS if w in words]


def linear_states_read(structure: ModelStructure, dtype: str) -> Any:
    """The linear layers' states as the extraction binds them once the layers handed them over (the
    pipeline checks they are the ones the config implies): the conv window in the ABI dtype, the
    recurrent state in its own (a lightning layer's: the ABI dtype, and no conv window)."""
    linear = structure.linear
    if linear is None:
        return None
    return tuple(
        (state.shape(), state.dtype_in(dtype) if isinstance(state, RecurrentState) else dtype)
        for _, state in linear.states
    )


@pytest.mark.parametrize("name", EXTRACTABLE)
def test_config_readers_follow_a_tiny_config_like_kadapt(family: Callable[[str], Family], name: str) -> None:
    fam = family(name)
    module = fam.module
    text = module.text_config(module.load_config(overrides=fam.tiny))
    assert module.kv_dims(text) == fam.options.kv_dims
    assert module.windows(text) == fam.structure.windows
    if fam.shipped.has_sliding_layers:  # tiny windows are shorter than the prompt: they decide results
        assert {w for w in fam.structure.windows if w is not None} == {4}
        assert (None in fam.structure.windows) == (None in fam.shipped.windows)  # full layers stay full
    layers = fam.structure.num_layers
    mapping = module.kv_mapping(text, prefill_len=PREFILL, max_cache_len=CACHE)
    options = dataclasses.replace(
        fam.options, dtype=module.DTYPE, linear_states=linear_states_read(fam.structure, module.DTYPE)
    )
    kadapt = kv_mapping_document(options, types.SimpleNamespace(layers=[None] * layers))  # type: ignore[arg-type]
    for key in ("format_version", "model_name", "prefill_graph", "decode_graph"):
        kadapt.pop(key)
    assert mapping == kadapt


def test_a_spec_without_kv_layout_gets_its_attentions_default(family: Callable[[str], Family]) -> None:
    """The shipped GQA specs leave abi.kv_layout out; the MLA ones may state it or not."""
    defaults = [n for n in EXTRACTABLE if family(n).spec.abi.kv_layout is None]
    assert defaults, "no shipped spec exercises the default KV layout"
    for name in defaults:
        fam = family(name)
        assert fam.module.KV_LAYOUT == fam.shipped.attention.default_kv_layout


# -- the adapted model ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", EXTRACTABLE)
def test_build_model_applies_bridges_gate_and_dtype(family: Callable[[str], Family], name: str) -> None:
    fam = family(name)
    module = fam.module
    model = module.build_model(device="meta", overrides=fam.tiny)
    text = module.text_config(model.config)
    for bridge in fam.spec.config_bridges:
        if (
            bridge.op == "set"
            and "extraction" in bridge.backends
            and bridge.path.startswith(f"{fam.spec.abi.config}." if fam.spec.abi.config else "")
        ):
            leaf = bridge.path.rpartition(".")[2]
            assert getattr(text, leaf) == bridge.value, bridge.id
    assert text.num_hidden_layers == fam.structure.num_layers
    assert model.get_submodule(module.LM_HEAD_PATH).weight.dtype == getattr(torch, module.DTYPE)
    for path, buffer in model.named_buffers():
        if path.endswith("e_score_correction_bias"):  # transformers keeps the router bias in fp32
            assert buffer.dtype == torch.float32, path
    with pytest.raises(ValueError, match="does not match this adapter"):
        module.build_model(overrides={"model_type": f"not_{module.MODEL_TYPE}"})


@pytest.mark.parametrize("name", EXTRACTABLE)
def test_patches_are_gated_and_restored(family: Callable[[str], Family], name: str) -> None:
    fam = family(name)
    module = fam.module
    patches = [p for p in fam.spec.patches if "extraction" in p.backends]
    assert [p[0] for p in module.PATCHES] == [p.id for p in patches]
    model = module.build_model(device="meta", overrides=fam.tiny)
    for _id, _kind, owner_module, owner_path, attr, _impl, _options, _pin in module.PATCHES:
        owner: Any = __import__(owner_module, fromlist=["_"])
        for part in owner_path.split(".") if owner_path else ():
            owner = getattr(owner, part)
        original = vars(owner)[attr]
        with module.patches_applied():
            assert vars(owner)[attr] is not original
        assert vars(owner)[attr] is original
    # every module of a built model is claimed (a layer's mixer, whatever the stack calls it)
    first_layer = model.get_submodule(module.LANGUAGE_MODEL_PATH).layers[0]
    mixer = next(first_layer.children())
    assert module._owns_call((mixer,)) and not module._owns_call((object(),))
    assert not module._owns_call((type(mixer).__new__(type(mixer)),))


# -- outputs: kadapt's runtime and transformers ---------------------------------------------------


@contextlib.contextmanager
def upstream_experts(config: Any) -> Iterator[None]:
    """transformers' own eager experts loop for the reference (the export uses batched_mm)."""
    saved = getattr(config, "_experts_implementation", None)
    config._experts_implementation = "eager"
    try:
        yield
    finally:
        config._experts_implementation = saved


def randomize_router_bias(model: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(1)
    for path, buffer in model.named_buffers():
        if path.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)


def kadapt_wrapper(cls: type, fam: Family, model: torch.nn.Module) -> torch.nn.Module:
    language_model = submodule(model, fam.spec, "language_model")
    return cls.from_language_model(
        language_model,
        submodule(model, fam.spec, "lm_head"),
        kv_layout=fam.options.kv_layout,
        cache_keyword=upstream.decoder_protocol(language_model, fam.options.layer_kinds).cache_keyword,
        mla_attention=fam.options.mla_attention,
        windows=fam.options.windows,
        chunks=fam.structure.chunks,
        embedding_ops=fam.structure.outside_ops("embeddings"),
        logit_ops=fam.structure.outside_ops("logits"),
        rope_layer_types=upstream.rope_layer_types(language_model),
        layer_kinds=fam.options.layer_kinds,
        parts=fam.spec.stack_parts().stated,
    )


def kv_of(states: Sequence[torch.Tensor], roles: Sequence[str]) -> list[tuple[int, ...]]:
    """The shapes of the first attention layer's key and value among a flat list of states."""
    first = roles.index("key")
    return [tuple(t.shape) for t in states[first : first + 2]]


@pytest.mark.parametrize("name", EXTRACTABLE)
def test_wrappers_equal_kadapts_runtime_and_transformers(family: Callable[[str], Family], name: str) -> None:
    fam = family(name)
    module, spec = fam.module, fam.spec
    torch.manual_seed(0)
    with applied(spec, backend="extraction"):
        config = load_config(spec, backend="extraction", overrides=fam.tiny)
        reference = load_model(spec, device="cpu", config=config, dtype=torch.float32).eval()
    randomize_router_bias(reference)
    ours = module.build_model(device="cpu", overrides=fam.tiny, dtype=None)
    ours.load_state_dict(reference.state_dict())
    text = kadapt_text_config(spec, reference.config)
    layers = text.num_hidden_layers
    dtype = torch.float32

    ids = torch.randint(4, text.vocab_size, (1, PREFILL), generator=torch.Generator().manual_seed(2))
    _, mask, positions = module.prefill_inputs(batch=1, prefill_len=PREFILL, dtype=dtype, device="cpu")
    with torch.no_grad():
        with applied(spec, backend="extraction"):
            expected = kadapt_wrapper(runtime.PrefillWrapper, fam, reference)(ids, mask, positions)
        with module.patches_applied():
            got = module.prefill_wrapper(ours)(ids, mask, positions)
        with upstream_experts(text):
            eager_out = reference(input_ids=ids, use_cache=True)
            eager, eager_cache = eager_out.logits, eager_out.past_key_values
    kinds = fam.options.layer_kinds  # every layer's states, in ABI order (hybrids: conv + recurrent)
    roles = runtime.flat_state_roles(kinds, 2 * layers)
    assert len(got) == 1 + len(roles)
    assert kv_of(got[1:], roles) == list(runtime.kv_shapes(fam.options.kv_dims, 1, PREFILL))
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(got[0], eager, rtol=0, atol=TOLERANCE)

    # greedy decode steps over the placed prefill cache, each token checked against a full forward; a
    # compressed stack decodes until the last token closes a window of every rate, so the decode graph
    # writes an entry of each compressor (and of a csa layer's indexer) and attends over it
    cache = module.place_prefill_kv(got[1:], CACHE, kinds)
    tokens = ids
    token = got[0][:, -1].argmax(-1, keepdim=True)
    rates = (fam.options.compress_rates or {}).values()
    steps = max([STEPS, *((PREFILL // rate + 1) * rate - PREFILL for rate in rates)])
    for step in range(steps):
        position = PREFILL + step
        example = module.decode_example_inputs(text, "cpu", position=position, max_cache_len=CACHE)
        step_mask = module.additive_causal_mask(example[2], CACHE, dtype)
        inputs = (token, step_mask, example[2], example[3], *cache)
        assert [tuple(t.shape) for t in example[4:]] == [tuple(t.shape) for t in cache]
        assert kv_of(example[4:], roles) == list(runtime.kv_shapes(fam.options.kv_dims, 1, CACHE))
        tokens = torch.cat([tokens, token], dim=1)
        with torch.no_grad():
            with applied(spec, backend="extraction"):
                expected = kadapt_wrapper(runtime.DecodeWrapper, fam, reference)(*inputs)
            with module.patches_applied():
                got = module.decode_wrapper(ours)(*inputs)
            with upstream_experts(text):
                if name in CACHED_PATH_ONLY:  # transformers' own cached step, generate()'s path
                    step_out = reference(
                        input_ids=token, past_key_values=eager_cache, position_ids=example[2], use_cache=True
                    )
                    eager, eager_cache = step_out.logits, step_out.past_key_values
                else:
                    eager = reference(input_ids=tokens).logits[:, -1:]
        for a, b in zip(expected, got, strict=True):
            assert torch.equal(a, b), f"decode step {step}"
        torch.testing.assert_close(got[0], eager, rtol=0, atol=TOLERANCE)
        cache = list(got[1:])
        token = got[0][:, -1].argmax(-1, keepdim=True)
    for (layer, role), entries in zip(state_roles(kinds), cache, strict=True):
        if role in ("comp", "index_comp"):  # the entry of the window decode closed last: written
            rate = fam.options.compress_rates[kinds[layer]]
            assert entries[:, :, (PREFILL + steps) // rate - 1].abs().sum() > 0, (layer, role)


def test_nemotron_h_decode_departs_only_by_the_dt_clamp(family: Callable[[str], Family]) -> None:
    """Why ``CACHED_PATH_ONLY`` holds nemotron_h: transformers' cached decode step departs from its own
    full forward, and lifting the chunk scan's dt clamp (time_step_min) removes the departure. When
    transformers makes its two paths agree, the first assertion fails: drop the entry."""
    fam = family("nemotron_h")
    torch.manual_seed(0)
    with applied(fam.spec, backend="extraction"):
        config = load_config(fam.spec, backend="extraction", overrides=fam.tiny)
        model = load_model(fam.spec, device="cpu", config=config, dtype=torch.float32).eval()
    ids = torch.randint(4, config.vocab_size, (1, PREFILL + 1), generator=torch.Generator().manual_seed(2))

    def departure() -> float:
        with torch.no_grad(), upstream_experts(config):
            cache = model(input_ids=ids[:, :PREFILL], use_cache=True).past_key_values
            step = model(
                input_ids=ids[:, PREFILL:], past_key_values=cache, position_ids=torch.tensor([[PREFILL]])
            ).logits[:, -1]
            full = model(input_ids=ids).logits[:, -1]
        return float((step - full).abs().max())

    mixers = [m for m in model.modules() if hasattr(m, "time_step_limit")]
    assert mixers and all(m.time_step_limit[0] > 0 for m in mixers)
    assert departure() > 2 * TOLERANCE  # measured 3.6e-4 on the tiny model (2 groups of a 16-wide state)
    for m in mixers:
        m.time_step_limit = (0.0, m.time_step_limit[1])
    assert departure() <= TOLERANCE


def test_sliding_windows_change_the_result(family: Callable[[str], Family]) -> None:
    """The windows the generated wrappers pass are what makes a sliding family right (one whose layers
    are all attention, so a wrapper without the windows needs nothing else)."""
    sliding = [
        n
        for n in EXTRACTABLE
        if family(n).shipped.has_sliding_layers and set(family(n).shipped.layer_kinds) == {"attention"}
    ]
    assert sliding, "no shipped spec has sliding-window layers"
    fam = family(sliding[0])
    module = fam.module
    torch.manual_seed(0)
    model = module.build_model(device="cpu", overrides=fam.tiny, dtype=None)
    ids = torch.randint(4, 128, (1, PREFILL), generator=torch.Generator().manual_seed(2))
    _, mask, positions = module.prefill_inputs(
        batch=1, prefill_len=PREFILL, dtype=torch.float32, device="cpu"
    )
    language_model = model.get_submodule(module.LANGUAGE_MODEL_PATH)
    head = model.get_submodule(module.LM_HEAD_PATH)
    with torch.no_grad(), module.patches_applied():
        windowed = module.prefill_wrapper(model)(ids, mask, positions)[0]
        full = module.PrefillWrapper.from_language_model(
            language_model,
            head,
            kv_layout=module.KV_LAYOUT,
            cache_keyword=module.decoder_protocol(language_model).cache_keyword,
            embedding_ops=module.outside_ops(language_model.config, "embeddings"),
            logit_ops=module.outside_ops(language_model.config, "logits"),
            rope_layer_types=module.rope_layer_types(language_model),
        )(ids, mask, positions)[0]
        eager = model(input_ids=ids).logits
    torch.testing.assert_close(windowed, eager, rtol=0, atol=TOLERANCE)
    assert not torch.allclose(full, eager, atol=1e-3)


# -- torch_ir, as the docstring says --------------------------------------------------------------


@QUIET_META_CONSTANTS
@pytest.mark.parametrize("name", TORCH_IR)
def test_torch_ir_extracts_and_replays_the_generated_wrappers(
    family: Callable[[str], Family], name: str, tmp_path: Path
) -> None:
    fam = family(name)
    module = fam.module
    assert "torch_ir.extract_ir(prefill_wrapper(model), prefill_example_inputs())" in module.__doc__
    model = module.build_model(device="meta", overrides=fam.tiny)
    config = module.text_config(model.config)
    layers = config.num_hidden_layers
    with torch.no_grad(), module.patches_applied():
        prefill = torch_ir.extract_ir(
            module.prefill_wrapper(model), module.prefill_example_inputs(prefill_len=PREFILL)
        )
        decode = torch_ir.extract_ir(
            module.decode_wrapper(model),
            module.decode_example_inputs(config, position=PREFILL, max_cache_len=CACHE),
        )

    # the interface is the ABI kadapt documents and exports: names by position, shapes, dtypes
    dtype = module.DTYPE
    kv_prefill = runtime.kv_shapes(fam.options.kv_dims, 1, PREFILL)
    kv_decode = runtime.kv_shapes(fam.options.kv_dims, 1, CACHE)
    expected = {
        "prefill": (
            [(1, PREFILL), (1, 1, PREFILL, PREFILL), (1, PREFILL)],
            [(1, PREFILL, fam.structure.vocab_size), *kv_prefill * layers],
        ),
        "decode": (
            [(1, 1), (1, 1, 1, CACHE), (1, 1), (1,), *kv_decode * layers],
            [(1, 1, fam.structure.vocab_size), *kv_decode * layers],
        ),
    }
    for graph, ir in (("prefill", prefill), ("decode", decode)):
        names_in, names_out = module.graph_names(graph, layers)
        assert len(ir.graph_inputs) == len(names_in) and len(ir.graph_outputs) == len(names_out)
        assert [tuple(t.shape) for t in ir.graph_inputs] == expected[graph][0], graph
        assert [tuple(t.shape) for t in ir.graph_outputs] == expected[graph][1], graph
        float_dtypes = {t.dtype for t in ir.graph_inputs[1:2]} | {t.dtype for t in ir.graph_outputs}
        assert float_dtypes == {dtype}, graph

    # torch_ir's executor replays both graphs on the CPU model's weights, equal to the wrappers
    torch.manual_seed(0)
    cpu = module.build_model(device="cpu", overrides=fam.tiny)
    ids = torch.randint(4, 128, (1, PREFILL), generator=torch.Generator().manual_seed(2))
    _, mask, positions = module.prefill_example_inputs("cpu", prefill_len=PREFILL)
    with torch.no_grad(), module.patches_applied():
        wrapper = module.prefill_wrapper(cpu)
        eager = wrapper(ids, mask, positions)
        replayed = torch_ir.IRExecutor(prefill, module.graph_weights(wrapper)).execute((ids, mask, positions))
        for a, b in zip(eager, replayed, strict=True):
            assert torch.equal(a, b)
        step = module.decode_example_inputs(config, "cpu", position=PREFILL, max_cache_len=CACHE)
        inputs = (
            eager[0][:, -1].argmax(-1, keepdim=True),
            *step[1:4],
            *module.place_prefill_kv(eager[1:], CACHE),
        )
        wrapper = module.decode_wrapper(cpu)
        eager = wrapper(*inputs)
        replayed = torch_ir.IRExecutor(decode, module.graph_weights(wrapper)).execute(inputs)
        for a, b in zip(eager, replayed, strict=True):
            assert torch.equal(a, b)

        # saved by the module, loaded by torch_ir: ABI names, and the same outputs
        path = module.save_ir(decode, tmp_path / "decode_ir.json", "decode")
        assert [t.name for t in decode.graph_outputs][0] != "logits"  # the extracted IR is left as it was
        loaded = torch_ir.load_ir(path)
        assert ([t.name for t in loaded.graph_inputs], [t.name for t in loaded.graph_outputs]) == (
            module.graph_names("decode", layers)
        )
        assert len(loaded.nodes) == len(decode.nodes)
        reloaded = torch_ir.IRExecutor(loaded, module.graph_weights(wrapper)).execute(inputs)
        for a, b in zip(eager, reloaded, strict=True):
            assert torch.equal(a, b)


@QUIET_META_CONSTANTS
def test_run_graph_refuses_a_position_past_the_cache_unless_checks_are_off(
    family: Callable[[str], Family], tmp_path: Path
) -> None:
    """The module's entry point binds every call through the embedded binder: a decode row at position
    max_cache_len is refused by default; with ``check=False`` the saved graph runs, and its contiguous
    write drops the token without an error (every present equals its past), which is what the check is for."""
    fam = family(TORCH_IR[0])
    module = fam.module
    assert 'run_graph(decode, weights, inputs, "decode")' in module.__doc__
    model = module.build_model(device="meta", overrides=fam.tiny)
    config = module.text_config(model.config)
    with torch.no_grad(), module.patches_applied():
        extracted = torch_ir.extract_ir(
            module.decode_wrapper(model), module.decode_example_inputs(config, max_cache_len=CACHE)
        )
    decode = torch_ir.load_ir(module.save_ir(extracted, tmp_path / "decode_ir.json", "decode"))
    torch.manual_seed(0)
    cpu = module.build_model(device="cpu", overrides=fam.tiny)
    dtype = getattr(torch, module.DTYPE)
    generator = torch.Generator().manual_seed(4)
    past = [torch.randn(tuple(meta.shape), generator=generator).to(dtype) for meta in decode.graph_inputs[4:]]

    def call(position: int) -> tuple[torch.Tensor, ...]:
        positions = torch.tensor([[position]])
        mask = module.additive_causal_mask(positions, CACHE, dtype)
        return (torch.tensor([[7]]), mask, positions, positions.view(-1), *past)

    refused = rf"^decode input position_ids: row 0 holds {CACHE}, outside 0\.\.{CACHE - 1}: "
    refused += rf"a position must be a slot of the cache \(max_cache_len {CACHE}\)"
    with torch.no_grad(), module.patches_applied():
        weights = module.graph_weights(module.decode_wrapper(cpu))
        written = module.run_graph(decode, weights, call(CACHE - 1), "decode")
        with pytest.raises(module.KadaptError, match=refused):
            module.run_graph(decode, weights, call(CACHE), "decode")
        dropped = module.run_graph(decode, weights, call(CACHE), "decode", check=False)
    assert not torch.equal(written[1][:, :, CACHE - 1], past[0][:, :, CACHE - 1])  # the last slot is written
    for present, before in zip(dropped[1:], past, strict=True):
        assert torch.equal(present, before)  # past the cache: no slot, the token silently gone


@QUIET_META_CONSTANTS
def test_grad_mode_at_extraction_matters_only_under_a_no_grad_rotary(family: Callable[[str], Family]) -> None:
    """Why the docstring extracts under ``torch.no_grad()`` (pytorch-ir 0.2.3): where the rotary
    embedding's forward carries its own ``@torch.no_grad`` (transformers 5.23), grad mode on traces it
    as a ``wrap_with_set_grad_enabled`` higher-order op that torch_ir's executor cannot run; where it
    does not (5.24), the graph extracted with grad on runs like the one extracted without."""
    fam = family(TORCH_IR[0])
    module = fam.module
    model = module.build_model(device="meta", overrides=fam.tiny)
    rotary = model.get_submodule(module.LANGUAGE_MODEL_PATH).rotary_emb
    own_no_grad = "@torch.no_grad" in inspect.getsource(type(rotary).forward)
    assert torch.is_grad_enabled()
    with module.patches_applied():
        prefill = torch_ir.extract_ir(
            module.prefill_wrapper(model), module.prefill_example_inputs(prefill_len=PREFILL)
        )
    assert ("wrap_with_set_grad_enabled" in {node.name for node in prefill.nodes}) == own_no_grad
    cpu = module.build_model(device="cpu", overrides=fam.tiny)
    inputs = module.prefill_example_inputs("cpu", prefill_len=PREFILL)
    executor = torch_ir.IRExecutor(prefill, module.graph_weights(module.prefill_wrapper(cpu)))
    if own_no_grad:
        with pytest.raises(
            torch_ir.ExecutionError,
            match="No execution function registered for op_type 'wrap_with_set_grad_enabled'",
        ):
            executor.execute(inputs)
        return
    with torch.no_grad(), module.patches_applied():
        expected = module.prefill_wrapper(cpu)(*inputs)
    torch.testing.assert_close(executor.execute(inputs)[0], expected[0], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def mistral_prefill(family: Callable[[str], Family]) -> tuple[types.ModuleType, Any]:
    """The generated module of a GQA family and a tiny prefill IR torch_ir extracted from it."""
    fam = family(TORCH_IR[0])
    module = fam.module
    model = module.build_model(device="meta", overrides=fam.tiny)
    with warnings.catch_warnings(), torch.no_grad(), module.patches_applied():
        warnings.filterwarnings("ignore", "Skipping .* meta-device constant", UserWarning)
        ir = torch_ir.extract_ir(
            module.prefill_wrapper(model), module.prefill_example_inputs(prefill_len=PREFILL)
        )
    return module, ir


def test_torch_ir_save_ir_cannot_write_these_graphs(
    mistral_prefill: tuple[types.ModuleType, Any], tmp_path: Path
) -> None:
    """Why the module has its own ``save_ir`` (pytorch-ir 0.2.3): the graphs carry ``torch.dtype``
    attributes, which torch_ir's writer cannot serialise, and it has opened the file by then."""
    _, ir = mistral_prefill
    assert any(isinstance(v, torch.dtype) for node in ir.nodes for v in node.attrs.values())
    path = tmp_path / "prefill_ir.json"
    with pytest.raises(TypeError, match="dtype is not JSON serializable"):
        torch_ir.save_ir(ir, path)
    assert path.stat().st_size == 0


def test_save_ir_encodes_attributes_like_kadapts_ir_writer(
    mistral_prefill: tuple[types.ModuleType, Any], tmp_path: Path
) -> None:
    """One encoding for both writers: ATen's integer codes, meta -> cpu, infinities as +-1e400."""
    module, ir = mistral_prefill
    body = split_module(Path(encoding.__file__)).body
    assert body in Path(module.__file__).read_text(encoding="utf-8")  # embedded verbatim, not a copy
    assert module.dtype_codes() == encoding.dtype_codes()
    assert module.enum_tables() == encoding.enum_tables()
    values = [*encoding.dtype_codes(), *encoding.LAYOUT_CODES, *encoding.MEMORY_FORMAT_CODES]
    values += [torch.device("meta"), torch.device("cpu"), [torch.float32, torch.strided], 1.5, None, "x"]
    for value in values:
        assert module._encoded(value, "test") == encoding.encode(value, device="cpu"), value
    with pytest.raises(TypeError, match="node x attribute y: cannot encode operator attribute"):
        module._encoded(object(), "node x attribute y")

    # masking fills (-inf) are JSON numbers that parse back as infinities; no string is rewritten
    text = module._json_text({"fill": [-math.inf, math.inf, 0.5], "name": "Infinity"})
    assert text == '{"fill":[-1e400,1e400,0.5],"name":"Infinity"}'
    assert json.loads(text)["fill"] == [-math.inf, math.inf, 0.5]

    document = json.loads(module.save_ir(ir, tmp_path / "prefill_ir.json", "prefill").read_text())
    attrs = [node.get("attrs", {}) for node in document["nodes"]]
    assert {a["dtype"] for a in attrs if "dtype" in a} <= set(encoding.dtype_codes().values())
    assert {a["device"] for a in attrs if "device" in a} == {"cpu"}
    assert document["metadata"]["enums"] == encoding.enum_tables()


def test_save_ir_refuses_the_wrong_graph_and_writes_atomically(
    mistral_prefill: tuple[types.ModuleType, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, ir = mistral_prefill
    path = tmp_path / "ir.json"
    with pytest.raises(ValueError, match="is it the decode graph"):
        module.save_ir(ir, path, "decode")
    with pytest.raises(ValueError, match="graph must be one of 'prefill', 'decode', 'step', got 'prefil'"):
        module.save_ir(ir, path, "prefil")
    assert list(tmp_path.iterdir()) == []

    path.write_text("previous", encoding="utf-8")

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        module.save_ir(ir, path, "prefill")
    assert path.read_text(encoding="utf-8") == "previous"
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind


@QUIET_META_CONSTANTS
def test_a_paged_spec_generates_the_paged_decode_abi(tmp_path: Path) -> None:
    """``abi.kv_cache: paged`` reaches the generated module: the block table follows cache_position in
    DECODE_INPUTS, the decode wrapper and example inputs are the pooled ones, the module's KV mapping is
    kadapt's, and torch_ir extracts a decode graph that replays the wrapper on a ragged batch whose
    blocks are out of order."""
    import shutil

    from kimi_adapter_core.backends.extraction.options import PagedOptions
    from kimi_adapter_core.generate.extraction import render_extraction

    shutil.copytree(REPO / "specs" / "llama", tmp_path / "llama")
    text = (REPO / "specs" / "llama.yaml").read_text(encoding="utf-8")
    assert "\n  max_cache_len: 2048\n" in text
    paged_spec = tmp_path / "llama.yaml"
    paged_spec.write_text(
        text.replace(
            "\n  max_cache_len: 2048\n", "\n  max_cache_len: 2048\n  kv_cache: {kind: paged, block_size: 4}\n"
        ),
        encoding="utf-8",
    )
    spec = load_spec(paged_spec)
    (rendered,) = [r for r in render_extraction(spec) if r.path.name == "extraction.py"]
    path = tmp_path / "paged_extraction.py"
    path.write_text(rendered.text, encoding="utf-8")
    module = import_path(path, "generated_paged_llama_extraction")
    assert module.DECODE_INPUTS[:5] == [
        "input_ids",
        "attention_mask",
        "position_ids",
        "cache_position",
        "block_table",
    ]
    assert (module.PAGED.block_size, module.PAGED.num_blocks) == (4, 2048 // 4)

    options = options_from_spec(spec, output_dir=tmp_path / "out", prefill_len=PREFILL, max_cache_len=CACHE)
    tiny = tiny_overrides(spec, options)
    text_config = module.text_config(module.load_config(overrides=tiny))
    structure = derive_structure(
        kadapt_text_config(spec, load_config(spec, backend="extraction", overrides=tiny)), spec
    )
    bound = dataclasses.replace(
        bind_structure(options, structure),
        dtype=module.DTYPE,
        paged=PagedOptions(4, module.PAGED.num_blocks, "block_table"),
    )
    mapping = module.kv_mapping(text_config, prefill_len=PREFILL, max_cache_len=CACHE)
    kadapt = kv_mapping_document(bound, types.SimpleNamespace(layers=[None] * structure.num_layers))  # type: ignore[arg-type]
    for key in ("format_version", "model_name", "prefill_graph", "decode_graph"):
        kadapt.pop(key)
    assert mapping == kadapt and mapping["contract"]["paged"]["block_size"] == 4

    model = module.build_model(device="meta", overrides=tiny)
    config = module.text_config(model.config)
    layers = config.num_hidden_layers
    with torch.no_grad(), module.patches_applied():
        decode = torch_ir.extract_ir(
            module.decode_wrapper(model), module.decode_example_inputs(config, batch=2, max_cache_len=CACHE)
        )
    names_in, _ = module.graph_names("decode", layers)
    assert len(decode.graph_inputs) == len(names_in) and names_in[4] == "block_table"
    assert (
        tuple(decode.graph_inputs[5].shape)
        == runtime.paged_shapes(bound.kv_dims, 4, module.PAGED.num_blocks)[0]
    )

    torch.manual_seed(0)
    cpu = module.build_model(device="cpu", overrides=tiny)
    generator = torch.Generator().manual_seed(3)
    dtype = getattr(torch, module.DTYPE)  # the module builds the model in the ABI dtype
    pools = [
        torch.randn(tuple(meta.shape), generator=generator).to(dtype) for meta in decode.graph_inputs[5:]
    ]
    table = torch.randperm(module.PAGED.num_blocks, generator=generator)[: 2 * CACHE // 4].view(2, CACHE // 4)
    positions = torch.tensor([[5], [9]])
    mask = runtime.additive_causal_mask(positions, CACHE, dtype)
    inputs = (torch.tensor([[7], [11]]), mask, positions, positions.view(-1), table, *pools)
    with torch.no_grad(), module.patches_applied():
        wrapper = module.decode_wrapper(cpu)
        eager = wrapper(*inputs)
        replayed = torch_ir.IRExecutor(decode, module.graph_weights(wrapper)).execute(inputs)
    for a, b in zip(eager, replayed, strict=True):
        assert torch.equal(a, b)
    slot = table[1, 9 // 4] * 4 + 9 % 4  # row 1 at position 9: its token is in its own block
    assert not torch.equal(eager[1].flatten(0, 1)[slot], pools[0].flatten(0, 1)[slot])
    # the entry point's binder refuses a row past the cache on the paged graph too, before the gather fails
    late = torch.tensor([[5], [CACHE]])
    past_the_cache = (*inputs[:2], late, late.view(-1), *inputs[4:])
    with pytest.raises(module.KadaptError, match=rf"row 1 holds {CACHE}, outside 0\.\.{CACHE - 1}: "):
        module.run_graph(decode, module.graph_weights(wrapper), past_the_cache, "decode")
    with pytest.raises(ExecutionError, match="gather.*out of bounds"):  # unchecked: fails in the block table
        module.run_graph(decode, module.graph_weights(wrapper), past_the_cache, "decode", check=False)


def test_config_strings_reach_the_module_docstring_escaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config string the structure line quotes (the rope type) cannot close the module docstring.
    ``validate`` holds a native spec's rope type to transformers' list (``bounds.ROPE_TYPES``), so the
    list is widened here to let the string reach the renderer, as a remote-code spec's would."""
    from kimi_adapter_core.generate.extraction import render_extraction
    from kimi_adapter_core.structure import bounds

    hostile = 'llama3"""\nimport os  # \\'
    monkeypatch.setattr(bounds, "ROPE_TYPES", (*bounds.ROPE_TYPES, hostile))
    monkeypatch.setattr(bounds, "FACTOR_ROPE_TYPES", (*bounds.FACTOR_ROPE_TYPES, hostile))
    config = json.loads((REPO / "specs" / "llama" / "config.json").read_text())
    config["rope_scaling"]["rope_type"] = hostile
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "config.json").write_text(json.dumps(config))
    spec_text = (
        (REPO / "specs" / "llama.yaml")
        .read_text()
        .replace("config: llama/config.json", "config: h/config.json")
    )
    (tmp_path / "llama.yaml").write_text(spec_text)
    [module] = [
        r for r in render_extraction(load_spec(tmp_path / "llama.yaml")) if r.path.name == "extraction.py"
    ]
    docstring = ast.get_docstring(ast.parse(module.text))  # it parses: the quotes did not close it
    words = " ".join(docstring.split())
    rope_type = " ".join(config["rope_scaling"]["rope_type"].split())
    assert f"rope {rope_type} x8 from 8192 positions." in words
