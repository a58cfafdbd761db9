"""The adapter-spec language: YAML loading with positions, JSON Schema, typed model, checks."""

from .loader import load_spec, resolve_spec_path, shipped_spec_names
from .model import Spec

__all__ = ["Spec", "load_spec", "resolve_spec_path", "shipped_spec_names"]
