"""Expert feed-forward networks, sharded over the expert-parallel group: the batched FFN and user
expert modules (ffn.py), and the grouped matmul they run on (grouped.py)."""
