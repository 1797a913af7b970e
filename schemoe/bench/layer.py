"""One MoE layer forward+backward per step (placeholder until schemoe.layer lands)."""

import argparse

__all__ = ["add_arguments", "validate", "bench"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def validate(args: argparse.Namespace) -> None:
    raise ValueError("schemoe bench layer needs schemoe.layer")


def bench(args, env) -> None:
    raise NotImplementedError
