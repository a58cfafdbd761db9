"""One given deployment serving N concurrent requests: ``kadapt simulate --concurrency N --isl --osl``.

Published serving benchmarks (``bench_serving --max-concurrency N``, InferenceMAX) measure one layout
at a fixed number of requests in flight; the request sweep (``serving``) searches layouts and batches
for the best under an SLA. This prices the published point: the request sweep restricted to the one
layout (``--tp --dp --ep``) and the one batch (N requests in flight, split over the DP groups),
aggregated (one pool: chunked prefill, or prompt steps apart where the framework runs them so) at
the framework's default step budget on the device (``frameworks.yaml`` ``step_tokens``: what a server
launched without a budget flag runs; ``--step-tokens`` names another), in the one weight mode asked
for. The price is the sweep's own candidate for that layout and batch (``request_pricing.aggregated``
or ``prefill_first``), never a second formula, so the two cannot drift apart.

N requests that do not split evenly over the DP groups are priced as the busiest group sets every
group's pace: attention-DP groups step in lockstep (SGLang's scheduler all-reduces every group's token
count each step and a group without requests runs an idle batch; the MoE runs on every group's rows),
so the price is that of ceil(N / dp) requests per group, at the rate of the N requests (dstack's SGLang
DP8 runs measured the same TPOT at 4 and 8 requests: 43.6 and 43.8 ms).

N requests whose KV cache does not fit beside the weights and activations are not all in flight: the
engine admits as many as its cache holds and queues the others (``admitted``). The price is then that
of the requests in flight, and TTFT adds the queue's wait (published runs at 128 requests of 3,200 +
6,400 tokens on 8 H200 measured TTFTs of 18-21 minutes). Where not even one request per DP group fits,
the timing is that of all N, and the report says it does not fit.

A published point is also a finite run: N requests through the client's C slots, the last ones
finishing while slots stand empty (``benchmark_run``). ``price_run`` prices it from the steady state
at C requests and at one.

Disaggregated serving is not priced here: a published xPyD point names two layouts and the pool
sizes, which the one ``--tp --dp --ep`` layout does not say.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ....errors import UsageError
from ....spec.model import Spec
from ..estimate.cost import framework_pricer
from ..model.deployment import Deployment
from ..model.inputs import ModelInputs
from ..model.parallel import Parallel
from ..tables.device import Device
from .benchmark_run import RandomPrompts, Run, closed_loop
from .launch_rules import framework
from .request_pricing import Candidate, Workload
from .serving import ServingSearch
from .sweep import Pricer


def _search(
    spec: Spec,
    inputs: Mapping[str | None, ModelInputs],
    device: Device,
    base: Deployment,
    workload: Workload,
    framework_name: str,
    batch: int,
    pricer: Pricer | None = None,
    step_tokens: int | None = None,
    framework_version: str | None = None,
) -> ServingSearch:
    """The aggregated request search of ``base.parallel`` alone at ``batch`` (a multiple of its DP
    groups: ``price_concurrency`` sizes it) and the framework's default step budget on the device
    (``step_tokens``: per DP group, that budget instead), after the checks
    that name what is wrong with the point; priced with the framework's kernel table unless ``pricer``
    says otherwise."""
    par: Parallel = base.parallel
    s = next(iter(inputs.values())).arch.structure
    # checked as the decode step it runs (``--mtp`` drafts are verified there; a prefill refuses them):
    # the layout divides the model and the MTP settings are in range, or a located error
    decode = replace(base, batch=batch, query_len=1, decode=True)
    decode.check(s)
    fw = framework(framework_name, framework_version)
    rule = fw.refusal(par)
    if rule is not None:
        raise UsageError(
            f"{fw.title} cannot launch TP{par.tp} DP{par.dp} EP{par.ep} ({rule.id}): {rule.why} "
            f"[{rule.source}]"
        )
    budget = step_tokens or fw.step_tokens.default(device.memory_bytes, par.dp, device.name)
    rows = batch // par.dp * decode.tokens_per_query
    if fw.step_tokens.counts_decode and budget <= rows:
        raise UsageError(
            f"a step budget of {budget} tokens per DP group leaves no room for a prompt beside its {rows} "
            f"decode rows ({fw.title} counts them against it): raise --step-tokens above {rows}"
        )
    return ServingSearch(
        spec,
        inputs,
        device,
        base,
        par.devices,
        workload,
        framework_name,
        modes=("agg",),
        batches=(batch,),
        pricer=pricer or framework_pricer(framework_name),
        layout=par,
        budgets=(budget,),
        framework_version=framework_version,
    )


def price_concurrency(
    spec: Spec,
    inputs: Mapping[str | None, ModelInputs],
    device: Device,
    base: Deployment,
    workload: Workload,
    framework_name: str,
    concurrency: int,
    pricer: Pricer | None = None,
    step_tokens: int | None = None,
    framework_version: str | None = None,
) -> Candidate:
    """The aggregated candidate of ``base.parallel`` serving ``concurrency`` requests of ``workload``
    (one weight mode: ``inputs`` holds one). Where their KV cache does not fit beside the weights and
    activations, the engine holds as many requests in flight as it does (``admitted``) and the others
    wait in its queue: the candidate is priced at those in flight, its TTFT adds the wait, and
    ``Candidate.queued`` counts the waiting requests. Where not even one request per DP group fits, or
    what does not fit is not the KV cache (a mixed step's activations), the candidate is priced at
    ``concurrency`` and ``Candidate.fits`` says it does not fit. ``step_tokens``: the step budget per DP
    group the engine ran with, where it is not the framework's default on the device (a release whose
    default differs); ``framework_version``: the release whose facts price it (``launch_rules``)."""
    if len(inputs) != 1:
        raise UsageError("--concurrency prices one weight mode (--quant names one, or none: the checkpoint)")
    if concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1 (got {concurrency})")
    dp = base.parallel.dp
    even = lockstep_batch(concurrency, dp)

    def at(batch: int) -> Candidate:
        search = _search(
            spec,
            inputs,
            device,
            base,
            workload,
            framework_name,
            batch,
            pricer,
            step_tokens,
            framework_version,
        )
        return _priced(search, base.parallel)

    priced = at(even)
    held = admitted(priced, even, dp)
    if held != even and held >= dp:
        in_flight = at(held)
        if in_flight.fits:
            # the queue drains at the service rate: a request waits (even - held) / rate for its slot
            # (Little's law over the clients' closed loop: every finished request is replaced at once)
            wait = (even - held) / in_flight.requests_per_s
            priced = replace(in_flight, ttft=in_flight.ttft + wait, queued=even - held)
    if even == concurrency:
        return priced
    # DP groups step in lockstep (the MoE runs on every group's rows each step; a group without a
    # request runs an idle batch): each request runs at the busiest group's pace, and the rate is that
    # of the requests there are
    rate = priced.requests_per_s * concurrency / even
    return replace(priced, requests_per_s=rate, idle=even - concurrency)


def price_run(
    spec: Spec,
    inputs: Mapping[str | None, ModelInputs],
    device: Device,
    base: Deployment,
    framework_name: str,
    concurrency: int,
    prompts: RandomPrompts,
    pricer: Pricer | None = None,
    step_tokens: int | None = None,
    framework_version: str | None = None,
) -> tuple[Candidate, Run]:
    """The steady state of ``concurrency`` requests of the run's mean lengths (``price_concurrency``)
    and the run of ``prompts`` through a client keeping ``concurrency`` in flight (``closed_loop``:
    each request's TTFT the steady state's, its TPOT affine in the requests in flight between the
    price at one request and at ``concurrency``)."""
    workload = Workload(*prompts.means())

    def at(n: int) -> Candidate:
        return price_concurrency(
            spec, inputs, device, base, workload, framework_name, n, pricer, step_tokens, framework_version
        )

    full = at(concurrency)
    one = at(1) if concurrency > 1 else full
    return full, closed_loop(prompts.lengths()[1], concurrency, full.ttft, one.tpot, full.tpot)


def lockstep_batch(concurrency: int, dp: int) -> int:
    """The batch ``concurrency`` requests over ``dp`` DP groups are priced at: every group as busy as
    the busiest (``ceil(concurrency / dp)`` requests each), whose pace the lockstep groups keep."""
    return -(-concurrency // dp) * dp


def admitted(candidate: Candidate, concurrency: int, dp: int) -> int:
    """The requests the engine holds in flight of ``concurrency`` priced as ``candidate``: all of them
    when they fit, else as many (a multiple of ``dp``: the same in every DP group) as the device memory
    left beside the weights and activations holds at their full ISL + OSL tokens of KV cache each, as
    TensorRT-LLM's default capacity scheduler (``GUARANTEED_NO_EVICT``) reserves a request's whole
    sequence before admitting it. SGLang and vLLM admit on the cache a request holds so far and retract
    or preempt one when decoding outgrows the cache, so they hold as many on average at best."""
    memory = candidate.memory
    if candidate.fits or memory.capacity is None or memory.kv_cache <= 0:
        return concurrency
    room = memory.capacity - (memory.used - memory.kv_cache)
    per_request = memory.kv_cache / concurrency
    return max(0, min(concurrency, int(room // per_request)) // dp * dp)


def _priced(search: ServingSearch, par: Parallel) -> Candidate:
    """The one aggregated candidate of layout ``par`` that ``search`` (one batch) finds, as priced."""
    result = search.run()
    found = [c for c in result.candidates if c.decode.config.parallel == par]
    if not found:
        why = result.worker_sizes.get(par.devices, "no candidate")
        raise UsageError(f"cannot price TP{par.tp} DP{par.dp} EP{par.ep}: {why}")
    (candidate,) = found  # one layout, one batch, one budget
    return candidate
