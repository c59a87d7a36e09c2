"""``neuron-scheduler profile``: measure the engine steps a configuration can
produce, on the engine it is given.

It starts a vLLM engine in-process (``NeuronScheduler``, and on the CPU
platform ``StaticShapeWorker``; any ``--worker-cls`` elsewhere), feeds it
requests built to produce each shape, and times whole engine-core steps
(schedule, forward, sample, update: vLLM's ``EngineCore.step``), not the
forward alone. Shapes:

* every prefill token bucket, one prompt per step, at a few contexts-before
  (0, and chunks of long prompts after about half and all of
  ``max_model_len``): what chunked prefills and prefix-cache hits cost (the
  contexts are one shared token sequence, computed once and then found in
  the prefix cache, where a context is whole KV blocks); at
  context 0 also with the fewest real tokens the bucket holds (one more than
  the bucket below) where ``prefill_fill="actual"``: an engine whose
  attention runs the real tokens only (as on CPU) costs less for a prompt
  that fills its bucket less, and a served workload's prompts rarely fill
  theirs;
* every decode batch bucket with all its rows real, at every context bucket
  (``decode_context="bucket"``: a graph reads its whole bucket), or at a few
  actual contexts spread over ``max_model_len``
  (``decode_context="actual"``: an attention kernel that reads each
  sequence's own context, as on CPU). One set of prompts per context serves
  every batch bucket: the largest batch decodes first, then rows finish
  down to each smaller bucket in turn (distinct prompts: rows that shared
  KV blocks would read less memory than served rows do).

The prefill shapes are timed in rounds, each shape once a round, and each
decode context in a block of its own; after every round and block one small
reference step is timed (``offline.drift``), and every sample is scaled
toward the reference's median speed by the reference's speed at the moment
it was taken (as far as the references moved more than their own jitter):
a machine that runs 10-30% slower in one ten seconds than in the next (a
shared CPU) would otherwise charge one context's decode steps the speed of
a slow moment and the next context's that of a fast one. The times as
measured are kept (``StepTiming.measured_s``).

Every step is attributed to its shape by the scheduler's own ``StepRecord``;
all steps observed are kept (a chunked prompt's earlier chunks add samples
of the largest bucket), and a prefill's context is the one the scheduler
scheduled it after (``step.computed_before``). For the measurement run
admission uses ``kv_admission="reserve"`` with one prompt per step and no
stall bound, so that each decode bucket can be filled: admission does not
change what a shape costs. The result is a ``sim.profile_cost.Profile``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform as platform_module
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_scheduler.config import EngineLimits, NeuronConfig
from neuron_scheduler.offline.cpu_binding import keep_off_worker_cores
from neuron_scheduler.offline.drift import DriftReference
from neuron_scheduler.offline.engine_spec import EngineSpec, server_executor
from neuron_scheduler.offline.ipc_directory import use_process_ipc_directory
from neuron_scheduler.offline.step_profile import Profile, StepTiming
from neuron_scheduler.step import StepKind, computed_before

#: The fewest times ``fit_seconds`` lets a shape be timed: a median of
#: three, robust to one slow step.
FEWEST_REPETITIONS = 3

#: Decode steps the drift reference runs after each block of the plan; its
#: time is their median less the first (which runs a few percent slower,
#: right after its prefill).
REFERENCE_DECODES = 10

#: The drift reference's prompt: short, so that a reference costs about a
#: tenth of a second.
REFERENCE_PROMPT = 120


class ProfileError(ValueError):
    """The configuration cannot be profiled as asked."""


@dataclass(frozen=True)
class Scenario:
    """Requests run together to produce a shape: prompt lengths, the tokens
    each generates, and how many leading tokens of every prompt are the
    profile's shared context (``shared_tokens``), of which
    ``cached_tokens`` are expected in the prefix cache already."""

    label: str
    prompt_lens: tuple[int, ...]
    max_tokens: tuple[int, ...]
    shared_tokens: int = 0
    cached_tokens: int = 0

    def steps(self, chunk: int) -> int:
        """Engine steps it takes with one prompt per step, ``chunk`` tokens
        per prefill step, and the rows decoding together."""
        prefill = sum(-(-(n - self.cached_tokens) // chunk) for n in self.prompt_lens)
        return prefill + max(self.max_tokens) - 1


@dataclass(frozen=True)
class ProfileModes:
    """What the engine's step time depends on besides its padded shape:
    a decode's context as its ``"bucket"`` or its ``"actual"`` value, and a
    prefill's real tokens (``"actual"``) or only its bucket
    (``"bucket"``)."""

    decode_context: str
    prefill_fill: str


def decode_contexts(config: NeuronConfig, decode_context: str) -> list[int]:
    """The decode contexts to sample: every context bucket, or a few actual
    contexts up to the largest, from a short one (128: a chat's first
    turns; below the lowest sample a step is charged as at it)."""
    if decode_context == "bucket":
        return list(config.decode_context_length_buckets)
    top = config.decode_context_length_buckets[-1]
    return sorted({min(128, top), max(64, top // 8), top // 4, top // 2, top})


def least_fills(config: NeuronConfig) -> dict[int, int]:
    """Per token bucket, the fewest real tokens a prompt padded to it has:
    one more than the bucket below (2 for the smallest: a prompt of one
    token runs as a decode row)."""
    buckets = config.num_batched_tokens_buckets
    return {
        b: max(below + 1, 2) for below, b in zip((0, *buckets), buckets, strict=False)
    }


@dataclass(frozen=True)
class ProfilePlan:
    """What a profile runs, block by block, with the drift reference
    (``reference``) timed after each block: every prefill shape once a
    round for ``rounds`` rounds (a slow moment of the machine then falls
    on every shape alike, not on one shape's repetitions), the shared
    context (``shared``) first; then one block per decode context (its
    rows' prefills cost too much to repeat). ``unreachable``: the decode
    batches that do not fit the KV cache."""

    prefill: tuple[Scenario, ...]
    rounds: int
    decode: tuple[Scenario, ...]
    reference: Scenario
    shared: Scenario | None = None
    unreachable: tuple[str, ...] = ()

    def blocks(self) -> list[tuple[Scenario, ...]]:
        """The blocks in the order they run."""
        first = (self.shared, *self.prefill) if self.shared else self.prefill
        rounds = [first] + [self.prefill] * (self.rounds - 1)
        return [*rounds, *((scenario,) for scenario in self.decode)]

    def scenarios(self) -> list[Scenario]:
        """Every scenario in the order it runs, the reference after each
        block."""
        return [s for block in self.blocks() for s in (*block, self.reference)]

    def steps(self, chunk: int) -> int:
        """Engine steps of the whole plan (``chunk``: tokens a prefill step
        takes at most)."""
        return sum(s.steps(chunk) for s in self.scenarios())


def reference_scenario(max_model_len: int) -> Scenario:
    """The drift reference: one short prompt (a prefill step) and then
    ``REFERENCE_DECODES`` decode steps of its one row."""
    prompt = max(1, min(REFERENCE_PROMPT, max_model_len - REFERENCE_DECODES - 2))
    return Scenario(
        f"drift reference: decode 1 row after a {prompt}-token prompt",
        (prompt,),
        (1 + REFERENCE_DECODES,),
    )


def plan_profile(
    config: NeuronConfig,
    limits: EngineLimits,
    modes: ProfileModes,
    rounds: int,
    kv_tokens: int,
    block_size: int,
) -> ProfilePlan:
    """The plan producing every shape ``config`` can produce, each timed
    ``rounds`` times (a decode batch at least that many steps), less the
    decode batches whose ``rows`` requests at their context do not fit
    ``kv_tokens`` of KV cache together. A prefill context of whole
    ``block_size`` blocks is shared (computed once, first)."""
    shared, prefill = _prefill_scenarios(config, limits, modes, block_size)
    decode, unreachable = [], []
    for context in decode_contexts(config, modes.decode_context):
        batches = []
        for rows in config.num_seqs_buckets:
            if rows * context > kv_tokens:
                unreachable.append(f"decode {rows} rows at {context}")
            else:
                batches.append(rows)
        if batches:
            decode.append(decode_scenario(context, batches, rounds))
    return ProfilePlan(
        prefill=tuple(prefill),
        rounds=rounds,
        decode=tuple(decode),
        reference=reference_scenario(limits.max_model_len),
        shared=shared,
        unreachable=tuple(unreachable),
    )


def _prefill_scenarios(
    config: NeuronConfig,
    limits: EngineLimits,
    modes: ProfileModes,
    block_size: int,
) -> tuple[Scenario | None, list[Scenario]]:
    """Every prefill bucket at context 0 (also with its least fill) and
    after chunks of a long prompt, once each; and the shared context they
    are computed after (``None`` where none is whole blocks)."""
    chunk = limits.max_prefill_tokens
    last = limits.max_model_len - 1  # room for one generated token
    scenarios = []
    fills = least_fills(config) if modes.prefill_fill == "actual" else {}
    for tokens in config.num_batched_tokens_buckets:
        least = fills.get(tokens, tokens)
        if least < min(tokens, last):
            label = f"prefill {tokens} with {least} real"
            scenarios.append(Scenario(label, (least,), (1,)))
        # Context-before samples: multiples of the chunk (a long prompt's
        # chunks run one bucket at a time), at 0, about half, and the most.
        most = max(0, (last - tokens) // chunk * chunk)
        contexts = sorted({0, most // 2 // chunk * chunk, most})
        for context in contexts:
            # A bucket of max_model_len tokens (a prefill engine that never
            # chunks) runs its largest prompt, one token short, padded to it.
            prompt = min(context + tokens, last)
            shared = context if context % block_size == 0 else 0
            scenarios.append(
                Scenario(
                    f"prefill {tokens} after {context}", (prompt,), (1,), shared, shared
                )
            )
    widest = max(s.shared_tokens for s in scenarios)
    # Computes the shared context once: every later one is a prefix of it.
    first = (
        Scenario(f"shared context {widest}", (widest + 1,), (1,), widest)
        if widest
        else None
    )
    return first, scenarios


def decode_scenario(context: int, batches: list[int], repetitions: int) -> Scenario:
    """Rows for the largest of ``batches`` at ``context``: each batch size,
    largest first, decodes ``repetitions`` steps with every row real, then
    the rows the next smaller one does not hold finish together."""
    batches = sorted(batches)
    # Row i decodes through every phase whose batch holds more than i rows.
    max_tokens = tuple(
        1 + repetitions * sum(1 for rows in batches if rows > i)
        for i in range(batches[-1])
    )
    # Prompts just under the context, so that every decode step stays
    # within it.
    prompt = max(1, context - repetitions * len(batches) - 2)
    sizes = "/".join(str(rows) for rows in reversed(batches))
    return Scenario(
        f"decode {sizes} rows at {context}", (prompt,) * batches[-1], max_tokens
    )


#: A shape key: (PREFILL, padded tokens, context before, real tokens) or
#: (DECODE, padded rows, context, 0).
ShapeKey = tuple[StepKind, int, int, int]


@dataclass
class StepSamples:
    """Wall seconds of the steps observed, by ``ShapeKey``, and when each
    ended (``at``: seconds since the timer began)."""

    seconds: dict[ShapeKey, list[float]] = field(
        default_factory=lambda: defaultdict(list)
    )
    at: dict[ShapeKey, list[float]] = field(default_factory=lambda: defaultdict(list))

    def add(self, key: ShapeKey, seconds: float, at: float) -> None:
        self.seconds[key].append(seconds)
        self.at[key].append(at)

    def timings(self, drift: DriftReference | None = None) -> tuple[StepTiming, ...]:
        """One ``StepTiming`` a shape; with ``drift``, its samples scaled to
        the reference's typical speed (the times as measured kept)."""
        result = []

        def key(item: tuple[ShapeKey, list[float]]) -> tuple:
            (kind, size, context, actual), _ = item
            return kind.value, size, context, actual  # decode first, then prefill

        for shape, measured in sorted(self.seconds.items(), key=key):
            kind, size, context, actual = shape
            rows = size if kind is StepKind.DECODE else 0
            samples: tuple[float, ...] = tuple(measured)
            raw: tuple[float, ...] = ()
            if drift is not None:
                samples = tuple(
                    s * drift.factor(a)
                    for s, a in zip(measured, self.at[shape], strict=True)
                )
                raw = tuple(measured)
            result.append(
                StepTiming(kind, size, context, samples, rows, actual, measured_s=raw)
            )
        return tuple(result)


class StepTimer:
    """Times every ``EngineCore.step`` of an in-process engine and files it
    under the shape the scheduler reports for it, or, while
    ``reference_time`` runs the drift reference, apart."""

    def __init__(
        self, llm: Any, decode_context: str, planned_contexts: list[int]
    ) -> None:
        core = llm.llm_engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.samples = StepSamples()
        self.decode_context = decode_context
        #: Decode contexts the plan aims at: an ``actual`` context (it grows
        #: a token per step) is filed under the nearest.
        self.planned_contexts = planned_contexts
        self.steps = 0
        self.on_step: Callable[[], None] | None = None
        #: The scheduler's output of the step being timed.
        self.output: Any = None
        #: The drift reference's decode step times while it runs.
        self._reference: list[float] | None = None
        self.began = time.perf_counter()
        step, schedule = core.step_fn, self.scheduler.schedule

        def timed() -> Any:
            started = time.perf_counter()
            result = step()
            ended = time.perf_counter()
            self._record(ended - started, ended - self.began)
            return result

        def scheduling(*args: Any, **kwargs: Any) -> Any:
            # Whatever arguments this vLLM's engine core passes.
            self.output = schedule(*args, **kwargs)
            return self.output

        core.step_fn = timed
        self.scheduler.schedule = scheduling

    def reference_time(
        self, run: Callable[[Scenario], None], reference: Scenario
    ) -> tuple[float, tuple[float, ...]]:
        """Runs ``reference``: when it ended (seconds since the timer
        began) and its decode steps' times, the first left out."""
        self._reference = []
        try:
            run(reference)
        finally:
            decodes, self._reference = self._reference, None
        if not decodes:
            raise ProfileError(f"{reference.label}: the engine ran no decode step")
        return time.perf_counter() - self.began, tuple(decodes[1:] or decodes)

    def _record(self, seconds: float, at: float) -> None:
        record = self.scheduler.last_step
        if record is None or record.kind is StepKind.EMPTY:
            return
        self.steps += 1
        if self.on_step is not None:
            self.on_step()
        if self._reference is not None:
            if record.kind is StepKind.DECODE:
                self._reference.append(seconds)
            return
        shape = self._shape(record)
        if shape is not None:
            self.samples.add(shape, seconds, at)

    def _shape(self, record: Any) -> ShapeKey | None:
        """The profiled shape of the step ``record`` describes; ``None``
        for one that is not (a prefill of several prompts, a partly
        filled decode batch)."""
        if record.kind is StepKind.PREFILL:
            if len(record.request_ids) != 1:
                return None
            (before,) = computed_before(self.output).values()
            return (StepKind.PREFILL, record.total_padded, before, record.total_actual)
        if record.num_seqs != record.num_seqs_padded:
            return None
        if self.decode_context == "bucket":
            context = record.context_len_padded
        else:
            context = min(
                self.planned_contexts, key=lambda c: abs(c - record.context_len)
            )
        return (StepKind.DECODE, record.num_seqs_padded, context, 0)


def run_profile(
    spec: EngineSpec,
    *,
    repetitions: int = 5,
    decode_context: str | None = None,
    prefill_fill: str | None = None,
    max_seconds: float | None = None,
    fit_seconds: float | None = None,
    progress: bool = True,
) -> Profile:
    """Start the engine, measure every shape, return the ``Profile``.

    With ``fit_seconds``, each shape is timed fewer times than
    ``repetitions`` (down to ``FEWEST_REPETITIONS``) where the plan would
    take longer than that at the costliest step's measured time (the
    profile's ``meta`` says how many). Raises ``ProfileError`` when the
    measurement would take longer than ``max_seconds`` (saying how long),
    or a shape cannot be produced."""
    if repetitions < 1:
        raise ProfileError(f"--repetitions must be >= 1, got {repetitions!r}")
    if fit_seconds is not None and not fit_seconds > 0:
        raise ProfileError(f"--fit-seconds must be > 0, got {fit_seconds!r}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    use_process_ipc_directory()
    from vllm import LLM

    config = spec.resolved_config()
    modes = _modes(spec, decode_context, prefill_fill)
    started = time.perf_counter()
    llm = LLM(**spec.llm_kwargs())
    # The in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0).
    client: Any = llm.llm_engine.engine_core
    scheduler = client.engine_core.scheduler
    kv_blocks = int(scheduler.kv_cache_config.num_blocks)
    block_size = int(scheduler.block_size)
    # Block 0 is the pool's null block; a block per request of rounding.
    kv_tokens = (kv_blocks - 1 - max(config.num_seqs_buckets)) * block_size

    def plan(times: int) -> ProfilePlan:
        return plan_profile(config, spec.limits, modes, times, kv_tokens, block_size)

    def steps_of(times: int) -> int:
        return plan(times).steps(spec.limits.max_prefill_tokens)

    timer = StepTimer(
        llm, modes.decode_context, decode_contexts(config, modes.decode_context)
    )
    runner = _ScenarioRunner(llm)
    # This process is the engine core: off the worker's core while it
    # times steps, as validate's server runs (cpu_binding).
    with keep_off_worker_cores(os.getpid()) as engine_core_cores:
        step_s = _time_costliest_step(runner, timer, config, spec.max_model_len)
        if fit_seconds is not None:
            repetitions = fitted_repetitions(repetitions, fit_seconds, step_s, steps_of)
        chosen = plan(repetitions)
        planned_steps = chosen.steps(spec.limits.max_prefill_tokens)
        _check_duration(planned_steps, len(chosen.scenarios()), step_s, max_seconds)
        drift = _run_all(runner, timer, chosen, planned_steps, progress)
    compile_seconds = None
    if config.compile_buckets and _runs_static_shape_worker(spec):
        (compile_seconds,) = llm.collective_rpc("compile_seconds")
    return Profile(
        platform=_platform(spec),
        model=model_identity(spec.model),
        engine={
            "max_model_len": spec.max_model_len,
            "max_num_batched_tokens": spec.max_num_batched_tokens,
            "max_num_seqs": spec.max_num_seqs,
            "block_size": block_size,
            "kv_cache_memory_bytes": spec.kv_cache_memory_bytes,
            "dtype": spec.dtype,
            "enforce_eager": spec.enforce_eager,
        },
        neuron_config={
            "num_batched_tokens_buckets": list(config.num_batched_tokens_buckets),
            "num_seqs_buckets": list(config.num_seqs_buckets),
            "decode_context_length_buckets": list(config.decode_context_length_buckets),
        },
        kv_cache={"num_blocks": kv_blocks, "block_size": block_size},
        timings=timer.samples.timings(drift),
        compile_seconds=compile_seconds,
        meta={
            "decode_context": modes.decode_context,
            "prefill_fill": modes.prefill_fill,
            "unreachable": list(chosen.unreachable),
            "repetitions": repetitions,
            # The reference's time after each block; each sample is scaled
            # to its typical speed (``measured_s``: as timed).
            "drift": drift.to_json(),
            "engine_steps": timer.steps,
            # The plan's steps (the costliest step's two timings aside):
            # more were run where a shared context was not found cached.
            "planned_steps": planned_steps,
            # Where the engine core ran (empty: wherever the kernel put it).
            "engine_core_cores": sorted(engine_core_cores),
            "seconds": round(time.perf_counter() - started, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )


def _modes(
    spec: EngineSpec, decode_context: str | None, prefill_fill: str | None
) -> ProfileModes:
    """The modes asked for, each defaulting to ``"actual"`` on the CPU
    static-shape worker (its attention runs real rows and tokens only) and
    ``"bucket"`` elsewhere."""
    default = "actual" if _runs_static_shape_worker(spec) else "bucket"
    modes = ProfileModes(decode_context or default, prefill_fill or default)
    for option, value in (
        ("--decode-context", modes.decode_context),
        ("--prefill-fill", modes.prefill_fill),
    ):
        if value not in ("bucket", "actual"):
            raise ProfileError(f"{option} must be 'bucket' or 'actual', got {value!r}")
    return modes


class _ScenarioRunner:
    """Runs a scenario's prompts (deterministic token ids: the shared
    context's, then the prompt's own; exactly their ``max_tokens`` each)
    through the engine to completion."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.vocab = int(llm.llm_engine.model_config.get_vocab_size())
        self.ids = itertools.count()

    def __call__(self, scenario: Scenario) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine, span = self.llm.llm_engine, self.vocab - 4
        shared = scenario.shared_tokens
        for length, max_tokens in zip(
            scenario.prompt_lens, scenario.max_tokens, strict=True
        ):
            index = next(self.ids)
            # Strides 31 and 13: no prompt's own tokens repeat the shared
            # context's, so only the shared context is found in the cache.
            prompt = [(31 * j + 17) % span + 4 for j in range(shared)]
            prompt += [
                (index * 7919 + 13 * j) % span + 4 for j in range(shared, length)
            ]
            params = SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, temperature=0.0
            )
            engine.add_request(
                f"profile-{index}", TokensPrompt(prompt_token_ids=prompt), params
            )
        while engine.has_unfinished_requests():
            engine.step()


def _time_costliest_step(
    run: _ScenarioRunner, timer: StepTimer, config: NeuronConfig, max_model_len: int
) -> float:
    """Seconds of the costliest prefill step, timed twice (both kept as
    samples): the unit of the plan's predicted duration."""
    # One token short of a bucket of max_model_len (room for the one
    # generated token): the same padded shape.
    tokens = min(config.num_batched_tokens_buckets[-1], max_model_len - 1)
    calibration = Scenario("calibration", (tokens,), (1,))
    run(calibration)
    run(calibration)
    return max(
        statistics.median(samples)
        for (kind, *_), samples in timer.samples.seconds.items()
        if kind is StepKind.PREFILL
    )


def fitted_repetitions(
    repetitions: int, fit_seconds: float, step_s: float, steps_of: Callable[[int], int]
) -> int:
    """The most repetitions, ``repetitions`` at most and
    ``FEWEST_REPETITIONS`` at least, whose plan of ``steps_of(n)`` steps
    at ``step_s`` each fits ``fit_seconds`` (an overestimate: most steps
    cost less than the costliest)."""
    fewest = min(repetitions, FEWEST_REPETITIONS)
    for times in range(repetitions, fewest, -1):
        if steps_of(times) * step_s <= fit_seconds:
            return times
    return fewest


def _check_duration(
    planned_steps: int, num_scenarios: int, step_s: float, max_seconds: float | None
) -> None:
    """Refuse a plan of ``planned_steps`` at ``step_s`` each that would take
    longer than ``max_seconds``."""
    estimate = planned_steps * step_s
    if max_seconds is not None and estimate > max_seconds:
        raise ProfileError(
            f"profiling this configuration runs {planned_steps} engine steps "
            f"({num_scenarios} scenarios), about {estimate:.0f} s at "
            f"{step_s * 1e3:.1f} ms per step (the largest prefill bucket), more "
            f"than --max-seconds {max_seconds:g}; lower --repetitions or profile "
            "fewer buckets"
        )


def _run_all(
    run: _ScenarioRunner,
    timer: StepTimer,
    plan: ProfilePlan,
    planned_steps: int,
    progress: bool,
) -> DriftReference:
    """Every block of ``plan``, the drift reference after each, under a
    progress bar of engine steps if asked; the reference's times."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=planned_steps, desc="profiling", unit="step")
        timer.on_step = lambda: bar.update(1)
    moments, steps = [], []
    for block in plan.blocks():
        for scenario in block:
            if bar is not None:
                bar.set_postfix_str(scenario.label)
            run(scenario)
        at, reference_s = timer.reference_time(run, plan.reference)
        moments.append(at)
        steps.append(reference_s)
    if bar is not None:
        bar.close()
    return DriftReference(plan.reference.label, tuple(moments), tuple(steps))


def _platform(spec: EngineSpec) -> dict[str, Any]:
    """Where the profile was measured: platform, processor, the CPU kernels
    torch ran, versions, the worker and the executor."""
    import torch
    import vllm

    return {
        "name": _platform_name(),
        "processor": _processor_name(),
        "cpu_capability": cpu_capability(),
        "cpu_count": os.cpu_count(),
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "worker_cls": spec.worker_cls or "vllm default",
        "executor": spec.distributed_executor_backend
        or server_executor()
        or "vllm default",
    }


def model_identity(model: str) -> dict[str, Any]:
    """Name, architecture, size and a fingerprint of ``model``'s
    ``config.json`` (a profile of another model is refused by it)."""
    path = Path(model)
    config_text = (path / "config.json").read_text() if path.is_dir() else "{}"
    config = json.loads(config_text)
    return {
        "name": path.name or model,
        "path": str(path),
        "architectures": config.get("architectures"),
        "hidden_size": config.get("hidden_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "config_sha256": hashlib.sha256(config_text.encode()).hexdigest()[:16],
    }


def _runs_static_shape_worker(spec: EngineSpec) -> bool:
    return spec.worker_cls == "neuron_scheduler.StaticShapeWorker"


def _platform_name() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def this_machine() -> dict[str, Any]:
    """Where a measurement ran: the processor, the cores this process may
    use, the instruction set of torch's CPU kernels, vLLM's version."""
    import vllm

    return {
        "processor": _processor_name(),
        "cores": len(os.sched_getaffinity(0)),
        "cpu_capability": cpu_capability(),
        "vllm_version": vllm.__version__,
    }


def cpu_capability() -> str:
    """The instruction set torch's CPU kernels run here ("AVX512", "AVX2",
    ...): what the CPU has, less what ``ATEN_CPU_CAPABILITY`` turns off.
    vLLM's CPU platform picks its own kernels' build by the same CPU."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def _processor_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform_module.processor() or "unknown"
