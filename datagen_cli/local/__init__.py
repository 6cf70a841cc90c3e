"""Processes on this machine for the demo, the tests and the benchmarks: child processes with
their logs, and a private Redis server."""
