"""``verify``: extract a tiny random model of the spec's architecture and replay the saved files.

(Not named ``verify.py``: importing such a submodule would rebind the package's ``verify`` function.)

The check runs the real path end to end: the spec is applied, a tiny model is built on meta and
extracted by ``pipeline.run`` (tracing, layer replication, JSON writing), the JSON files are loaded
back with ``torch_ir.load_ir`` and executed by ``torch_ir``'s executor with the weights of an
identical CPU model renamed to checkpoint names. The reference is transformers itself with the
patches removed and the upstream eager experts loop: prefill logits, then a greedy generation of
``decode_steps`` tokens that the one decode graph produces by being fed its own present KV, must
equal ``model.generate(do_sample=False)`` token for token, logits within ``tolerance``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import KadaptError
from ...spec.model import Spec
from . import runtime
from .naming import rename_weight
from .options import ExtractionOptions
from .pipeline import run

# Sizes of the tiny text backbone (keys present in the spec's text config are overridden).
TINY_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "vocab_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    # Random weights at the default 0.02 give near-uniform logits whose argmax float noise could flip;
    # wider weights make greedy tokens a meaningful comparison.
    "initializer_range": 0.2,
}
# Other sub-models (a vision tower) are built but not extracted: only make them small.
TINY_OTHER = {
    "hidden_size": 32,
    "vt_hidden_size": 32,
    "mm_hidden_size": 32,
    "num_hidden_layers": 1,
    "vt_num_hidden_layers": 1,
    "num_attention_heads": 2,
    "vt_num_attention_heads": 2,
    "intermediate_size": 64,
    "vt_intermediate_size": 64,
    "text_hidden_size": TINY_TEXT["hidden_size"],
}
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "media_placeholder_token_id": 3}


def tiny_overrides(spec: Spec, options: ExtractionOptions) -> dict[str, Any]:
    """Dotted config overrides that shrink the spec's model; the spec's own ``config_overrides`` win."""
    from ...config.source import resolve_source

    raw = resolve_source(spec).raw
    text_key = spec.abi.config if spec.abi is not None else None
    overrides: dict[str, Any] = {}
    for key, section in [(None, raw), *((k, v) for k, v in raw.items() if isinstance(v, dict))]:
        prefix = f"{key}." if key else ""
        sizes = TINY_TEXT if key == text_key else TINY_OTHER if key else {}
        for name, value in [*sizes.items(), *TOKEN_IDS.items()]:
            if name in section or (name == "initializer_range" and key == text_key):
                overrides[prefix + name] = value
    overrides.update(options.verify_overrides)
    return overrides


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class VerifyReport:
    kv_layout: str
    tolerance: float
    mla_attention: str = "reexpand"
    checks: list[Check] = field(default_factory=list)
    tokens_ir: list[list[int]] = field(default_factory=list)
    tokens_reference: list[list[int]] = field(default_factory=list)
    max_logit_diff: float = 0.0
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check.passed for check in self.checks)

    def add(self, name: str, passed: bool, detail: str) -> None:
        self.checks.append(Check(name, bool(passed), detail))

    def render(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [
            f"verify ({self.kv_layout} KV, {self.mla_attention} MLA, tolerance {self.tolerance:g}): "
            f"{verdict} in {self.seconds:.1f} s"
        ]
        lines += [f"  [{'ok' if c.passed else 'FAIL'}] {c.name}: {c.detail}" for c in self.checks]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "kv_layout": self.kv_layout,
            "mla_attention": self.mla_attention,
            "tolerance": self.tolerance,
            "max_logit_diff": self.max_logit_diff,
            "tokens_ir": self.tokens_ir,
            "tokens_reference": self.tokens_reference,
            "checks": [dataclasses.asdict(c) for c in self.checks],
            "seconds": round(self.seconds, 3),
        }


@contextlib.contextmanager
def _upstream_experts(config: Any) -> Iterator[None]:
    """Run the reference with transformers' own eager experts loop, not the export-friendly one."""
    saved = config._experts_implementation
    config._experts_implementation = "eager"
    try:
        yield
    finally:
        config._experts_implementation = saved


def _randomize_router_bias(model: nn.Module) -> None:
    """The router's correction bias initialises to zeros; random values exercise the biased top-k."""
    generator = torch.Generator().manual_seed(1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)


