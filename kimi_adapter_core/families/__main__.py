"""``python -m kimi_adapter_core.families [MODEL_TYPE ...] [--write docs/families.md]``

Runs the family matrix (every decoder-only model type, or the ones named) on the installed
transformers, two trials at a time, and prints each row; ``--write`` writes the page (atomically), and
beside the census module the model types whose plan inventory departs (``plan_departures.json``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import sys
import time
import warnings
from pathlib import Path

from ..atomic import atomic_write_text
from ..backends.simulation.model.census import DEPARTURES
from .catalog import model_types
from .page import plan_departures, render
from .trial import PLAN_EXACT, Row, run_trial


def _trial(model_type: str) -> Row:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    return run_trial(model_type)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kimi_adapter_core.families", description=__doc__)
    parser.add_argument("model_types", nargs="*", help="only these (default: every decoder-only one)")
    parser.add_argument("--write", type=Path, help="write the page here (e.g. docs/families.md)")
    parser.add_argument("--jobs", type=int, default=2, help="trials at a time (separate processes)")
    args = parser.parse_args(argv)
    import transformers

    catalog = model_types()
    wanted = args.model_types or [m.name for m in catalog if m.excluded is None]
    rows = []
    start = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for row in pool.map(_trial, wanted):
            rows.append(row)
            print(f"{row.model_type:<28} {row.outcome:<8} {row.code:<16} {row.detail[:120]}", flush=True)
            if row.plan and row.plan != PLAN_EXACT:
                print(f"{'':<28} plan {row.plan}", flush=True)
    print(f"{len(rows)} model types in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.write:
        excluded = [m for m in catalog if m.excluded is not None]
        atomic_write_text(args.write, render(rows, excluded, transformers.__version__))
        departures = json.dumps(plan_departures(rows), indent=1, sort_keys=True) + "\n"
        atomic_write_text(DEPARTURES, departures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
