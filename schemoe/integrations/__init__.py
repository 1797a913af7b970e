"""Bridges to other libraries' models: Hugging Face MoE blocks (hf.py)."""
