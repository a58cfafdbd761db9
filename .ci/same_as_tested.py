"""Exit 0 when this interpreter's installed packages are the tested set (constraints.txt) exactly.

`.ci/compat newest` installs without constraints, as a fresh `pip install` would. When that resolves
to exactly the versions in constraints.txt (local labels such as `+cpu` aside), `.ci/run`'s full
suite has just tested this very set and the compat subset would rerun it: the script says so and
exits 0. Any difference is printed and exits 1, and the subset runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable


def pins(lines: Iterable[str]) -> dict[str, str]:
    """``name==version`` lines as {normalized name: version without a local label}."""
    found = {}
    for line in lines:
        name, sep, version = line.strip().partition("==")
        if sep and not name.startswith("#"):
            found[re.sub(r"[-_.]+", "-", name).lower()] = version.split("+")[0]
    return found


def main(constraints: str) -> int:
    with open(constraints, encoding="utf-8") as handle:
        tested = pins(handle)
    freeze = [sys.executable, "-m", "pip", "freeze", "--exclude-editable"]
    frozen = subprocess.run(freeze, capture_output=True, text=True, check=True)
    installed = pins(frozen.stdout.splitlines())
    moved = sorted(f"{n} {v} (tested {tested.get(n)})" for n, v in installed.items() if tested.get(n) != v)
    if moved:
        print(f"== compat newest differs from {constraints}: {', '.join(moved)}")
        return 1
    print(
        f"== compat newest: the unconstrained install is {constraints}'s set exactly "
        "(the set .ci/run's full suite tests): the subset is not rerun"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
