"""The family matrix: every decoder-only causal-LM model type of the installed transformers, adapted
and proven or refused with a documented reason.

- ``catalog``: which model types count (decoder-only ``*ForCausalLM`` entries of transformers' auto
  mapping), and why the others do not.
- ``tiny``: a small config of a model type from transformers' own defaults.
- ``trial``: one model type through ``validate --resolve``, ``apply`` and ``--verify`` with the spec a
  user would write from ``docs/writing-a-spec.md``, classified as adapted, refused (a code of
  ``errors.REFUSALS``) or failed.
- ``page``: ``docs/families.md``, the table those rows make (``python -m kimi_adapter_core.families``
  writes it; ``tests/test_family_matrix.py`` fails when a row regresses).
"""
