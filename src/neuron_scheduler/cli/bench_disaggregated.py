"""``neuron-scheduler bench --disaggregated xPyD``: a workload through x
prefill and y decode engines joined by KV transfers, printed as ``bench``
prints a run, with each pool's figures."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from neuron_scheduler.cli.options import (
    disaggregation_options,
    engine_choice,
    workload_options,
)
from neuron_scheduler.sim.disaggregated import build_pools, simulate_disaggregated
from neuron_scheduler.sim.disaggregated_metrics import disaggregated_metrics
from neuron_scheduler.sim.report import format_table
from neuron_scheduler.sim.routing import RouterKind
from neuron_scheduler.sim.run_setup import describe_setup
from neuron_scheduler.sim.slo import parse_goodput
from neuron_scheduler.sim.workload import build_workload


def run_disaggregated(args: argparse.Namespace) -> int:
    options = disaggregation_options(args)
    prefill, decode = build_pools(options, engine_choice(args))
    goodput = parse_goodput(args.goodput)
    workload = workload_options(args)
    specs, fit = build_workload(workload, prefill.settings.max_model_len)
    for pool in (prefill, decode):
        line = describe_setup(workload.name, pool.cost, pool.settings, len(specs), fit)
        print(f"{pool.role} x{pool.engines}: {line}", file=sys.stderr)
    print(options.transfer.describe(), file=sys.stderr)
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(specs), desc="simulating", unit="req")
    run = simulate_disaggregated(
        specs,
        prefill,
        decode,
        options.transfer,
        router=RouterKind(args.router),
        max_concurrency=args.max_concurrency,
        on_finish=(lambda _i: progress.update(1)) if progress is not None else None,
    )
    if progress is not None:
        progress.close()
    metrics = disaggregated_metrics(run, goodput, args.metric_percentiles)
    for pool in (prefill, decode):
        metrics["disaggregated"][pool.role]["neuron_config"] = pool.policy.neuron_config
        metrics["disaggregated"][pool.role]["cost_model"] = pool.cost.describe()
    if args.save_detailed:
        metrics["requests"] = [asdict(r) for r in run.decode.records]
        metrics["handoffs"] = [asdict(h) for h in run.handoffs]
    print(format_table([metrics]))
    if args.json_path:
        settings = {
            "workload": workload.name,
            "num_requests": len(specs),
            "max_concurrency": args.max_concurrency,
            "router": args.router,
            "fit_to_model_len": asdict(fit),
            "prefill": {
                **asdict(prefill.settings),
                "cost_model": prefill.cost.describe(),
            },
            "decode": {**asdict(decode.settings), "cost_model": decode.cost.describe()},
        }
        with open(args.json_path, "w") as handle:
            json.dump({"settings": settings, "runs": [metrics]}, handle, indent=2)
    return 0
