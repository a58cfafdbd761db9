"""Issue 38: ``kadapt simulate`` at TP 1, 2 and 8 either prices the step or refuses at the option.

Every shipped spec, and a sample of the family matrix's adapted types (the guide's spec,
``families.trial.write_spec``, on transformers' default config for the type: full-size heads and
widths, built on meta only), is simulated at each TP degree (EP = TP for an MoE). Each run either
prices a decode step (a positive step time) or refuses with a located error: a non-zero exit, no
traceback, and a message that names the option and the config key it cannot split. The sample holds
the families whose per-rank build departed from the usual layer (a full-width q/k norm, an o_proj
sized ``hidden_size`` wide, a head width taken from ``hidden_size / heads``, an attention that reads the
positions, a depth given by a per-layer list) and each refusal, so an outcome that changes fails here.
One decode step on meta takes ~0.1 s, so all of it runs by default.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from transformers import CONFIG_MAPPING, AutoConfig

from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.model.rank_model import RankModel
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.families.trial import module_paths, write_spec
from kimi_adapter_core.loading import model_class
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
# discovered, so a new shipped spec is simulated here without editing this file (the remote one runs
# the model's own code, refused without --trust-remote-code; kimi_k25 is the same model)
SHIPPED = tuple(sorted(p.stem for p in (REPO / "specs").glob("*.yaml") if p.stem != "kimi_k25_remote"))
DEGREES = (1, 2, 8)

# (type, TP) -> what the refusal names: the option, then the config key or the reason. Every other
# (type, TP) of FAMILIES prices.
REFUSED = {
    ("helium", 8): ("--tp 8", "20 attention heads (config num_attention_heads)"),
    ("stablelm", 2): ("--tp 2", "config hidden_size / num_attention_heads (2560 / 16 heads"),
    ("stablelm", 8): ("--tp 8", "config hidden_size / num_attention_heads (2560 / 4 heads"),
    ("bitnet", 2): ("--tp 2", "5 KV heads (config num_key_value_heads)"),
    ("bitnet", 8): ("--tp 8", "20 attention heads (config num_attention_heads)"),
    ("flex_olmo", 2): ("--ep 2", "7 routed experts (config num_experts)"),
    ("flex_olmo", 8): ("--ep 8", "7 routed experts (config num_experts)"),
    ("bamba", 2): ("--tp 2", "1 linear-attention key heads (config mamba_n_groups)"),
    ("bamba", 8): ("--tp 8", "1 linear-attention key heads (config mamba_n_groups)"),
    ("zamba2", 2): ("--tp 2", "1 linear-attention key heads (config mamba_ngroups)"),
    ("zamba2", 8): ("--tp 8", "1 linear-attention key heads (config mamba_ngroups)"),
    ("zamba", 8): ("--tp 8", "2 linear-attention value heads (config n_mamba_heads)"),
}
FAMILIES = {  # type -> whether it routes experts (EP = TP)
    "olmoe": True,  # q/k norms over every head: a rank's slice, statistics all-reduced
    "olmo2": False,  # the same norms on a dense stack
    "qwen3": False,  # per-head q/k norms: no split
    "gemma3_text": False,  # sliding and global layers, two rotary kinds
    "granitemoe": True,
    "mixtral": True,
    "phimoe": True,
    "gpt_oss": True,  # attention sinks and q/k/v/o biases, per rank
    "helium": False,  # o_proj hidden_size wide: the rank's row-parallel slice
    "stablelm": False,  # head width from hidden_size / heads: refused past TP 1
    "ministral3": False,  # its attention scales queries by position: the layer gets position_ids
    "nemotron_h": True,  # depth from layers_block_type, no num_hidden_layers key
    "mamba": False,  # no layer attends: its channels split, not its nominal one head
    "mamba2": False,  # its num_heads are the SSM heads: the mixer stays whole, no attention is resized
    "bamba": False,  # one Mamba2 B/C group: refused past TP 1
    "bitnet": False,
    "zamba2": False,  # hybrid layers: a shared block, then Mamba2; one B/C group: refused past TP 1
    "zamba": False,  # a multi-head Mamba1 scan per SSM head: TP splits the heads
    "flex_olmo": True,
}


def simulate(spec: Path, tp: int, moe: bool) -> Result:
    args = ["simulate", str(spec), "--device", "h200", "--decode", "--batch", "8", "--context-len", "1024"]
    return CliRunner().invoke(
        cli, [*args, "--tp", str(tp), "--ep", str(tp if moe else 1), "--format", "json"]
    )


def assert_prices(result: Result) -> None:
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["step_time_s"] > 0


def assert_refuses(result: Result, option: str, reason: str) -> None:
    assert result.exit_code in (1, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert option in result.output and reason in result.output, result.output


@pytest.fixture(scope="module")
def family_specs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The guide's spec for each sampled type, on transformers' default config for it."""
    folder = tmp_path_factory.mktemp("families")
    specs = {}
    for model_type in FAMILIES:
        config = {**CONFIG_MAPPING[model_type]().to_dict(), "model_type": model_type}
        built = AutoConfig.for_model(**config)
        with torch.device("meta"):
            model = model_class(built)._from_config(built)
        specs[model_type] = write_spec(folder, model_type, config, module_paths(model))
    return specs


