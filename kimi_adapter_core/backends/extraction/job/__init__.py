"""Running one extraction."""
