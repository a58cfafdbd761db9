"""Machine-readable output: ``{"valid": bool, "files": [{"path", "valid", "diagnostics"}]}``."""

from __future__ import annotations

import json
from collections.abc import Sequence

from .base import FileReport


class JsonReporter:
    def render(self, reports: Sequence[FileReport], strict: bool) -> str:
        files = [
            {
                "path": report.path,
                "valid": report.valid(strict),
                "diagnostics": [d.to_json() for d in report.diagnostics],
            }
            for report in reports
        ]
        return json.dumps({"valid": all(f["valid"] for f in files), "files": files}, indent=2)
