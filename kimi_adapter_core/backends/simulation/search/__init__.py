"""Searching deployments."""
