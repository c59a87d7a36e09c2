"""The simulator: the real schedulers on a virtual clock.

A library (no argparse below ``neuron_scheduler.cli``): workloads, cost
models, engine and fleet stepping, run results, the bucket tuner, the
capacity planner and the check against a real server.
"""
