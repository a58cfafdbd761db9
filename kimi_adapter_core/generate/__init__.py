"""``kadapt generate``: render a spec into adapter modules and docs through ``templates/``.

``plan.render_spec`` renders to memory (formatted, compiled), ``output`` writes or checks. Targets:
``extraction`` (standalone model + ABI wrappers), ``simulation`` (TensorCast profile), ``docs``.
"""

from .common import NotExpressible, Rendered
from .output import Drift, check_all, write_all
from .plan import ALL, TARGETS, expand_targets, render_spec

__all__ = [
    "ALL",
    "TARGETS",
    "Drift",
    "NotExpressible",
    "Rendered",
    "check_all",
    "expand_targets",
    "render_spec",
    "write_all",
]
