"""Where a failed replay first departs from transformers: which graph, step, layer and output.

Run only when a logits or token check failed, so a passing verify pays nothing: each layer's cached
key and value (a linear layer's conv and recurrent state) are compared with what transformers' own
layers wrote, in layer order, the prefill first and then each decode step fed the same tokens. The
same walk is ``compare_states``, the check a stack with linear layers always runs: their states
are the graph outputs no logit comparison can vouch for by itself (a state carries into every later
step), so verify compares each of them with transformers' own cache."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import DynamicCache

from .... import upstream
from ..runtime import abi as runtime
from .replay import Replay
from .tolerance import Tolerance, compare
from .topk_ties import TopkRecorder, recording_ties


class _RecordingCache(DynamicCache):
    """transformers' own cache for the reference run, keeping also what each layer handed
    ``Cache.update`` in the latest forward: what the saved graphs' presents hold in the ``heads`` and
    ``latent`` layouts (``runtime``'s KV layouts), whatever the layer then keeps (a sliding window)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        self._recording()

    def _recording(self) -> None:
        self.written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.indexed: dict[int, torch.Tensor] = {}  # a DSA layer's new indexer keys, [B, 1, Q, dim]
        # a compressed layer's raw kv || gate of every token so far, [B, T, 2 * dim], by (layer, series:
        # compressor, or a CSA layer's indexer; its ring is the last windows' worth, slot p % ring):
        # recorded from DeepseekV4HCACache.store_compression_weights
        self.compressor_inputs: dict[tuple[int, str], torch.Tensor] = {}
        for index, layer in enumerate(getattr(self, "layers", ())):
            if hasattr(layer, "store_compression_weights") and hasattr(layer, "compress_rate"):
                layer.store_compression_weights = self._recording_compressor(index, layer)

    def _recording_compressor(self, index: int, layer: Any) -> Any:
        store = layer.store_compression_weights

        def recorded(name: str, kv: torch.Tensor, gate: torch.Tensor) -> Any:
            new = torch.cat([kv, gate], dim=-1).detach().clone()
            past = self.compressor_inputs.get((index, name))
            self.compressor_inputs[index, name] = new if past is None else torch.cat([past, new], dim=1)
            return store(name, kv, gate)

        return recorded

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.written[layer_idx] = (key_states.detach().clone(), value_states.detach().clone())
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.indexed[layer_idx] = indexer_key_states.detach().clone().unsqueeze(1)
        return super().update_indexer(indexer_key_states, layer_idx)


def _recording_cache(model: nn.Module) -> _RecordingCache:
    """The recording cache for ``model``: over ``DynamicCache``, or the cache class its forward insists
    on (MiniMax's ``MiniMaxCache``, built without a config: ``upstream.model_cache_class``)."""
    own = upstream.model_cache_class(model)
    if own is DynamicCache:
        return _RecordingCache(model.config)
    recording = type(f"_Recording{own.__name__}", (_RecordingCache, own), {"__init__": _own_init(own)})
    return recording()


def _own_init(own: type) -> Any:
    def __init__(self: _RecordingCache) -> None:
        own.__init__(self)
        self._recording()

    return __init__


def _expected_states(
    model: nn.Module, cache: _RecordingCache, layout: str, kinds: Sequence[str]
) -> list[torch.Tensor]:
    """What the graph's presents must hold, layer by layer in ABI order: what transformers' attention
    layers wrote (key, value; per head through the layer's own ``expand_kv`` for the ``expanded`` MLA
    layout), and a linear (or hybrid) layer's conv and recurrent state as transformers' cache holds them."""
    attentions = {
        m.layer_idx: m for m in model.modules() if hasattr(m, "expand_kv") and hasattr(m, "layer_idx")
    }
    flat: list[torch.Tensor] = []
    for layer, kind in enumerate(kinds):
        if not runtime.LAYER_STATES[kind]:  # a block with no mixer keeps nothing (a DummyLayer)
            continue
        if kind == "linear":  # copies: transformers updates these tensors in place at the next step
            flat += [cache.get_conv_state(layer).clone(), cache.get_recurrent_state(layer).clone()]
            continue
        if kind == "short_conv":  # its LinearAttentionLayer's window alone (no recurrent state)
            flat.append(cache.get_conv_state(layer).clone())
            continue
        if kind == "lightning":  # MiniMaxCache's state, as set_linear_cache last replaced it
            flat.append(cache.get_linear_cache(layer).clone())
            continue
        key, value = cache.written[layer]
        if layout == "expanded":
            with torch.no_grad():
                key, value = attentions[layer].expand_kv(key, value)
        flat += [key, value]
        if kind == "indexed":  # the indexer's keys, cached as a one-head key
            flat.append(cache.indexed[layer])
        if kind == "hybrid":  # its mixer's states after its KV (Falcon-H1, Zamba), copied as for linear
            flat += [cache.get_conv_state(layer).clone(), cache.get_recurrent_state(layer).clone()]
        if kind in runtime.COMPRESSED_KINDS:
            flat += compressor_states(cache, layer, "compressor", runtime.LAYER_RINGS[kind])
        if kind == "csa":  # its indexer's own series
            flat += compressor_states(cache, layer, "indexer", runtime.LAYER_RINGS[kind])
    return flat


def compressor_states(cache: _RecordingCache, layer: int, name: str, windows: int) -> list[torch.Tensor]:
    """A compressed layer's ring and entries of series ``name`` as the graphs return them, from
    transformers' own cache: the ring (``windows`` windows) slot ``j`` the raw projections of the last
    position ``= j mod ring`` so far (zeros before the first; rows of a window no entry reads again may
    be stale, as the graph's are), and the entries its ``compressed_kv[name]`` holds, ``[B, 1, n, dim]``
    (``Replay.written_at`` returns as many of the graph's)."""
    own = cache.layers[layer]
    seen, width = cache.compressor_inputs[layer, name], own.compress_rate * windows
    slots = torch.arange(width)
    last = slots + width * torch.div(seen.shape[1] - 1 - slots, width, rounding_mode="floor")
    ring = seen.index_select(1, last.clamp(min=0)) * (last >= 0).view(1, -1, 1).to(seen.dtype)
    entries = own.compressed_kv[name]
    if entries is None:
        entries = seen.new_zeros(seen.shape[0], 0, seen.shape[-1] // (2 * windows))
    return [ring.unsqueeze(1), entries.detach().clone().unsqueeze(1)]


def _first_position(logits: torch.Tensor, reference: torch.Tensor, tolerance: Tolerance) -> int | None:
    """The first position (dim -2) whose logits are outside ``tolerance``, None if none is."""
    if logits.shape != reference.shape:
        return 0
    for position in range(logits.shape[-2]):
        if not compare([(logits[..., position, :], reference[..., position, :])], tolerance).passed:
            return position
    return None


def _layer_hint(layer: int, parts: list[str], kind: str) -> str:
    """What a departing cache suggests: one of key/value off points at that path of the layer, both at
    the layer's input (the previous layer's output, or the embeddings), a projection both come from
    (MLA's kv_a_proj), or in a decode step the cache slot the step wrote. A linear layer's conv window
    holds its projected inputs; its recurrent state is the scan over them."""
    if parts[0] in ("conv", "recurrent"):
        if parts == ["recurrent"]:
            return f"its conv window is within the bound: layer {layer}'s scan (gates, decay, state update)"
        source = "the embeddings" if layer == 0 else f"layer {layer - 1}'s output"
        return f"its conv window: layer {layer}'s input projection or its input ({source})"
    if parts == ["index_key"]:
        return f"its key and value are within the bound: layer {layer}'s indexer key path (wk, k_norm, rope)"
    parts = [part for part in parts if part != "index_key"]
    if len(parts) == 1:
        other, path = ("value", "(projection, norm, rope)") if parts[0] == "key" else ("key", "(projection)")
        return f"its {other} is within the bound: layer {layer}'s {parts[0]} path {path}"
    source = "the embeddings" if layer == 0 else f"layer {layer - 1}'s attention or MLP"
    slot = ", or the cache slot the step wrote" if kind == "decode" else ""
    return f"key and value both: layer {layer}'s input ({source}), a projection both come from{slot}"


def _departure(
    replay: Replay,
    kind: str,
    ours: list[torch.Tensor],
    expected: list[torch.Tensor],
    logits: tuple[torch.Tensor, torch.Tensor, int],
    tolerance: Tolerance,
) -> str | None:
    """The first layer (in order) whose cached key or value departs from transformers', and where the
    logits do, said together; None when every cache and every logit is within ``tolerance``."""
    actual, reference, offset = logits
    at = _first_position(actual, reference, tolerance)
    logit_text = "logits within the bound" if at is None else f"logits differ from position {offset + at}"
    if len(ours) != len(expected):
        return f"the graph returns {len(ours)} cache tensors, transformers' layers wrote {len(expected)}"
    starts = [
        sum(len(roles) for roles in replay.layer_roles[:layer]) for layer in range(len(replay.layer_roles))
    ]
    for layer, (roles, start) in enumerate(zip(replay.layer_roles, starts, strict=True)):
        pair = [compare([(ours[i], expected[i])], tolerance) for i in range(start, start + len(roles))]
        parts = [part for part, close in zip(roles, pair, strict=True) if not close.passed]
        if not parts:
            continue
        first = pair[roles.index(parts[0])]
        output = replay.output_name(kind, 1 + start + roles.index(parts[0]))
        what = "cache" if parts[0] in ("key", "value") else "state"
        return (
            f"layer {layer} {parts[0]} {what} departs first (output {output!r}: {first.detail()}; "
            f"{_layer_hint(layer, parts, kind)}); {logit_text}"
        )
    if at is None:
        return None
    return (
        f"every layer's KV cache is within the bound, {logit_text}: the departure is after the last cache "
        "write (the last layer's attention output or MLP, the final norm, the LM head or the logits' "
        "outside ops)"
    )


def localise(model: nn.Module, replay: Replay, prompt: torch.Tensor, steps: int, tolerance: Tolerance) -> str:
    """Where the replay first departs from transformers: the prefill's presents layer by layer, then
    each decode step's written row, both models fed the replay's own greedy tokens so they stay on one
    path. Only run after a logits or token check failed: the passing path never pays for it.

    A diagnosis, not a check: if it cannot be made (a model whose forward takes no cache object, a
    layer without ``expand_kv``), the report says why and the failed checks stand as they are."""
    try:
        return _first_departure(model, replay, prompt, steps, tolerance)
    except Exception as exc:  # noqa: BLE001 - any failure of the diagnosis must not hide the verdict
        return f"not localised: comparing layer by layer failed ({type(exc).__name__}: {exc})"


class Step(NamedTuple):
    """One graph call of the walk and what transformers' own layers did for the same tokens."""

    graph: str  # prefill | decode
    number: int  # decode step (0: the prefill)
    ours: list[torch.Tensor]  # the graph's states (decode: attention rows written at the position)
    expected: list[torch.Tensor]
    logits: tuple[torch.Tensor, torch.Tensor, int]  # ours, transformers', first position
    ties: tuple[str, ...] = ()  # exact ties at a DSA top-k boundary in transformers' step (localise only)


def walk(
    model: nn.Module, replay: Replay, prompt: torch.Tensor, steps: int, *, ties: bool = False
) -> Iterator[Step]:
    """The prefill and ``steps`` greedy decode steps of the replay and of transformers with its own
    ``DynamicCache``, both fed the replay's tokens so they stay on one path; with ``ties``, each step
    also names the exact ties at its DSA top-k boundaries (``topk_ties``)."""
    if not ties:
        yield from _walk(model, replay, prompt, steps, None)
        return
    with recording_ties(model) as recorder:
        yield from _walk(model, replay, prompt, steps, recorder)


def _walk(
    model: nn.Module, replay: Replay, prompt: torch.Tensor, steps: int, recorder: TopkRecorder | None
) -> Iterator[Step]:
    def step_ties() -> tuple[str, ...]:
        return recorder.take_ties() if recorder is not None else ()

    layout = replay.kv_layout
    cache = _recording_cache(model)
    keyword = upstream.cache_keyword(model)  # 5.24: ``cache``, before: ``past_key_values``
    lengths = torch.full((prompt.shape[0],), prompt.shape[1])
    # positions are passed as generate() passes them: some models (Bamba) number a call's tokens from 0
    # when given none, whatever the cache holds
    positions = torch.arange(prompt.shape[1]).expand(prompt.shape[0], -1)
    with torch.no_grad():
        reference = model(input_ids=prompt, position_ids=positions, **{keyword: cache}, use_cache=True).logits
    logits, present = replay.prefill_outputs(prompt, lengths)
    expected = _expected_states(model, cache, layout, replay.kinds)
    yield Step("prefill", 0, present, expected, (logits, reference, 0), step_ties())
    states = replay.place(present, lengths)
    for step in range(steps):
        token, position = logits[:, -1:].argmax(-1), prompt.shape[1] + step
        with torch.no_grad():
            at = torch.full_like(token, position)
            reference = model(input_ids=token, position_ids=at, **{keyword: cache}, use_cache=True).logits
        logits, states = replay.run_decode(token, position, states)
        expected = _expected_states(model, cache, layout, replay.kinds)
        yield Step(
            "decode",
            step + 1,
            replay.written_at(states, position),
            expected,
            (logits, reference, position),
            step_ties(),
        )


def _first_departure(
    model: nn.Module, replay: Replay, prompt: torch.Tensor, steps: int, tolerance: Tolerance
) -> str:
    """``localise``'s comparison, layer by layer in order, prefill then each decode step."""
    for step in walk(model, replay, prompt, steps, ties=True):
        found = _departure(replay, step.graph, step.ours, step.expected, step.logits, tolerance)
        if found is not None:
            if step.ties:
                found += (
                    "; transformers' DSA top-k is tied at its boundary in this step "
                    f"({'; '.join(step.ties)}): "
                    "which of the tied keys are kept has no defined answer, so a departure here is the tie"
                )
            return "prefill: " + found if step.graph == "prefill" else f"decode step {step.number}: {found}"
    return (
        f"not localised: fed the same tokens, every layer's KV cache and the logits stay within the bound "
        f"for the prefill and {steps} decode steps (a near tie decided a greedy token differently)"
    )