@pytest.mark.parametrize("tp", DEGREES)
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_spec_prices_at_tp(name: str, tp: int) -> None:
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    assert_prices(simulate(spec.path, tp, model_inputs(spec, None).arch.structure.moe is not None))


@pytest.mark.parametrize("tp", DEGREES)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_prices_or_refuses_at_the_option(
    family_specs: dict[str, Path], model_type: str, tp: int
) -> None:
    result = simulate(family_specs[model_type], tp, FAMILIES[model_type])
    if (model_type, tp) in REFUSED:
        assert_refuses(result, *REFUSED[model_type, tp])
    else:
        assert_prices(result)


def test_an_o_proj_sized_for_every_head_runs_on_the_ranks_row_slice(family_specs: dict[str, Path]) -> None:
    """Helium's o_proj is hidden_size (2560) wide on the input side; a rank of TP 2 holds 10 heads x 128:
    it reads the [2560, 1280] row-parallel slice (the sum over ranks is the layer's TP all-reduce)."""
    spec = load_spec(family_specs["helium"])
    inputs, dep = model_inputs(spec, None), Deployment(Parallel(2), 8, 1, 1024, True)
    model = RankModel(spec, inputs, dep)
    ops = model.trace(inputs, dep).ops
    o_proj = model.parts.layer("dense").self_attn.o_proj
    assert tuple(o_proj.weight.shape) == (2560, 1280)
    read = [n for op in ops if op.module == "dense_layer.self_attn.o_proj" for _, _, n in op.weights]
    assert read == [2560 * 1280]  # a weight of the checkpoint's format, the rank's slice of it
    again = model.trace(inputs, dep).ops  # a reused model traces the slice alike
    assert [op.bytes for op in again] == [op.bytes for op in ops]


def test_attention_sinks_and_biases_split_with_the_heads() -> None:
    """gpt-oss at TP 8 (64 query heads of 64, 8 KV heads): a rank holds its 8 heads' sinks and q/k/v
    biases, as vLLM's column-parallel projections and per-rank sinks do; o_proj is row-parallel with its
    bias whole (added once to the reduced sum)."""
    spec = load_spec(REPO / "specs" / "gpt_oss.yaml")
    inputs, dep = model_inputs(spec, None), Deployment(Parallel(8, 1, 8), 8, 1, 1024, True)
    attention = RankModel(spec, inputs, dep).parts.layer("moe").self_attn
    shapes = {name: tuple(p.shape) for name, p in attention.named_parameters()}
    assert shapes["sinks"] == (8,)
    assert (shapes["q_proj.bias"], shapes["k_proj.bias"], shapes["v_proj.bias"]) == ((512,), (64,), (64,))
    assert (shapes["o_proj.weight"], shapes["o_proj.bias"]) == ((2880, 512), (2880,))


def test_a_family_error_inside_the_trace_names_the_module(family_specs: dict[str, Path]) -> None:
    """Not only a shape error in an op: whatever the family's own code raises mid-trace (Ministral-3
    divided the positions it was not given) is a KadaptError naming the TP size and the module."""
    spec = load_spec(family_specs["qwen3"])
    inputs, dep = model_inputs(spec, None), Deployment(Parallel(2), 8, 1, 1024, True)
    model = RankModel(spec, inputs, dep)
    norm = model.parts.layer("dense").self_attn.q_norm

    def broken(*_: object, **__: object) -> None:
        raise TypeError("unsupported operand type(s) for /: 'NoneType' and 'int'")

    norm.forward = broken
    with pytest.raises(KadaptError) as caught:
        model.trace(inputs, dep)
    message = str(caught.value)
    assert (
        "spec qwen3 at TP 2: dense_layer.self_attn.q_norm (TypeError) failed: unsupported operand" in message
    )
