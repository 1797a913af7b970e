"""Distributed plumbing every tier stands on: the process topology and its groups, devices, the
links a run talks over, process launch and shutdown, peer-failure detection and the timer."""
