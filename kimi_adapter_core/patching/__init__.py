"""Applying a spec's environment shims and class patches, gated per call, recorded in a ledger.

Modules: ``targets`` (parse/resolve), ``pins`` (drift), ``impls`` (builtin/dotted impls), ``kinds``
(patch behaviours), ``gate`` (claims and dispatchers), ``changes`` (undo), ``remote`` (remote code),
``ledger``, ``selection`` (backend filter), ``session`` (the apply/revert engine).
"""
