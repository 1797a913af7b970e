"""Sharded, atomic, digest-checked checkpoints (store.py) over safe file writes (files.py)."""
