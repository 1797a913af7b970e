"""The tiny Hugging Face models the export and generation tests build (no downloads): every
converted family's (`schemoe.integrations.hf_tiny.tiny(family, std=0.5)`) where that module
exists, else tests/test_hf.py's Mixtral and Qwen2-MoE; fp32, eval mode, MoE weights N(0, 0.5)
(separated routing scores, O(1) experts). Needs transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
from torch import nn

pytest.importorskip("transformers")

try:  # every converted family
    from schemoe.integrations.hf_tiny import TINY, tiny

    BUILD: dict[str, Callable[[], nn.Module]] = {f: partial(tiny, f, 0.5) for f in TINY}
except ModuleNotFoundError as e:  # before hf_tiny exists: Mixtral and Qwen2-MoE
    if e.name != "schemoe.integrations.hf_tiny":
        raise
    from test_hf import MODELS as BUILD

__all__ = ["FAMILIES", "GENERATE", "build"]

FAMILIES = sorted(BUILD)
# Generation does not depend on the family: the two first converted, and the most involved.
GENERATE = [f for f in FAMILIES if f in ("mixtral", "qwen2_moe", "qwen2-moe", "deepseek_v3")]


def build(family: str) -> nn.Module:
    """The tiny model of `family`, in eval mode (the same weights on every call and rank)."""
    return BUILD[family]().eval()
