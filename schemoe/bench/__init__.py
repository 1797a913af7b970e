"""Benchmarks: one shared timer (`timer`) and the `schemoe bench` commands (`cli`).

Every benchmark warms up, interleaves its candidates, reports median and p10/p90, prints only on
rank 0, and ends with one JSON line. See docs/testbed.md for running them on an emulated cluster.
"""

from .timer import Stats, measure, report

__all__ = ["Stats", "measure", "report"]
