"""Conformance: vLLM's own scheduler tests, run with NeuronScheduler.

``plugin`` (a pytest plugin) builds our schedulers wherever the suite builds
one; ``models`` provides the model configs the suite names, offline;
``exclusions`` lists the tests that assert what the design forbids;
``runner`` runs the suite with both schedulers and compares.
"""
