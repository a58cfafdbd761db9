"""``kadapt simulate SPEC``: estimate one prefill or decode step with a roofline over traced ops.

Options mirror TensorCast's text_generate (device, queries, query/context length, tp/dp/ep, quant,
MTP, --decode), plus the routing imbalance and the cost model (``--cost-model measured`` reads
NVIDIA AIConfigurator's measured kernel tables when the ``measured`` extra is installed), and images:
``--images N --image-size HxW`` prices a vision-language prefill (vision encoder, projector, and the
text prefill with the images' placeholder tokens added to each prompt: ``simulation/vision.py``).
Exit 0 with a ``WARNING:`` line when the deployment does not fit in device memory - the timing is still
informative - and a ``KadaptError`` for sizes that cannot be laid out at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..atomic import atomic_write_text
from ..backends.simulation.estimate.eager import HOST_US
from ..backends.simulation.model.inputs import model_inputs
from ..backends.simulation.model.parallel import Parallel, framework_moe_tp
from ..backends.simulation.tables.device import get_device
from ..errors import KadaptError
from ..spec import load_spec
from ..spec.model import Spec
from .deployment_options import deployment_options, image_options, requested_images
from .output import format_option, reporter, verbosity_options
from .serving_options import run_concurrency, run_serving, serving_options
from .spec_argument import spec_argument
from .sweep_options import run_sweep, sweep_options


@click.command(name="simulate")
@spec_argument()
@deployment_options
@click.option(
    "--batch",
    type=click.IntRange(1, 1 << 24),
    default=1,
    show_default=True,
    help="Concurrent queries (global, split over dp).",
)
@click.option(
    "--query-len",
    type=click.IntRange(1, 1 << 24),
    default=None,
    help="New text tokens per query in a prefill step (--images adds their placeholder tokens) "
    "[default: 2048].",
)
@click.option(
    "--context-len",
    type=click.IntRange(0, 1 << 24),
    default=0,
    show_default=True,
    help="Tokens already cached per query.",
)
@click.option(
    "--mtp", type=int, default=0, show_default=True, help="MTP draft tokens verified per decode step."
)
@click.option(
    "--mtp-acceptance",
    type=float,
    default=0.7,
    show_default=True,
    help="Fraction of draft tokens accepted (sets tokens/s with --mtp).",
)
@click.option("--decode", is_flag=True, help="Simulate a decode step (1 + mtp tokens per query).")
@image_options
@click.option(
    "--routing",
    type=click.Choice(["power-law", "uniform"]),
    default="power-law",
    show_default=True,
    help="Token spread over routed experts: power-law (real routers, measured slowdown) or uniform.",
)
@click.option(
    "--cost-model",
    type=click.Choice(["roofline", "measured"]),
    default="roofline",
    show_default=True,
    help="roofline: kadapt's roofline with the device's kernel-efficiency table; measured: look GEMM, "
    "attention, MoE and collectives up in AIConfigurator's tables (extra 'measured'), roofline elsewhere.",
)
@click.option(
    "--framework",
    type=click.Choice(["trtllm", "sglang", "vllm"]),
    default="trtllm",
    show_default=True,
    help="Serving framework: picks the device's kernel-efficiency tables (its newest measured kernels) "
    "and, with --cost-model measured, AIConfigurator's tables.",
)
@click.option(
    "--framework-version",
    default=None,
    metavar="VERSION",
    help="With --isl/--osl: the --framework release whose step budget and prompt steps price the requests "
    "(e.g. 0.4.3.post2; frameworks.yaml `releases`). Default: the newest release read; a release no entry "
    "covers is priced so, with a note.",
)
@click.option(
    "--eager",
    is_flag=True,
    help="Price the step as an engine that runs it without CUDA graphs (e.g. TensorRT-LLM 0.17's PyTorch "
    f"backend by default): every launched kernel takes at least {HOST_US:g} us of host time to launch, "
    "the host time chosen on TensorRT-LLM 0.17's published points (another engine's may differ; "
    "docs/cost_model.md). A step or --concurrency.",
)
@click.option(
    "--top", type=int, default=25, show_default=True, help="Rows of the op table in text output (0: all)."
)
@format_option
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write a Chrome trace (chrome://tracing, Perfetto) of the step.",
)
@click.option(
    "--steps",
    "steps_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Price the steps a serving engine ran, one by one: a JSON engine trace (per step, each request "
    "row's query tokens, cached context and logits rows; schema engine_trace.schema.json, e.g. "
    "recorded by examples/reference_engine.py). One engine: --dp 1.",
)
@verbosity_options
@sweep_options
@serving_options
def command(
    spec_path: Path,
    device: str | None,
    device_file: Path | None,
    batch: int,
    query_len: int | None,
    context_len: int,
    tp: int,
    dp: int,
    ep: int,
    moe_tp: int | None,
    quant: str | None,
    mtp: int,
    mtp_acceptance: float,
    kv_dtype: str,
    decode: bool,
    images: int | None,
    image_size: tuple[int, int] | None,
    routing: str,
    cost_model: str,
    framework: str,
    framework_version: str | None,
    eager: bool,
    top: int,
    fmt: str,
    trace_path: Path | None,
    steps_path: Path | None,
    sweep: bool,
    devices: int | None,
    batches: tuple[int, ...] | None,
    plot: Path | None,
    isl: int | None,
    osl: int | None,
    ttft: float | None,
    tpot: float | None,
    concurrency: int | None,
    step_tokens: int | None,
    run_requests: int | None,
    random_range_ratio: float | None,
    seed: int | None,
    serving: str,
) -> None:
    """Price one step of SPEC's model on a device and report time, tokens/s and memory.

    JSON (--format json): {"phase", "model", "device", "quantization", "kv_dtype", "parallel", "batch",
    "query_len", "context_len", "mtp", "mtp_acceptance", "routing", "cost_model", "step_time_s",
    "output_tokens_per_step", "tokens_per_s", "tokens_per_s_per_device", "ops", "memory_per_device",
    "warnings"}; with --eager also "eager" (the host time per launched kernel); with --images also
    "image_prefill" (encoder, projector, merged prefill and total
    seconds; the step then runs the vision kernels before the text prefill); for a stack with state
    beyond its KV cache also "states" (per request and device, each kind with whether it grows: the
    attention layers' KV cache, the linear layers' constant state, the DSA indexer keys, DeepSeek-V4's
    compressed entries). A hybrid stack's linear-attention layers are priced as their conv and
    gated-delta scan (prefill) or state update (decode) kernels, attention kernels in its attention
    layers only. A DSA layer (DeepSeek-V3.2) is priced as its indexer (projections, the scoring of
    every visible key, the top-k) and attention over each query's top-k latents only (a short
    prefill: DeepSeek's masked MHA mode, the dense prefill, where it takes fewer FLOPs).

    \b
    Examples:
      kadapt simulate kimi_k25 --device h200 --tp 8 --ep 8
      kadapt simulate kimi_k25 --device h200 --tp 8 --ep 8 --images 4 --image-size 896x896 --query-len 512
      kadapt simulate kimi_k25 --device h200 --tp 8 --decode --context-len 4096 --format json
      kadapt simulate deepseek_v3 --device h200 --tp 8 --ep 8 --cost-model measured
      kadapt simulate qwen3_moe --device h200 --decode --sweep --devices 8 --plot front.html
      kadapt simulate deepseek_v3 --device h200 --sweep --devices 16 --isl 4000 --osl 1000 --tpot 30
      kadapt simulate gpt_oss --device h100 --tp 1 --framework vllm --isl 1000 --osl 1000 --concurrency 64
      kadapt simulate qwen3_moe --device h200 --tp 8 --isl 1000 --osl 1000 --concurrency 16 --requests 80
      kadapt simulate deepseek_v3 --device h200 --tp 8 --ep 4 --moe-tp 2 --decode --batch 4 --eager
      kadapt simulate llama --device h100 --steps examples/engine_trace.json
    """
    from ..backends.simulation.estimate.simulator import simulate
    from ..backends.simulation.model.deployment import Deployment
    from ..backends.simulation.report.simulation import (
        image_prefill_json,
        image_prefill_text,
        sim_json,
        sim_text,
    )
    from ..backends.simulation.report.trace import chrome_trace

    out = reporter(fmt)
    out.detail(f"spec: {spec_path.resolve()}")
    spec = load_spec(spec_path)
    for line in spec.deprecations:
        out.note(line)
    refuse_remote_code(spec)
    if not sweep and quant is not None and ("," in quant or quant.strip().upper() == "ALL"):
        raise click.UsageError(f"--quant {quant}: a list of modes or 'all' applies to --sweep")
    inputs = model_inputs(spec, None if sweep else quant)  # a sweep's modes: ``sweep_modes``
    requested = requested_images(spec, inputs.arch, images, image_size)
    if requested is not None and (decode or sweep):
        raise click.UsageError(
            f"--images prices a prefill step; {'--decode' if decode else '--sweep'} does not encode images "
            "(count their placeholder tokens in --context-len)"
        )
    profile = get_device(device, device_file)
    out.detail(f"device: {device_file.resolve() if device_file else device}")
    if decode and query_len not in (None, 1):
        raise click.UsageError("--query-len is fixed at 1 (+ --mtp) for --decode")
    if eager and (sweep or steps_path is not None or requested is not None):
        flag = "--sweep" if sweep else "--steps" if steps_path is not None else "--images"
        raise click.UsageError(f"--eager prices one step or --concurrency; drop {flag}")
    if sweep and moe_tp is not None and moe_tp > 1:
        raise click.UsageError(
            f"--moe-tp {moe_tp} prices one layout; --sweep searches whole-expert (EP) layouts: drop --moe-tp"
        )
    if moe_tp is None:
        moe_tp = 1 if sweep else framework_moe_tp(inputs.arch.structure, tp * dp, ep)
    dep = Deployment(
        Parallel(tp=tp, dp=dp, ep=ep, moe_tp=moe_tp),
        batch,
        1 if decode else (2048 if query_len is None else query_len),
        context_len,
        decode,
        mtp,
        mtp_acceptance,
        kv_dtype,
        routing.replace("-", "_"),
        HOST_US * 1e-6 if eager else 0.0,
    )
    requests = isl is not None or osl is not None
    if framework_version is not None and (not requests or steps_path is not None):
        raise click.UsageError(
            "--framework-version prices requests (--isl/--osl with --sweep or --concurrency): a step is "
            "priced with --framework's kernel tables, whichever release"
        )
    if steps_path is not None:
        given = [
            flag
            for flag, on in (
                ("--sweep", sweep),
                ("--concurrency", concurrency is not None),
                ("--isl/--osl", requests),
                ("--decode", decode),
                ("--batch", batch != 1),
                ("--query-len", query_len is not None),
                ("--context-len", context_len != 0),
                ("--mtp", mtp != 0),
                ("--images", requested is not None),
                ("--trace", trace_path is not None),
                (
                    "--devices/--batches/--plot",
                    devices is not None or batches is not None or plot is not None,
                ),
            )
            if on
        ]
        if given:
            raise click.UsageError(f"--steps prices the steps the trace lists: drop {', '.join(given)}")
        from ..backends.simulation.search import engine_steps

        steps = engine_steps.read_trace(steps_path)  # the whole file checked before anything is priced
        pricer = engine_steps.StepPricer(
            inputs, spec, profile, dep, cost_model=cost_model, framework=framework
        )
        with out.stage("engine steps"):
            priced = engine_steps.price_trace(pricer, steps)
        if out.json:
            out.document(
                engine_steps.trace_json(
                    priced,
                    trace=str(steps_path),
                    model=spec.name,
                    device=profile.name,
                    base=dep,
                    cost_model=cost_model,
                )
            )
        else:
            expert_tp = f" MoE-TP{moe_tp}" if moe_tp > 1 else ""
            header = (
                f"{spec.name} on {profile.name}, TP{tp} EP{ep}{expert_tp}, {framework} kernel tables, "
                f"{cost_model}, weights {inputs.quant_label}, KV cache {kv_dtype}: engine trace {steps_path}"
            )
            out.result(engine_steps.trace_text(priced, header=header, top=top or None))
        return
    if concurrency is not None:
        if isl is None or osl is None:
            raise click.UsageError("--concurrency prices requests: it needs both --isl and --osl")
        if sweep:
            raise click.UsageError("--concurrency prices the one layout --tp/--dp/--ep; drop --sweep")
        if decode or query_len is not None or context_len or batch != 1:
            raise click.UsageError(
                "--concurrency prices whole requests (prefill and decode): drop --decode, --batch, "
                "--query-len and --context-len"
            )
        if ttft is not None or tpot is not None or serving == "disagg":
            raise click.UsageError(
                "--concurrency prices one aggregated deployment: --ttft, --tpot and --serving disagg "
                "apply to --sweep"
            )
        if cost_model != "roofline":
            raise click.UsageError(
                f"--concurrency prices with the roofline cost model: drop --cost-model {cost_model}"
            )
        if devices is not None or batches is not None or plot is not None:
            raise click.UsageError(
                "--concurrency prices the one layout --tp/--dp/--ep: --devices, --batches and "
                "--plot apply to --sweep"
            )
        from ..backends.simulation.search.benchmark_run import RandomPrompts
        from ..backends.simulation.search.request_pricing import Workload

        if run_requests is None and (random_range_ratio is not None or seed is not None):
            raise click.UsageError(
                "--random-range-ratio and --seed draw the lengths of a run: add --requests"
            )
        if random_range_ratio is None and seed is not None:
            raise click.UsageError("--seed draws random lengths: add --random-range-ratio")
        prompts = None
        if run_requests is not None:
            ratio = 1.0 if random_range_ratio is None else random_range_ratio
            prompts = RandomPrompts(isl, osl, run_requests, ratio, 1 if seed is None else seed)
        with out.stage("concurrency"):
            report = run_concurrency(
                spec,
                profile,
                dep,
                Workload(isl, osl),
                concurrency,
                step_tokens=step_tokens,
                framework=framework,
                quant=quant,
                fmt="json" if out.json else "text",
                prompts=prompts,
                framework_version=framework_version,
            )
        out.result(report)
        return
    if step_tokens is not None:
        raise click.UsageError("--step-tokens sets the budget of a --concurrency price")
    if run_requests is not None or random_range_ratio is not None or seed is not None:
        raise click.UsageError("--requests, --random-range-ratio and --seed price a --concurrency run")
    if not requests and (ttft is not None or tpot is not None or serving != "both"):
        raise click.UsageError("--ttft, --tpot and --serving apply to a request sweep (--sweep --isl --osl)")
    if requests and not sweep:
        raise click.UsageError("--isl and --osl apply to --sweep (or --concurrency)")
    if sweep and requests:
        if isl is None or osl is None:
            raise click.UsageError("a request sweep needs both --isl and --osl")
        if decode or query_len is not None or context_len:
            raise click.UsageError(
                "--isl/--osl price whole requests (prefill and decode); "
                "drop --decode, --query-len and --context-len"
            )
        if cost_model != "roofline":
            raise click.UsageError("--sweep prices with the roofline cost model")
        from ..backends.simulation.search.request_pricing import Workload

        workload = Workload(isl, osl, ttft / 1e3 if ttft else None, tpot / 1e3 if tpot else None)
        with out.stage("request sweep"):
            report = run_serving(
                spec,
                profile,
                dep,
                workload,
                devices=devices or tp * dp,
                framework=framework,
                modes=("agg", "disagg") if serving == "both" else (serving,),
                batches=batches,
                quant=quant,
                plot=plot,
                fmt="json" if out.json else "text",
                framework_version=framework_version,
            )
        out.result(report)
        return
    if sweep:
        if cost_model != "roofline":
            raise click.UsageError("--sweep prices with the roofline cost model")
        out.result(
            run_sweep(
                spec,
                profile,
                dep,
                devices=devices or tp * dp,
                batches=batches,
                quant=quant,
                plot=plot,
                fmt="json" if out.json else "text",
            )
        )
        return
    if devices is not None or batches is not None or plot is not None:
        raise click.UsageError("--devices, --batches and --plot apply to --sweep")
    dep.check(inputs.arch.structure)
    if cost_model == "measured":  # fail before the trace: a missing extra or an unmeasured device
        from ..backends.simulation.estimate.aiconfigurator import require, system_for

        require()
        system_for(profile.name)
    prefill = None  # the image prefill's parts, with --images
    with out.stage("simulate"):
        if requested is None:
            sim = simulate(inputs, spec, dep, profile, cost_model=cost_model, framework=framework)
        else:
            from ..backends.simulation.estimate.vision import simulate_images

            prefill = simulate_images(
                inputs, spec, dep, profile, requested, cost_model=cost_model, framework=framework
            )
            sim = prefill.simulation
    if trace_path is not None:
        atomic_write_text(trace_path, json.dumps(chrome_trace(sim)))
        out.detail(f"wrote trace {trace_path}")
    if out.json:
        out.document(sim_json(sim) if prefill is None else image_prefill_json(prefill))
    else:
        out.result(
            sim_text(sim, top or None) if prefill is None else image_prefill_text(prefill, top or None)
        )


def refuse_remote_code(spec: Spec) -> None:
    """Refuse a spec whose model is its repository's own remote code before any work: ``simulate``
    traces the model through transformers' own classes and runs no remote code (it takes no
    ``--trust-remote-code``), so it could only fail later, deep in the trace, asking for a flag it does
    not have. The error names the specs beside it that read the same model through a transformers
    class; ``plan`` sizes such a spec from its config alone."""
    from ..patching.remote import uses_remote_code
    from ..structure.bounds import shown_path

    if not uses_remote_code(spec):
        return
    model = spec.raw["metadata"].get("model")
    others = []
    for path in sorted(spec.path.parent.glob("*.yaml")):
        if path.resolve() == spec.path.resolve():
            continue
        try:
            other = load_spec(path)
        except KadaptError:
            continue  # a broken neighbour is no alternative
        if model and other.raw["metadata"].get("model") == model and not uses_remote_code(other):
            others.append(shown_path(path))
    instead = f"price {model} with {' or '.join(others)}" if others else "no spec beside it prices this model"
    raise KadaptError(
        f"spec {spec.name} runs the model's own remote code, which kadapt simulate does not run (it traces "
        f"transformers' own classes); {instead}; kadapt plan sizes this spec from its config",
        location=spec.locate("source"),
    )
