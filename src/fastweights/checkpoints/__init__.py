"""Run directories and checkpoints: the on-disk format, loading, config checks."""
