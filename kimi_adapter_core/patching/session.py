"""Applying a spec: environment shims, config, class patches; and taking all of it back.

Order matters and is all-or-nothing:

1. Plan every shim and local patch: import targets, check pins, resolve impls, build behaviours.
   Nothing is touched yet, so a bad entry leaves the process exactly as it was.
2. Install shims (remote code may need them just to import), load the config (bridges, gate).
3. Resolve remote-code targets (that imports the model's code), then install every patch.

A failure in 2-3 undoes what was installed. Apply and revert hold one process-wide ``RLock``.

Sessions are **reference-counted** and process-wide, not per thread: class patches are process-wide
by nature (the call-time gate decides, per call, whose modules get them). Opening a spec that is
already applied (nested, or from another thread) applies nothing: it returns a handle on the live
session whose ledger says "skipped (already applied)", and counts one more user. Closing a handle
or the session itself counts one user down; the patches come off when the *last* user closes, in
whatever order the blocks exit. So a thread inside ``applied(spec)`` keeps its patches even when
the thread that applied them first has left its block. Closing twice is a no-op.

Different specs may patch the same attribute and exit in any order: each change is a layer in that
attribute's stack (``changes``), and undoing a layer re-links the one above it, so the original is
back once every spec has exited. An environment shim whose symbol another live spec injected holds
that symbol too, so it stays until both are gone.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import KadaptError
from ..spec.model import EnvironmentShim, Patch, Spec
from ..spec.requirements import check_requirements
from . import kinds, pins, remote
from .changes import Change, layered
from .gate import GatedAttribute, Reach, gated, via_cell
from .impls import resolve_impl
from .ledger import APPLIED, FAILED, GATED_OFF, NOT_FOR_BACKEND, SKIPPED, Ledger
from .selection import CHOICES, applies_to
from .targets import Resolved, TargetRef, import_module, parse_target, resolve_in

if TYPE_CHECKING:
    from ..config.source import ResolvedSource

LOCK = threading.RLock()
_active: dict[tuple[str, str], Session] = {}


def spec_key(spec: Spec) -> tuple[str, str]:
    return (str(spec.path), spec.name)


def active_session(spec: Spec) -> Session | None:
    return _active.get(spec_key(spec))


@dataclass
class PlannedPatch:
    patch: Patch
    ref: TargetRef
    impl: Callable[..., Any] | None
    location: str
    not_for_backend: bool = False
    installers: list[Callable[[], Change]] = field(default_factory=list)
    status: str = APPLIED
    reason: str = ""


@dataclass
class PlannedShim:
    shim: EnvironmentShim
    module: ModuleType
    attr: str
    value: Any


class Session:
    """One application of one spec for one backend."""

    def __init__(
        self,
        spec: Spec,
        backend: str,
        *,
        trust_remote_code: bool = False,
        source_dir: str | Path | None = None,
        from_hub: bool = False,
    ) -> None:
        if backend not in CHOICES:
            raise KadaptError(f"unknown backend {backend!r}; choose one of: {', '.join(CHOICES)}")
        self.spec = spec
        self.backend = backend
        self.trust_remote_code = trust_remote_code
        self.source_dir = source_dir
        self.from_hub = from_hub
        self.ledger = Ledger(spec.name, backend)
        self.config: Any = None
        self.source: ResolvedSource | None = None
        self.changes: list[Change] = []
        self.nested = False  # a handle on another live session (``owner``), which applied the spec
        self.owner: Session | None = None
        self.users = 0  # open handles on this session, itself included (owner sessions only)
        self.closed = False
        self._remote: list[PlannedPatch] = []
        self._entry: ModuleType | None = None
        self.reach: dict[str, Reach] = {}  # patch id -> calls its behaviour served (all its targets)

    # -- planning (no side effects) -------------------------------------------------------------

    def _plan_shim(self, shim: EnvironmentShim) -> PlannedShim:
        location = self.spec.locate(shim.where)
        try:
            if shim.kind != "inject_symbol":
                raise KadaptError(f"unknown environment shim kind {shim.kind!r} (known: inject_symbol)")
            module_name, sep, attr = shim.target.partition(":")
            if not sep or not attr.isidentifier():
                raise KadaptError(f"bad shim target {shim.target!r}: expected 'package.module:symbol'")
            module = import_module(TargetRef(shim.target, module_name, (), attr, False))
            return PlannedShim(shim, module, attr, resolve_impl(shim.impl))
        except KadaptError as exc:
            self.ledger.record(shim.id, "environment", shim.target, shim.kind, FAILED, exc.message, location)
            raise KadaptError(f"environment {shim.id}: {exc.message}", location=location) from exc

    def _plan_patch(self, patch: Patch) -> PlannedPatch:
        location = self.spec.locate(patch.where)
        ref = parse_target(patch.target)
        if not applies_to(patch.backends, self.backend):
            return PlannedPatch(patch, ref, None, location, not_for_backend=True)
        if patch.kind not in (*kinds.CALLABLE_KINDS, *kinds.ATTRIBUTE_KINDS):
            raise KadaptError(f"patch {patch.id}: unknown kind {patch.kind!r}", location=location)
        impl = resolve_impl(patch.impl) if patch.impl else None
        planned = PlannedPatch(patch, ref, impl, location)
        if not ref.remote:
            self._bind(planned, resolve_in(ref, import_module(ref), must_exist=patch.kind != "set_attribute"))
        return planned

    def _bind(self, planned: PlannedPatch, resolved: Resolved) -> None:
        """Check pins and build the installer for one resolved target (still no side effects)."""
        patch = planned.patch
        if patch.kind == "set_attribute":
            if patch.options.get("only_if_missing") and resolved.exists:
                planned.status, planned.reason = (
                    GATED_OFF,
                    f"{resolved.ref.owner_name} already has {resolved.ref.attr}",
                )
                return
            planned.installers.append(self._attribute_installer(patch, resolved))
            planned.reason = f"{resolved.ref.attr} = {patch.value!r} on claimed instances"
            return
        original = resolved.function()
        if patch.pins:
            pins.verify(patch.pins, original, target=patch.target, location=planned.location)
        cell = [original]
        behaviour = kinds.build(patch, via_cell(cell), planned.impl)
        dispatcher = gated(self.spec.name, cell, behaviour, self.reach.setdefault(patch.id, Reach()))
        new = (
            type(resolved.raw)(dispatcher)
            if isinstance(resolved.raw, (staticmethod, classmethod))
            else dispatcher
        )
        change = Change(
            resolved.owner, resolved.ref.attr, new, resolved.raw, resolved.own, True, dispatcher, original
        )
        planned.installers.append(change.install)
        planned.reason = f"gated on {self.spec.gate.model_type}" + (", pinned" if patch.pins else "")

    def _attribute_installer(self, patch: Patch, resolved: Resolved) -> Callable[[], Change]:
        descriptor = GatedAttribute(
            self.spec.name,
            resolved.ref.attr,
            patch.value,
            resolved.raw,
            resolved.exists,
            self.reach.setdefault(patch.id, Reach()),
        )
        change = Change(
            resolved.owner, resolved.ref.attr, descriptor, resolved.raw, resolved.own, resolved.exists
        )
        return change.install

    def _plan_all(self) -> tuple[list[PlannedShim], list[PlannedPatch]]:
        shims = [self._plan_shim(shim) for shim in self.spec.environment]
        planned = []
        for patch in self.spec.patches:
            try:
                planned.append(self._plan_patch(patch))
            except KadaptError as exc:
                location = self.spec.locate(patch.where)
                self.ledger.record(patch.id, "patch", patch.target, patch.kind, FAILED, exc.message, location)
                raise KadaptError(f"patch {patch.id}: {exc.message}", location=location) from exc
        return shims, planned

    # -- applying --------------------------------------------------------------------------------

    def _load_config(self) -> None:
        """Load the spec's config (bridges recorded in the ledger, gate checked) for this session."""
        from ..config.load import load

        self.config, self.source = load(
            self.spec,
            backend=self.backend,
            trust_remote_code=self.trust_remote_code,
            ledger=self.ledger,
            source_dir=self.source_dir,
            from_hub=self.from_hub,
        )

    def apply(self) -> None:
        shims, planned = self._plan_all()
        try:
            for shim in shims:
                self._install_shim(shim)
            self._load_config()
            self._remote = [p for p in planned if p.ref.remote and not p.not_for_backend]
            for item in self._remote:
                self._bind_remote(item)
            for item in planned:
                self._install(item)
            if self._remote:
                remote.add_listener(self._on_remote_module)
        except BaseException:
            self.revert()
            raise

    def _install_shim(self, planned: PlannedShim) -> None:
        shim = planned.shim
        location = self.spec.locate(shim.where)
        if hasattr(planned.module, planned.attr):
            reason = f"{planned.module.__name__} already provides {planned.attr}"
            if layered(planned.module, planned.attr):
                # another live spec injected it: hold it too, so it stays until both have exited
                value = vars(planned.module)[planned.attr]
                self.changes.append(Change(planned.module, planned.attr, value, value, True).install())
                reason += " (injected by another applied spec; held until this one exits too)"
            self.ledger.record(shim.id, "environment", shim.target, shim.kind, GATED_OFF, reason, location)
            return
        change = Change(planned.module, planned.attr, planned.value, None, False, False)
        self.changes.append(change.install())
        reason = f"injected {getattr(planned.value, '__qualname__', planned.value)}"
        self.ledger.record(shim.id, "environment", shim.target, shim.kind, APPLIED, reason, location)

    def _resolve_remote(self, planned: PlannedPatch) -> Resolved:
        """Resolve in the remote module the model itself uses (next to its auto_map entry)."""
        assert self.source is not None
        if self._entry is None:
            auto_map = getattr(self.config, "auto_map", None) or {}
            self._entry = remote.module_of(remote.model_class(auto_map, self.source))
        module = remote.sibling(self._entry, planned.ref.module)
        return resolve_in(planned.ref, module, must_exist=planned.patch.kind != "set_attribute")

    def _bind_remote(self, planned: PlannedPatch) -> None:
        try:
            self._bind(planned, self._resolve_remote(planned))
        except KadaptError as exc:
            p = planned.patch
            self.ledger.record(p.id, "patch", p.target, p.kind, FAILED, exc.message, planned.location)
            raise KadaptError(
                f"patch {p.id}: {exc.message}", location=exc.location or planned.location
            ) from exc

    def _install(self, planned: PlannedPatch) -> None:
        p = planned.patch
        if planned.not_for_backend:
            reason = f"backends: {', '.join(p.backends)}"
            self.ledger.record(p.id, "patch", p.target, p.kind, NOT_FOR_BACKEND, reason, planned.location)
            return
        self.changes.extend(install() for install in planned.installers)
        self.ledger.record(p.id, "patch", p.target, p.kind, planned.status, planned.reason, planned.location)

    def _on_remote_module(self, module: ModuleType) -> None:
        """transformers (re)loaded remote code: patch any fresh class objects in that package."""
        package = module.__name__.rpartition(".")[0]
        with LOCK:
            for item in self._remote:
                target_module = sys.modules.get(f"{package}.{item.ref.module}")
                if target_module is None:
                    continue
                resolved = resolve_in(item.ref, target_module, must_exist=item.patch.kind != "set_attribute")
                if any(c.owner is resolved.owner and c.attr == item.ref.attr for c in self.changes):
                    continue
                fresh = PlannedPatch(item.patch, item.ref, item.impl, item.location)
                self._bind(fresh, resolved)
                self.changes.extend(install() for install in fresh.installers)

    def resolve_targets(self) -> dict[str, Resolved]:
        """Resolve every patch target (all backends) without pins or patching, then undo the shims.

        What ``kadapt pin`` needs: remote targets still require the shims and the config (which
        decides where the remote code lives), but drifted pins must not stop re-pinning.
        """
        with LOCK:
            return self._resolve_targets()

    def _resolve_targets(self) -> dict[str, Resolved]:
        shims = [self._plan_shim(shim) for shim in self.spec.environment]
        found: dict[str, Resolved] = {}
        try:
            for shim in shims:
                self._install_shim(shim)
            if any(p.is_remote for p in self.spec.patches):
                self._load_config()
            for patch in self.spec.patches:
                planned = PlannedPatch(patch, parse_target(patch.target), None, self.spec.locate(patch.where))
                must_exist = patch.kind != "set_attribute"
                found[patch.id] = (
                    self._resolve_remote(planned)
                    if planned.ref.remote
                    else resolve_in(planned.ref, import_module(planned.ref), must_exist=must_exist)
                )
        finally:
            self.revert()
        return found

    # -- reverting -------------------------------------------------------------------------------

    def revert(self) -> None:
        """Undo every change, newest first; keep going past failures and re-raise the first."""
        remote.remove_listener(self._on_remote_module)
        first: BaseException | None = None
        while self.changes:
            try:
                self.changes.pop().undo()
            except Exception as exc:  # noqa: BLE001 - restore the rest before reporting
                first = first or exc
        if first is not None:
            raise first


