"""Proving the saved graphs equal transformers."""
