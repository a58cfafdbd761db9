"""Environment shims: symbols that model code imports but the installed libraries no longer ship."""

from __future__ import annotations

import importlib.util


def is_torch_fx_available() -> bool:
    """transformers 4.x's ``is_torch_fx_available`` (removed in 5.x), which remote code still imports.

    torch.fx ships with every torch transformers 5 supports, so this is True in practice; it still
    asks the import system rather than hard-coding the answer.
    """
    return importlib.util.find_spec("torch.fx") is not None
