"""Patch sessions under any exit order and across threads.

Sessions are reference-counted and process-wide (``patching/session.py``); each change is a layer in
its attribute's stack (``patching/changes.py``), so specs may exit in any order.
"""

from __future__ import annotations

import itertools
import sys
import threading
import traceback
from contextlib import ExitStack

import pytest
from fixtures.spec_files import tiny_kimi_config, write_spec

from kimi_adapter_core.loading import applied
from kimi_adapter_core.patching import gate
from kimi_adapter_core.patching.changes import _STACKS
from kimi_adapter_core.patching.ledger import APPLIED, GATED_OFF, SKIPPED
from kimi_adapter_core.patching.session import _active, close_session, open_session
from kimi_adapter_core.spec import load_spec

DSV3 = "transformers.models.deepseek_v3.modeling_deepseek_v3"

TOY = """
SYMBOL_CALLS = []


class Base:
    def forward(self, x):
        return x


class Toy(Base):
    def forward(self, x):
        return x


def plus_one(self, x):
    return x + 1


def plus_ten(self, x):
    return x + 10


def plus_hundred(original, self, x):
    return original(self, x) + 100


def helper():
    return "helper"
"""

HEAD = """
gate:
  model_type: kimi_k25
source:
  config: model/config.json
module_paths:
  language_model: model.language_model
  language_layers: model.language_model.layers
  lm_head: lm_head
"""

