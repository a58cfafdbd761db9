"""Measured tables."""