def _reference(
    model: nn.Module, prompt: torch.Tensor, steps: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Unpatched transformers: prefill logits, greedy tokens and per-token logits of ``generate``."""
    from transformers import GenerationConfig

    generation = GenerationConfig(
        max_new_tokens=steps + 1,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        prefill_logits = model(input_ids=prompt).logits
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=generation)
    return prefill_logits, out.sequences[:, prompt.shape[1] :], list(out.logits)


class _Replay:
    """Runs the saved IR files with torch_ir's executor, the way another tool would."""

    def __init__(self, options: ExtractionOptions, weights: dict[str, torch.Tensor]) -> None:
        import torch_ir

        self.prefill = torch_ir.IRExecutor(torch_ir.load_ir(options.path("prefill")), weights)
        self.decode = torch_ir.IRExecutor(torch_ir.load_ir(options.path("decode")), weights)
        self.dtype = getattr(torch, options.dtype)
        self.max_cache_len = options.max_cache_len

    def run_prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        _, mask, positions = runtime.prefill_inputs(
            batch=prompt.shape[0], prefill_len=prompt.shape[1], dtype=self.dtype, device="cpu"
        )
        logits, *present = self.prefill.execute((prompt, mask, positions))
        return logits, runtime.place_prefill_kv(present, self.max_cache_len)

    def run_decode(
        self, token: torch.Tensor, position: int, cache: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list]:
        positions = torch.full((token.shape[0], 1), position, dtype=torch.long)
        mask = runtime.additive_causal_mask(positions, self.max_cache_len, self.dtype)
        logits, *present = self.decode.execute((token, mask, positions, torch.tensor([position]), *cache))
        return logits, present


def _compare(
    report: VerifyReport, model: nn.Module, replay: _Replay, prompt: torch.Tensor, steps: int
) -> None:
    ref_prefill, ref_tokens, ref_logits = _reference(model, prompt, steps)
    logits, cache = replay.run_prefill(prompt)
    diff = (logits - ref_prefill).abs().max().item()
    report.max_logit_diff = diff
    report.add(
        "prefill logits", diff <= report.tolerance, f"max |diff| {diff:.2e} over {tuple(logits.shape)}"
    )
    token = logits[:, -1].argmax(-1, keepdim=True)
    tokens = [token]
    step_diffs = [(logits[:, -1] - ref_logits[0]).abs().max().item()]
    for step in range(steps):
        logits, cache = replay.run_decode(token, prompt.shape[1] + step, cache)
        step_diffs.append((logits[:, -1] - ref_logits[step + 1]).abs().max().item())
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    ir_tokens = torch.cat(tokens, dim=1)
    report.tokens_ir = ir_tokens.tolist()
    report.tokens_reference = ref_tokens.tolist()
    worst = max(step_diffs)
    report.max_logit_diff = max(diff, worst)
    last = prompt.shape[1] + steps - 1
    report.add(
        "greedy generation",
        torch.equal(ir_tokens, ref_tokens),
        f"{ir_tokens.shape[1]} tokens (1 prefill + {steps} decode steps, "
        f"positions {prompt.shape[1]}..{last}) "
        f"{'equal' if torch.equal(ir_tokens, ref_tokens) else 'DIFFER'} to model.generate",
    )
    report.add("decode logits", worst <= report.tolerance, f"max |diff| {worst:.2e} over {steps + 1} tokens")


def _check_weights(
    report: VerifyReport, options: ExtractionOptions, weights: dict[str, torch.Tensor]
) -> None:
    """Every IR weight must bind to a checkpoint tensor of the same shape and dtype."""
    import torch_ir
    from torch_ir.weight_loader import validate_weights_against_ir

    problems = []
    for kind in ("prefill", "decode"):
        problems += validate_weights_against_ir(weights, torch_ir.load_ir(options.path(kind)))
    report.add(
        "weights bind to checkpoint names", not problems, "; ".join(problems) or "all names, shapes, dtypes"
    )


def verify(spec: Spec, options: ExtractionOptions, *, echo: Callable[[str], Any]) -> VerifyReport:
    """Extract, save, reload and replay a tiny model of ``spec``; compare with transformers."""
    from ...loading import applied, load_config, load_model

    start = time.perf_counter()
    report = VerifyReport(options.kv_layout, options.verify_tolerance, options.mla_attention)
    config = load_config(spec, backend="extraction", overrides=tiny_overrides(spec, options))
    text_config = getattr(config, spec.abi.config) if spec.abi is not None and spec.abi.config else config
    if text_config.num_hidden_layers < 2:
        raise KadaptError("verify needs a tiny model with at least 2 decoder layers")
    with tempfile.TemporaryDirectory(prefix="kadapt-verify-") as tmp:
        small = dataclasses.replace(
            options,
            output_dir=Path(tmp),
            prefill_len=options.verify_prefill_len,
            max_cache_len=options.verify_max_cache_len,
            dtype="float32",
        )
        torch.manual_seed(0)
        with applied(spec, backend="extraction"):
            model = load_model(spec, device="cpu", config=config, dtype=torch.float32).eval()
            _randomize_router_bias(model)
            meta = load_model(spec, device="meta", config=config, dtype=torch.float32).eval()
            echo(
                f"verify: tiny {type(model).__name__}, {text_config.num_hidden_layers} layers, "
                f"{small.kv_layout} KV, {small.mla_attention} MLA, "
                f"prefill {small.prefill_len}, cache {small.max_cache_len}"
            )
            run(spec, meta, small, echo=lambda line: echo(f"  {line.strip()}"))
        weights = {rename_weight(name, options.weight_renames): t for name, t in model.state_dict().items()}
        _check_weights(report, small, weights)
        replay = _Replay(small, weights)
        prompt = torch.randint(
            3,
            text_config.vocab_size,
            (small.batch, small.prefill_len),
            generator=torch.Generator().manual_seed(2),
        )
        with _upstream_experts(text_config):
            _compare(report, model, replay, prompt, options.verify_decode_steps)
    report.seconds = time.perf_counter() - start
    return report
