"""Benchmarks: the `schemoe bench` commands (cli.py), what they print (output.py), the report
that runs them all (regen.py). Their timer is `schemoe.dist.timing.measure`.

Every benchmark warms up, interleaves its candidates, reports median and p10/p90, prints only on
rank 0, and ends with one JSON line. See docs/testbed.md for running them on an emulated cluster.
"""
