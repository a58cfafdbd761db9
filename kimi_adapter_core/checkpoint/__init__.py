"""What a checkpoint holds and how a graph weight is built from it."""
