"""Deprecated path of ``kimi_adapter_core.backends.extraction.runtime.symbolic``.

Moved after kadapt 0.1.0; this alias goes in the next release.

The module itself stands in for this one, so every name, and a monkeypatch of one, is the moved
module's own.
"""

import sys
import warnings

from .runtime import symbolic as _moved

warnings.warn(
    f"{__name__} moved to {_moved.__name__}; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