# three specs patching the same attribute with different kinds; what each does to a claimed 0
PATCHES = {
    "a": ("replace", "kadapt_sessions_toy:plus_one", 1),
    "b": ("replace", "kadapt_sessions_toy:plus_ten", 10),
    "c": ("wrap", "kadapt_sessions_toy:plus_hundred", 100),
}


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / "kadapt_sessions_toy.py").write_text(TOY, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("kadapt_sessions_toy", None)
    import kadapt_sessions_toy

    yield kadapt_sessions_toy
    sys.modules.pop("kadapt_sessions_toy", None)


def _claimed(obj, spec_name: str):
    """Claim one plain object for ``spec_name`` (what ``load_model`` does for every module)."""
    gate._claims.setdefault(obj, set()).add(spec_name)
    return obj


def _spec(tmp_path, name: str, body: str):
    folder = tmp_path / name
    folder.mkdir()
    return load_spec(write_spec(folder, HEAD + body, config=tiny_kimi_config(), name=name))


def _patch_spec(tmp_path, name: str, target: str = "kadapt_sessions_toy:Toy.forward"):
    kind, impl, _ = PATCHES[name]
    body = f"patches:\n  - {{id: P, why: test, target: '{target}', kind: {kind}, impl: '{impl}'}}\n"
    return _spec(tmp_path, name, body)


def test_two_specs_on_expand_kv_exited_out_of_order_restore_the_original(tmp_path):
    """The audit's case: A then B patch DeepseekV3Attention.expand_kv; A exits first, then B."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    original = vars(DeepseekV3Attention)["expand_kv"]
    specs = []
    for name in ("first", "second"):
        body = (
            "patches:\n"
            f"  - {{id: K, why: test, target: '{DSV3}:DeepseekV3Attention.expand_kv', kind: replace,"
            " impl: 'builtin:mla_expand_kv_functional'}\n"
        )
        specs.append(_spec(tmp_path, name, body))
    outer, inner = applied(specs[0], backend="none"), applied(specs[1], backend="none")
    outer.__enter__()
    inner.__enter__()
    second_gate = vars(DeepseekV3Attention)["expand_kv"]
    assert second_gate.__kadapt_gate__ == "second"
    outer.__exit__(None, None, None)  # out of order: the first spec leaves while the second is in
    assert vars(DeepseekV3Attention)["expand_kv"] is second_gate  # the second keeps its patch
    assert second_gate.__kadapt_cell__[0] is original  # ...and no longer dispatches via the first
    inner.__exit__(None, None, None)
    assert vars(DeepseekV3Attention)["expand_kv"] is original
    assert not _active and not _STACKS


@pytest.mark.parametrize("order", list(itertools.permutations("abc")))
def test_any_exit_order_keeps_live_patches_and_restores_the_original(tmp_path, toy, order):
    """Three specs stacked on Toy.forward; after each exit, every live spec's modules still get
    its patch, everyone else gets upstream; after the last exit the class is as it was."""
    original = vars(toy.Toy)["forward"]
    specs = {name: _patch_spec(tmp_path, name) for name in "abc"}
    objects = {name: toy.Toy() for name in "abc"}
    plain = toy.Toy()
    contexts = {name: applied(specs[name], backend="none") for name in "abc"}
    for name in "abc":
        assert contexts[name].__enter__().status_of("P") == APPLIED
    for name, obj in objects.items():
        _claimed(obj, name)
    live = set("abc")
    for leaving in order:
        contexts[leaving].__exit__(None, None, None)
        live.discard(leaving)
        for name, obj in objects.items():
            expected = PATCHES[name][2] if name in live else 0
            assert obj.forward(0) == expected, (order, leaving, name)
        assert plain.forward(0) == 0
    assert vars(toy.Toy)["forward"] is original
    assert "forward" in vars(toy.Base) and not _active and not _STACKS


def test_exit_order_on_an_inherited_attribute_deletes_rather_than_copies(tmp_path, toy):
    """Patching an attribute the class only inherits: after any exit order, it is inherited again."""
    del toy.Toy.forward  # Toy now inherits Base.forward
    a = _patch_spec(tmp_path, "a")
    b = _patch_spec(tmp_path, "b")
    with ExitStack() as stack:
        first = stack.enter_context(ExitStack())
        first.enter_context(applied(a, backend="none"))
        stack.enter_context(applied(b, backend="none"))
        first.close()  # a exits first
        assert "forward" in vars(toy.Toy)
    assert "forward" not in vars(toy.Toy) and toy.Toy().forward(0) == 0


def test_shim_injected_by_one_spec_is_held_by_another(tmp_path, toy):
    body = (
        "environment:\n"
        "  - {id: E, why: test, kind: inject_symbol, target: 'kadapt_sessions_toy:injected',"
        " impl: 'kadapt_sessions_toy:helper'}\n"
    )
    one, two = _spec(tmp_path, "one", body), _spec(tmp_path, "two", body)
    first, second = applied(one, backend="none"), applied(two, backend="none")
    assert first.__enter__().status_of("E") == APPLIED
    assert second.__enter__().status_of("E") == GATED_OFF
    first.__exit__(None, None, None)
    assert toy.injected() == "helper"  # the second spec still relies on it
    second.__exit__(None, None, None)
    assert not hasattr(toy, "injected") and not _STACKS


def _run_threads(*targets):
    errors: list[str] = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException:  # noqa: BLE001 - reported by the main thread
                errors.append(traceback.format_exc())

        return run

    threads = [threading.Thread(target=guard(fn)) for fn in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("first_out", ["applier", "joiner"])
def test_two_threads_in_one_spec_keep_patches_until_the_last_exits(tmp_path, toy, first_out):
    """Thread 1 applies, thread 2 enters the same spec, one leaves: the other's block still has
    every patch; when both are out the class is restored."""
    original = vars(toy.Toy)["forward"]
    spec = _patch_spec(tmp_path, "a")
    # entered: the applier is inside; both_in: both are inside; first_left: the leaver is out
    entered, both_in, first_left = (threading.Barrier(2, timeout=30) for _ in range(3))
    seen: dict[str, object] = {}

    def _stay(role):
        if role == "joiner":
            entered.wait()
        with applied(spec, backend="none") as ledger:
            seen[role] = ledger.status_of("P")
            if role == "applier":
                entered.wait()
            both_in.wait()
            mine = _claimed(toy.Toy(), "a")
            assert mine.forward(0) == 1
            first_left.wait()  # the other thread has left its block by now
            assert vars(toy.Toy)["forward"] is not original
            assert mine.forward(0) == 1 and toy.Toy().forward(0) == 0

    def _leave(role):
        if role == "joiner":
            entered.wait()
        with applied(spec, backend="none") as ledger:
            seen[role] = ledger.status_of("P")
            if role == "applier":
                entered.wait()
            both_in.wait()
        first_left.wait()

    staying = "joiner" if first_out == "applier" else "applier"
    _run_threads(lambda: _leave(first_out), lambda: _stay(staying))
    assert seen == {"applier": APPLIED, "joiner": SKIPPED}
    assert vars(toy.Toy)["forward"] is original and not _active and not _STACKS


def test_two_threads_two_specs_on_one_attribute(tmp_path, toy):
    """Different specs in different threads, the first applied leaves first."""
    original = vars(toy.Toy)["forward"]
    a, b = _patch_spec(tmp_path, "a"), _patch_spec(tmp_path, "b")
    a_in, b_in, a_out = (threading.Barrier(2, timeout=30) for _ in range(3))

    def first():
        with applied(a, backend="none"):
            a_in.wait()
            b_in.wait()
        a_out.wait()

    def second():
        a_in.wait()
        with applied(b, backend="none"):
            b_in.wait()
            a_out.wait()
            mine = _claimed(toy.Toy(), "b")
            assert mine.forward(0) == 10 and toy.Toy().forward(0) == 0

    _run_threads(first, second)
    assert vars(toy.Toy)["forward"] is original and not _active and not _STACKS


def test_closing_a_handle_twice_counts_once(tmp_path, toy):
    original = vars(toy.Toy)["forward"]
    spec = _patch_spec(tmp_path, "a")
    session = open_session(spec, "none")
    handle = open_session(spec, "none")
    close_session(handle)
    close_session(handle)  # a second close must not take the owner's count down
    assert vars(toy.Toy)["forward"] is not original
    close_session(session)
    assert vars(toy.Toy)["forward"] is original and not _active
