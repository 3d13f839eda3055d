"""Processes and their groups: start-up and meshes, collective timeouts, the flight recorder, and CPU ranks for tests and benchmarks."""
