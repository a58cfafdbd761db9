"""Building the IR."""
