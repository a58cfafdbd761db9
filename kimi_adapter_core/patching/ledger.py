"""The ledger: one row per spec entry saying what ``apply`` did with it and why.

A spec is only trustworthy if every entry is visibly accounted for: applied, deliberately not
applied (gated off, other backend, already applied) or failed with the reason. After a run,
``record_reach`` says how often each applied patch's behaviour ran: one that never ran had no
effect, and is ``not reached`` instead of ``applied``. The CLI prints it as a table or JSON; tests
read it to assert what happened.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

APPLIED = "applied"
GATED_OFF = "gated off"
NOT_FOR_BACKEND = "not for this backend"
SKIPPED = "skipped (already applied)"
FAILED = "failed"
NOT_REACHED = "not reached"  # installed, but no call of the run reached it
STATUSES = (APPLIED, NOT_REACHED, GATED_OFF, NOT_FOR_BACKEND, SKIPPED, FAILED)


@dataclass(frozen=True)
class LedgerEntry:
    id: str
    section: str  # environment | config_bridge | patch
    target: str
    kind: str
    status: str
    reason: str
    location: str | None = None  # "file:line:col" of the spec entry
    reached: int | None = None  # patches, after a run: calls (or reads) its behaviour served


@dataclass
class Ledger:
    """Entries in the order they were processed, for one ``applied`` session."""

    spec_name: str
    backend: str
    entries: list[LedgerEntry] = field(default_factory=list)

    def record(
        self,
        id: str,
        section: str,
        target: str,
        kind: str,
        status: str,
        reason: str = "",
        location: str | None = None,
    ) -> LedgerEntry:
        if status not in STATUSES:
            raise ValueError(f"unknown ledger status {status!r}")
        entry = LedgerEntry(id, section, target, kind, status, reason, location)
        self.entries.append(entry)
        return entry

    def status_of(self, entry_id: str) -> str:
        """Status of the last entry recorded with ``entry_id`` (KeyError if none)."""
        for entry in reversed(self.entries):
            if entry.id == entry_id:
                return entry.status
        raise KeyError(entry_id)

    def record_reach(self, reach: Mapping[str, int], run: str) -> list[LedgerEntry]:
        """After ``run`` (what was run, for the reason): each applied patch's reach; those that no call
        reached become ``not reached``. Returns them."""
        missed = []
        for index, entry in enumerate(self.entries):
            if entry.section != "patch" or entry.status != APPLIED or entry.id not in reach:
                continue
            count = reach[entry.id]
            if count:
                self.entries[index] = replace(entry, reached=count)
                continue
            reason = f"installed, but no call during {run} reached it for a module of this model"
            self.entries[index] = replace(entry, status=NOT_REACHED, reason=reason, reached=0)
            missed.append(self.entries[index])
        return missed

    def counts(self) -> dict[str, int]:
        return {status: sum(e.status == status for e in self.entries) for status in STATUSES}

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec_name,
            "backend": self.backend,
            "counts": self.counts(),
            "entries": [asdict(e) for e in self.entries],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def render_table(self) -> str:
        """Fixed-width text table; the reason column is left unwrapped so it can be grepped."""
        headers = ("id", "section", "kind", "status", "target", "reason")
        rows = [(e.id, e.section, e.kind, e.status, e.target, e.reason) for e in self.entries]
        widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers[:-1])]

        def line(cells: tuple[str, ...]) -> str:
            fixed = "  ".join(c.ljust(w) for c, w in zip(cells[:-1], widths, strict=True))
            return f"{fixed}  {cells[-1]}".rstrip()

        counts = ", ".join(f"{n} {status}" for status, n in self.counts().items() if n)
        out = [f"spec {self.spec_name} (backend {self.backend}): {counts or 'no entries'}", line(headers)]
        out.append(line(tuple("-" * len(h) for h in headers)))
        out.extend(line(r) for r in rows)
        return "\n".join(out)
