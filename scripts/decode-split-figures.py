"""The decode-split figures of docs/options.md.

For each workload (300 requests, all at once; trn2 x TP4, Llama-3.1-8B,
max_model_len 131072, max_num_seqs 32): buckets tuned robustly on it with
the combined options, then simulated without and with
``decode_split_break_even_positions`` (the cost model's break-even, what
``tune --split-decodes`` adds). Workloads: the built-in one (seed 7), the
same with one request in 20 (and in 50) a 40,000-token document, and the
first 300 requests of each trace in ../shared/traces (skipped if absent).

Usage: .venv/bin/python scripts/decode-split-figures.py
"""

import dataclasses
from pathlib import Path

from neuron_scheduler.scheduler import NeuronScheduler
from neuron_scheduler.sim.decode_split import SPLIT_KEY, break_even_positions
from neuron_scheduler.sim.policies import Policy
from neuron_scheduler.sim.results import compute_metrics
from neuron_scheduler.sim.run_setup import EngineChoice, engine_setup
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.tuning import TuneOptions, check_tune_options, tune
from neuron_scheduler.sim.workload import WorkloadOptions, build_workload

COMBINED = {
    "kv_admission": "reserve",
    "max_prefills_per_batch": 8,
    "max_consecutive_prefill_steps": 1,
    "max_prefill_tokens_with_decodes_waiting": 1024,
}
TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
COST, SETTINGS = engine_setup(EngineChoice(max_model_len=131072, max_num_seqs=32))


def workloads():
    options = WorkloadOptions(num_requests=300, seed=7, request_rate=float("inf"))
    built_in = build_workload(options, SETTINGS.max_model_len)[0]
    yield "built-in (seed 7)", built_in
    for every in (50, 20):
        yield (
            f"built-in, 1 in {every} at 40k",
            [
                dataclasses.replace(s, input_len=40_000) if i % every == 0 else s
                for i, s in enumerate(built_in)
            ],
        )
    for name in (
        "azure2023_AzureLLMInferenceTrace_conv.csv",
        "azure2023_AzureLLMInferenceTrace_code.csv",
        "mooncake_fast25_synthetic_trace.jsonl",
    ):
        if (TRACES / name).exists():
            trace = WorkloadOptions(
                trace=str(TRACES / name), num_requests=300, request_rate=float("inf")
            )
            yield name.split("_")[-1], build_workload(trace, SETTINGS.max_model_len)[0]


def main():
    break_even = break_even_positions(COST, SETTINGS)
    print(f"break-even: {break_even} KV positions ({COST.describe()})")
    setup = check_tune_options(TuneOptions(base=COMBINED), SETTINGS, COST)
    for name, specs in workloads():
        tuned = tune(setup, specs, SETTINGS, COST).neuron_config
        plain, split = (
            compute_metrics(
                simulate(specs, Policy(label, NeuronScheduler, c), SETTINGS, COST)
            )
            for label, c in (
                ("plain", tuned),
                ("split", {**tuned, SPLIT_KEY: break_even}),
            )
        )
        print(
            f"{name}: {plain['output_throughput']:.1f} -> "
            f"{split['output_throughput']:.1f} output tok/s "
            f"({split['output_throughput'] / plain['output_throughput']:.3f}x), "
            f"mean TPOT {plain['mean_tpot_ms']:.1f} -> {split['mean_tpot_ms']:.1f} ms, "
            f"p99 TPOT {plain['p99_tpot_ms']:.1f} -> {split['p99_tpot_ms']:.1f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
