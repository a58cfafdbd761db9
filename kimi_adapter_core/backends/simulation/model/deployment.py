"""One simulated step: the parallel layout plus the shapes of the batch it runs.

``query_len`` is the number of new tokens each query feeds in this step and ``context_len`` the tokens
already in its KV cache. A decode step feeds ``1 + mtp`` tokens per query (the next token plus the
MTP drafts being verified); a prefill step feeds ``query_len`` tokens on top of ``context_len`` cached
ones (chunked prefill / prefix-cache hits). ``routing`` says how tokens spread over the routed experts:
``power_law`` (real routers without expert-load balancing: a few hot experts set the busiest rank's
time, priced by the factor measured in the kernel table) or ``uniform`` (a perfectly balanced load).
``eager_host`` is the host's time per launched kernel of an engine that runs the step without CUDA
graphs (``estimate/eager.py``; 0: the step is replayed as a graph, as kernel tables price it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ....errors import UsageError
from ....structure.model import ModelStructure
from .parallel import Parallel

ROUTINGS = ("power_law", "uniform")


@dataclass(frozen=True)
class Deployment:
    parallel: Parallel
    batch: int  # global concurrent queries
    query_len: int
    context_len: int
    decode: bool
    mtp: int = 0
    mtp_acceptance: float = 0.7
    kv_dtype: str = "bf16"
    routing: str = "power_law"  # power_law | uniform
    eager_host: float = 0.0  # seconds of host time per launched kernel (0: CUDA graphs)

    @property
    def tokens_per_query(self) -> int:
        return 1 + self.mtp if self.decode else self.query_len

    @property
    def batch_per_rank(self) -> int:
        return self.batch // self.parallel.dp

    @property
    def tokens_per_rank(self) -> int:
        """Attention-side tokens on one rank (every TP rank of a DP group sees the group's tokens)."""
        return self.batch_per_rank * self.tokens_per_query

    @property
    def output_tokens(self) -> float:
        """Tokens the whole deployment emits per step (prefill: the prompt tokens it consumes)."""
        if self.decode:
            return self.batch * (1 + self.mtp * self.mtp_acceptance)
        return float(self.batch * self.query_len)

    def check(self, s: ModelStructure) -> None:
        self.parallel.check(s)
        self.parallel.split_batch(self.batch)
        if self.query_len < 1:
            raise UsageError(f"--query-len must be >= 1 (got {self.query_len})")
        if self.context_len < 0:
            raise UsageError(f"--context-len must be >= 0 (got {self.context_len})")
        if self.mtp < 0:
            raise UsageError(f"--mtp must be >= 0 (got {self.mtp})")
        if self.mtp and not self.decode:
            raise UsageError("--mtp applies to decode steps; add --decode")
        if self.routing not in ROUTINGS:
            raise UsageError(f"routing must be one of {', '.join(ROUTINGS)} (got {self.routing!r})")
        if self.eager_host < 0:
            raise UsageError(f"the host time per eager launch must be >= 0 (got {self.eager_host})")
        if not 0 <= self.mtp_acceptance <= 1:
            raise UsageError(f"--mtp-acceptance must be in [0, 1] (got {self.mtp_acceptance})")
        # a config that states no max_position_embeddings (0: a pure SSM stack's) bounds nothing
        if s.max_positions and self.context_len + self.tokens_per_query > s.max_positions:
            raise UsageError(
                f"context {self.context_len} + {self.tokens_per_query} new tokens exceeds the "
                f"model's max_position_embeddings {s.max_positions}"
            )