def open_session(spec: Spec, backend: str, **kwargs: Any) -> Session:
    """Apply ``spec``, or, if it is already applied (any thread), count a user and return a handle.

    Every session or handle returned must be passed to ``close_session`` exactly once (``applied``
    does that in ``finally``); the patches come off when the last one is closed.
    """
    with LOCK:
        outer = active_session(spec)
        if outer is not None:
            if outer.backend != backend:
                raise KadaptError(
                    f"spec {spec.name} is already applied for backend {outer.backend}, not {backend}"
                )
            outer.users += 1
            return _nested(outer)
        check_requirements(spec)  # the spec's own range first: its patches were written for it
        session = Session(spec, backend, **kwargs)
        session.apply()
        session.users = 1
        _active[spec_key(spec)] = session
        return session


def _nested(outer: Session) -> Session:
    nested = Session(outer.spec, outer.backend, trust_remote_code=outer.trust_remote_code)
    nested.nested = True
    nested.owner = outer
    nested.config, nested.source = outer.config, outer.source
    for entry in outer.ledger.entries:
        nested.ledger.record(entry.id, entry.section, entry.target, entry.kind, SKIPPED, "", entry.location)
    return nested


def close_session(session: Session) -> None:
    """Count one user of ``session``'s spec down; the last one out reverts every change."""
    with LOCK:
        if session.closed:
            return
        session.closed = True
        owner = session.owner or session
        owner.users -= 1
        if owner.users > 0:
            return
        try:
            owner.revert()
        finally:
            if _active.get(spec_key(owner.spec)) is owner:
                del _active[spec_key(owner.spec)]
