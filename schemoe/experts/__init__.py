"""Expert feed-forward networks, sharded over the expert-parallel group (ffn.py)."""
