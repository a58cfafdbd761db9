"""``simulate``'s per-request state, by kind: each named with its size and whether it grows with the
context. DeepSeek-V4's attention layers all keep a 128-token window (constant) while its compressed
entries grow; a hybrid's KV cache grows while its recurrent state is constant (found by an audit: the
line said V4's windowed KV grew and left out the compressed entries, 98.8% of the state)."""

from __future__ import annotations

import json
from typing import Any

from click.testing import CliRunner
from fixtures.spec_files import REPO

from kimi_adapter_core.cli import cli

DECODE = "--device b200 --tp 4 --ep 4 --decode --batch 16 --context-len 131072".split()
MIB = 1 << 20


def _simulate(spec: str, *extra: str) -> str:
    result = CliRunner().invoke(cli, ["simulate", str(REPO / "specs" / f"{spec}.yaml"), *DECODE, *extra])
    assert result.exit_code == 0, result.output
    return result.output


def _states(spec: str) -> dict[str, Any]:
    out = _simulate(spec, "--format", "json")
    return json.loads(out[out.index("{") :])["states"]


def test_deepseek_v4s_windowed_kv_is_constant_and_its_compressed_entries_grow() -> None:
    states = _states("deepseek_v4_flash")
    kv, entries = states["attention_kv"], states["compressed_entries"]
    assert (kv["layers"], kv["grows_with_context"]) == (43, False)
    # 128 tokens x one 512-wide bf16 key, which is also the value (stored once, as a serving engine does)
    assert kv["bytes_per_request_per_device"] == 43 * 128 * 1024
    assert (entries["layers"], entries["grows_with_context"]) == (41, True)
    line = next(x for x in _simulate("deepseek_v4_flash").splitlines() if "state per request" in x)
    assert f"KV cache {43 * 128 * 1024 / MIB:.2f} MiB (43 attention layers, 131073 tokens: constant)" in line
    size = entries["bytes_per_request_per_device"] / MIB
    assert f"compressed entries {size:.2f} MiB (41 compressed layers, grow with context)" in line


def test_a_hybrids_kv_grows_and_its_recurrent_state_is_constant() -> None:
    states = _states("qwen3_next")
    kv, linear = states["attention_kv"], states["linear_attention"]
    assert kv["grows_with_context"] and not linear["grows_with_context"]
    line = next(x for x in _simulate("qwen3_next").splitlines() if "state per request" in x)
    assert "(12 attention layers, 131073 tokens: grows with context)" in line
    assert "(36 layers, constant)" in line
