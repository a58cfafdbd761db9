"""One given deployment serving N concurrent requests: ``kadapt simulate --concurrency N --isl --osl``.

Published serving benchmarks (``bench_serving --max-concurrency N``, InferenceMAX) measure one layout
at a fixed number of requests in flight; the request sweep (``serving``) searches layouts and batches
for the best under an SLA. This prices the published point: the request sweep restricted to the one
layout (``--tp --dp --ep``) and the one batch (N requests in flight, split over the DP groups),
aggregated (one pool, chunked prefill) at the framework's default step budget (``frameworks.yaml``
``step_tokens.max``: what a server launched without a budget flag runs), in the one weight mode asked
for. The price is the sweep's own candidate for that layout and batch (``request_pricing.aggregated``),
never a second formula, so the two cannot drift apart.

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
from .launch_rules import framework
from .request_pricing import Candidate, Workload
from .serving import ServingSearch
from .sweep import Pricer


def concurrency_search(
    spec: Spec,
    inputs: Mapping[str | None, ModelInputs],
    device: Device,
    base: Deployment,
    workload: Workload,
    framework_name: str,
    concurrency: int,
    pricer: Pricer | None = None,
) -> ServingSearch:
    """The aggregated request search of ``base.parallel`` alone at batch ``concurrency`` and the
    framework's default step budget, after the checks that name what is wrong with the point; priced
    with the framework's kernel table unless ``pricer`` says otherwise."""
    par: Parallel = base.parallel
    if concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1 (got {concurrency})")
    if concurrency % par.dp:
        raise UsageError(
            f"--concurrency {concurrency} does not split over --dp {par.dp} attention groups "
            "(each DP group serves concurrency / dp requests)"
        )
    s = next(iter(inputs.values())).arch.structure
    # checked as the decode step it runs (``--mtp`` drafts are verified there; a prefill refuses them):
    # the layout divides the model and the MTP settings are in range, or a located error
    replace(base, batch=concurrency, query_len=1, decode=True).check(s)
    fw = framework(framework_name)
    rule = fw.refusal(par)
    if rule is not None:
        raise UsageError(
            f"{fw.title} cannot launch TP{par.tp} DP{par.dp} EP{par.ep} ({rule.id}): {rule.why} "
            f"[{rule.source}]"
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
        batches=(concurrency,),
        pricer=pricer or framework_pricer(framework_name),
        layout=par,
        budgets=(fw.step_tokens.max,),
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
) -> Candidate:
    """The aggregated candidate of ``base.parallel`` serving ``concurrency`` requests of ``workload``
    (one weight mode: ``inputs`` holds one), fitting in memory or not (``Candidate.fits`` says)."""
    if len(inputs) != 1:
        raise UsageError("--concurrency prices one weight mode (--quant names one, or none: the checkpoint)")
    search = concurrency_search(spec, inputs, device, base, workload, framework_name, concurrency, pricer)
    result = search.run()
    found = [c for c in result.candidates if c.decode.config.parallel == base.parallel]
    if not found:
        why = result.worker_sizes.get(base.parallel.devices, "no candidate")
        raise UsageError(
            f"cannot price TP{base.parallel.tp} DP{base.parallel.dp} EP{base.parallel.ep}: {why}"
        )
    (candidate,) = found  # one layout, one batch, one budget
    return candidate
