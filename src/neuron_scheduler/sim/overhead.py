"""Scheduler overhead: ``schedule()`` + ``update_from_output()`` of
``NeuronScheduler`` against the stock ``Scheduler``, in steady decode,
interleaved step by step so both see the same machine noise, in alternating
order (the second of a pair is measured a few percent slower)."""

from __future__ import annotations

import json
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from neuron_scheduler.offline.engine import (
    EngineSettings,
    build_scheduler,
    make_request,
    synthetic_model_output,
)
from neuron_scheduler.scheduler import NeuronScheduler

RUNNING_SIZES = (64, 256, 1024)
PROMPT_LEN = 16


def _steady_decode(
    cls: type[Scheduler], running: int
) -> tuple[Scheduler, dict[str, int]]:
    """A scheduler with ``running`` requests all past their prefill."""
    max_model_len = 1024
    settings = EngineSettings(
        max_num_seqs=running,
        max_num_batched_tokens=max(running, 2048),
        max_model_len=max_model_len,
        block_size=16,
        num_kv_blocks=running * (max_model_len // 16) + 1,
    )
    scheduler = build_scheduler(cls, settings)
    prompt_len_of = {}
    for i in range(running):
        request_id = f"r{i}"
        prompt_len_of[request_id] = PROMPT_LEN
        scheduler.add_request(
            make_request(
                request_id,
                [i % 250 + 1] * PROMPT_LEN,
                max_tokens=max_model_len - PROMPT_LEN - 1,
            )
        )
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)
        or scheduler.waiting
    ):
        output = scheduler.schedule()
        scheduler.update_from_output(
            output, synthetic_model_output(output, prompt_len_of)
        )
    return scheduler, prompt_len_of


def _time_step(scheduler: Scheduler, prompt_len_of: dict[str, int]) -> float:
    """Seconds spent in schedule() and update_from_output(); building the
    synthetic model output (the model runner's job) is not counted."""
    start = time.perf_counter()
    output = scheduler.schedule()
    scheduled = time.perf_counter()
    model_output = synthetic_model_output(output, prompt_len_of)
    applied_start = time.perf_counter()
    scheduler.update_from_output(output, model_output)
    return (scheduled - start) + (time.perf_counter() - applied_start)


def measure(running: int, steps: int) -> dict[str, float]:
    stock, stock_lens = _steady_decode(Scheduler, running)
    ours, our_lens = _steady_decode(NeuronScheduler, running)
    stock_times, our_times = [], []
    for step in range(steps):
        # Whichever runs second in a pair runs a few percent slower (caches
        # the first one warmed for itself are cold again): alternate.
        if step % 2:
            our_times.append(_time_step(ours, our_lens))
            stock_times.append(_time_step(stock, stock_lens))
        else:
            stock_times.append(_time_step(stock, stock_lens))
            our_times.append(_time_step(ours, our_lens))
    stock_times.sort()
    our_times.sort()
    # Medians resist the odd GC pause or scheduler hiccup on a shared machine.
    stock_median = stock_times[len(stock_times) // 2]
    our_median = our_times[len(our_times) // 2]
    return {
        "stock_ms": stock_median * 1e3,
        "neuron_ms": our_median * 1e3,
        "ratio": our_median / stock_median,
    }


def run_overhead(steps: int, json_path: str | None) -> int:
    """``bench --overhead``: ``steps`` timed per size, the table, and the
    figures as JSON if asked."""
    result: dict[str, Any] = {}
    print(f"{'running':>8} {'stock ms/step':>14} {'neuron ms/step':>15} {'ratio':>7}")
    for running in RUNNING_SIZES:
        figures = measure(running, steps)
        result[f"overhead_ratio_{running}"] = figures["ratio"]
        result[f"stock_ms_{running}"] = figures["stock_ms"]
        result[f"neuron_ms_{running}"] = figures["neuron_ms"]
        print(
            f"{running:>8} {figures['stock_ms']:>14.3f} {figures['neuron_ms']:>15.3f} "
            f"{figures['ratio']:>7.3f}"
        )
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0
