"""The robust-tuning figures of docs/options.md.

Buckets tuned on the built-in workload's 200-request sample (seed 0),
applied to fresh samples of the same source (seeds 7, 11, 23, 42; all at
once, trn2 x TP4, Llama-3.1-8B, max_model_len 131072, max_num_seqs 32),
each against that sample's own sample-exact optimum: robust, sample-exact
and power-of-two context buckets. OPTIONS=default: the design's options;
otherwise the combined options.

Usage: [OPTIONS=default] .venv/bin/python scripts/robust-tuning-figures.py
"""

import os

from neuron_scheduler.scheduler import NeuronScheduler
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
BASE = {} if os.environ.get("OPTIONS") == "default" else COMBINED
POWERS_OF_TWO = [1024 << k for k in range(8)]  # 1024 ... 131072
FRESH = [(300, 7), (200, 11), (200, 23), (200, 42)]
COST, SETTINGS = engine_setup(EngineChoice(max_model_len=131072, max_num_seqs=32))


def workload(n, seed):
    options = WorkloadOptions(num_requests=n, seed=seed, request_rate=float("inf"))
    return build_workload(options, SETTINGS.max_model_len)[0]


def tuned(specs, robust):
    setup = check_tune_options(TuneOptions(base=BASE, robust=robust), SETTINGS, COST)
    return tune(setup, specs, SETTINGS, COST).neuron_config


def throughput(specs, config):
    run = simulate(specs, Policy("x", NeuronScheduler, config), SETTINGS, COST)
    return compute_metrics(run)["output_throughput"]


def main():
    train = workload(200, 0)
    robust, exact = tuned(train, True), tuned(train, False)
    powers = {**BASE, "decode_context_length_buckets": POWERS_OF_TWO}
    for n, seed in FRESH:
        specs = workload(n, seed)
        own = throughput(specs, tuned(specs, False))
        ratios = [throughput(specs, c) / own for c in (robust, exact, powers)]
        print(
            f"seed {seed} ({n} requests): robust {ratios[0]:.3f}, sample-exact "
            f"{ratios[1]:.3f}, powers of two {ratios[2]:.3f} of its own optimum",
            flush=True,
        )


if __name__ == "__main__":
    main()
