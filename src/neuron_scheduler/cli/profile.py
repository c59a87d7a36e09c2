"""``neuron-scheduler profile``: argument parsing and the summary printed."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from neuron_scheduler.cli.options import (
    add_engine_spec_arguments,
    output_file,
    positive_seconds,
)
from neuron_scheduler.offline.engine_spec import CPU_STATIC_WORKER
from neuron_scheduler.offline.step_profile import Profile
from neuron_scheduler.step import StepKind


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from neuron_scheduler.offline.tinymodel import TINY_ENGINE_ARGS

    engine = TINY_ENGINE_ARGS
    add_engine_spec_arguments(
        parser,
        engine,
        "model directory (default: the demo's tiny Llama, made locally)",
        "the neuron_config whose shapes to profile",
    )
    parser.add_argument(
        "--dtype", default=engine["dtype"], help="model dtype (default: %(default)s)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (enforce_eager=False; default: eager)",
    )
    parser.add_argument(
        "--worker-cls",
        default=None,
        help=f"vLLM worker class (default: {CPU_STATIC_WORKER} on the CPU "
        "platform, vLLM's own elsewhere)",
    )
    parser.add_argument(
        "--decode-context",
        choices=["bucket", "actual"],
        default=None,
        help="decode steps cost by their context bucket (a graph reads it "
        "whole) or by their actual context (an attention kernel that is not "
        "padded); default: actual with the CPU static-shape worker, else bucket",
    )
    parser.add_argument(
        "--prefill-fill",
        choices=["bucket", "actual"],
        default=None,
        help="prefill steps cost by their token bucket alone (a graph runs it "
        "whole) or also by their real tokens (an attention kernel that is not "
        "padded: each bucket is then also timed with the fewest real tokens it "
        "holds); default: actual with the CPU static-shape worker, else bucket",
    )
    parser.add_argument(
        "--repetitions",
        type=int,
        default=5,
        help="steps timed per shape: the prefill shapes in as many rounds, "
        "each decode batch for as many steps (default: %(default)s)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="refuse a configuration whose profile would take longer, saying "
        "how long (default: no limit)",
    )
    parser.add_argument(
        "--fit-seconds",
        type=positive_seconds,
        default=None,
        help="time each shape fewer times than --repetitions (down to 3) "
        "where the profile would take longer, by its costliest step as "
        "measured first (default: --repetitions always)",
    )
    parser.add_argument(
        "--output",
        default="profile.json",
        type=output_file,
        help="where to write the profile (default: %(default)s)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (default: shown)"
    )


def default_worker() -> str | None:
    from vllm.platforms import current_platform

    return CPU_STATIC_WORKER if current_platform.is_cpu() else None


def run(args: argparse.Namespace) -> int:
    from neuron_scheduler.offline.engine_spec import EngineSpec
    from neuron_scheduler.offline.profiler import run_profile
    from neuron_scheduler.offline.tinymodel import make_tiny_llama

    neuron_config = args.neuron_config
    model = args.model or str(
        make_tiny_llama(Path(tempfile.gettempdir()) / "neuron-scheduler-tiny-llama")
    )
    spec = EngineSpec(
        model=model,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        dtype=args.dtype,
        enforce_eager=not args.compile,
        block_size=args.block_size,
        worker_cls=args.worker_cls or default_worker(),
        neuron_config=neuron_config,
    )
    spec.resolved_config()  # bad options fail before the engine starts
    profile = run_profile(
        spec,
        repetitions=args.repetitions,
        decode_context=args.decode_context,
        prefill_fill=args.prefill_fill,
        max_seconds=args.max_seconds,
        fit_seconds=args.fit_seconds,
        progress=not args.no_progress,
    )
    profile.save(args.output)
    print(format_profile(profile))
    print(f"profile written to {args.output}", file=sys.stderr)
    return 0


def format_profile(profile: Profile) -> str:
    """One line per shape: median and 10th-90th percentile, milliseconds."""
    lines = [
        f"{profile.model.get('name')} on {profile.platform.get('name')} "
        f"({_processor(profile.platform)}), vLLM "
        f"{profile.platform.get('vllm_version')}; KV "
        f"{profile.kv_cache['num_blocks']} blocks of {profile.kv_cache['block_size']}; "
        f"{profile.meta.get('engine_steps')} steps in {profile.meta.get('seconds')} s, "
        f"each shape timed {profile.meta.get('repetitions')} times",
        f"{'shape':<34}{'samples':>8}{'median ms':>11}{'p10-p90 ms':>17}",
    ]
    for timing in profile.timings:
        if timing.kind is StepKind.PREFILL:
            real = f" ({timing.fill} real)" if timing.fill < timing.tokens else ""
            name = f"prefill {timing.tokens} tokens{real} after {timing.context}"
        else:
            name = f"decode {timing.rows} rows at context {timing.context}"
        low, high = timing.spread
        lines.append(
            f"{name:<34}{len(timing.samples_s):>8}{timing.median_s * 1e3:>11.2f}"
            f"{f'{low * 1e3:.2f}-{high * 1e3:.2f}':>17}"
        )
    drift = profile.meta.get("drift")
    if drift:
        lines.append(
            f"the machine's speed: {drift['reference']}, timed after each of "
            f"{len(drift['seconds'])} blocks, ran {drift['fastest_x']:.2f}-"
            f"{drift['slowest_x']:.2f}x its median "
            f"({drift['typical_s'] * 1e3:.2f} ms); every sample is scaled to "
            f"that median {drift['weight']:.0%} of the way (the rest: the "
            "reference's own jitter)"
        )
    if profile.compile_seconds:
        total = sum(profile.compile_seconds.values())
        lines.append(
            f"compile/first-run seconds: {total:.1f} ({profile.compile_seconds})"
        )
    return "\n".join(lines)


def _processor(platform: Mapping[str, Any]) -> str:
    """The processor, with the CPU kernels torch ran where recorded."""
    capability = platform.get("cpu_capability")
    suffix = f", {capability} kernels" if capability else ""
    return f"{platform.get('processor')}{suffix}"
