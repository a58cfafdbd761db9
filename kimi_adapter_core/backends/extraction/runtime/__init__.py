"""The runtime generated modules embed."""
