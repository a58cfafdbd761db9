"""The adapter-spec language: YAML loading with positions, JSON Schema, typed model, checks."""

from .loader import load_spec
from .model import Spec

__all__ = ["Spec", "load_spec"]
