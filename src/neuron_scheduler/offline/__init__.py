"""Offline tooling: vLLM without an accelerator.

The model-less engine (``engine``: a real scheduler stepped on synthetic
model outputs), the simulated KV connector, the tiny local models, the local
OpenAI server and the step-time profiler. Nothing here is loaded by vLLM
when it serves with the plugin.
"""
