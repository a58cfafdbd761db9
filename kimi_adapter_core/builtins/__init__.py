"""Library of built-in patch implementations, named in specs as ``builtin:<name>``.

The catalogue in ``registry`` is plain strings so that ``kadapt validate`` can check names
without importing torch; ``resolve`` imports an implementation only when a spec is applied.
"""

from .registry import BUILTINS, resolve

__all__ = ["BUILTINS", "resolve"]
