"""Workloads: the built-in synthetic one and trace files.

A workload is a list of ``RequestSpec`` sorted by arrival time (seconds from
the start). Parsers raise ``WorkloadError`` naming the file and line.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path


class WorkloadError(ValueError):
    """A trace file or workload option is invalid."""


@dataclass(frozen=True)
class RequestSpec:
    """One request: when it arrives, its prompt and output lengths, and (for
    prefix-sharing traces) the ids of its prompt's blocks. ``rejected``: the
    server would refuse it (its prompt does not fit ``max_model_len``); it
    counts as a failed request."""

    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()
    hash_block_tokens: int = 512
    rejected: bool = False


@dataclass(frozen=True)
class FitReport:
    """What ``fit_to_model_len`` changed: requests rejected (as the server
    rejects them), outputs shortened to fit (as the server caps
    ``max_tokens``), and requests clipped (prompt trimmed, on request)."""

    rejected: int = 0
    outputs_capped: int = 0
    clipped: int = 0


# Shape of the Azure 2023 conversation trace (../shared/traces README and the
# Splitwise paper): input median ~1020, p90 ~2730; output median ~130, p90 ~420.
# Log-normal fits: mu = ln(median), sigma = ln(p90 / median) / z(0.9).
_Z90 = 1.2815515655446004
BUILTIN_INPUT = (math.log(1020), math.log(2730 / 1020) / _Z90)
BUILTIN_OUTPUT = (math.log(130), math.log(420 / 130) / _Z90)


def arrival_times(
    n: int, request_rate: float, burstiness: float, rng: random.Random
) -> list[float]:
    """Gamma-distributed gaps as in ``vllm bench serve``: shape=burstiness,
    mean gap 1/rate (burstiness 1 = Poisson). ``inf`` rate: all at 0."""
    if request_rate <= 0:
        raise WorkloadError(f"--request-rate must be > 0, got {request_rate!r}")
    if burstiness <= 0:
        raise WorkloadError(f"--burstiness must be > 0, got {burstiness!r}")
    if math.isinf(request_rate):
        return [0.0] * n
    theta = 1.0 / (request_rate * burstiness)
    times, now = [], 0.0
    for _ in range(n):
        times.append(now)
        now += rng.gammavariate(burstiness, theta)
    return times


def builtin_workload(
    num_requests: int,
    request_rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[RequestSpec]:
    """Synthetic Azure-conversation-shaped workload (no files needed). The
    lengths do not depend on the engine: ``fit_to_model_len`` applies the
    server's rules to requests that do not fit."""
    rng = random.Random(seed)
    times = arrival_times(num_requests, request_rate, burstiness, rng)
    specs = []
    for arrival in times:
        output_len = max(1, round(rng.lognormvariate(*BUILTIN_OUTPUT)))
        input_len = max(1, round(rng.lognormvariate(*BUILTIN_INPUT)))
        specs.append(RequestSpec(arrival, input_len, output_len))
    return specs


def random_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    request_rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[RequestSpec]:
    """``vllm bench serve --dataset-name random`` lengths: each drawn
    uniformly from ``[floor(len * (1 - r)), ceil(len * (1 + r))]`` (outputs
    at least 1), so a published run replays by its own parameters. The
    simulator has no tokenizer: no special tokens are subtracted."""
    if not 0.0 <= range_ratio < 1.0:
        raise WorkloadError(
            f"--random-range-ratio must be in [0, 1), got {range_ratio!r}"
        )
    for name, value in (("input", input_len), ("output", output_len)):
        if value < 1:
            raise WorkloadError(f"--random-{name}-len must be >= 1, got {value!r}")
    import numpy as np

    generator = np.random.default_rng(seed)
    low_in = math.floor(input_len * (1 - range_ratio))
    high_in = math.ceil(input_len * (1 + range_ratio))
    low_out = max(math.floor(output_len * (1 - range_ratio)), 1)
    high_out = max(math.ceil(output_len * (1 + range_ratio)), 1)
    inputs = generator.integers(max(low_in, 1), high_in + 1, size=num_requests)
    outputs = generator.integers(low_out, high_out + 1, size=num_requests)
    times = arrival_times(num_requests, request_rate, burstiness, random.Random(seed))
    return [
        RequestSpec(arrival, int(i), int(o))
        for arrival, i, o in zip(times, inputs, outputs, strict=True)
    ]


def load_trace(path: str | Path) -> list[RequestSpec]:
    """Parse an Azure CSV, Mooncake JSONL or length-only CSV (detected from
    the header / first line). Length-only traces get arrival 0 (re-time them
    with ``retime``)."""
    path = Path(path)
    if not path.exists():
        raise WorkloadError(f"workload file {str(path)!r} does not exist")
    with path.open() as handle:
        first = handle.readline()
    if first.lstrip().startswith("{"):
        return _load_mooncake(path)
    header = [c.strip() for c in first.strip().split(",")]
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= set(header):
        return _load_azure(path)
    if {"num_prefill_tokens", "num_decode_tokens"} <= set(header):
        return _load_lengths(path)
    raise WorkloadError(
        f"{path}:1: unknown trace format (header {first.strip()[:80]!r}); expected "
        "Azure CSV, Mooncake JSONL or num_prefill_tokens,num_decode_tokens CSV"
    )


def _positive_int(value: object, path: Path, line: int, column: str) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise WorkloadError(
            f"{path}:{line}: {column} must be an integer, got {value!r}"
        ) from None
    if number <= 0:
        raise WorkloadError(f"{path}:{line}: {column} must be positive, got {number}")
    return number


def _load_azure(path: Path) -> list[RequestSpec]:
    specs: list[RequestSpec] = []
    start: datetime | None = None
    with path.open(newline="") as handle:
        for line, row in enumerate(csv.DictReader(handle), start=2):
            stamp = (row.get("TIMESTAMP") or "").strip()
            try:
                # Python's fromisoformat takes at most 6 fractional digits.
                when = datetime.fromisoformat(stamp[:26])
            except ValueError:
                raise WorkloadError(
                    f"{path}:{line}: TIMESTAMP {stamp!r} is not a date-time"
                ) from None
            start = start or when
            specs.append(
                RequestSpec(
                    (when - start).total_seconds(),
                    _positive_int(
                        row.get("ContextTokens"), path, line, "ContextTokens"
                    ),
                    _positive_int(
                        row.get("GeneratedTokens"), path, line, "GeneratedTokens"
                    ),
                )
            )
    return sorted(specs, key=lambda s: s.arrival_s)


def _load_mooncake(path: Path) -> list[RequestSpec]:
    specs = []
    with path.open() as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
                stamp = float(record["timestamp"]) / 1000.0
                hash_ids = tuple(int(h) for h in record.get("hash_ids", ()))
            except (ValueError, KeyError, TypeError) as error:
                raise WorkloadError(f"{path}:{line}: bad record ({error})") from None
            specs.append(
                RequestSpec(
                    stamp,
                    _positive_int(
                        record.get("input_length"), path, line, "input_length"
                    ),
                    _positive_int(
                        record.get("output_length"), path, line, "output_length"
                    ),
                    hash_ids,
                )
            )
    return sorted(specs, key=lambda s: s.arrival_s)


def _load_lengths(path: Path) -> list[RequestSpec]:
    specs = []
    with path.open(newline="") as handle:
        for line, row in enumerate(csv.DictReader(handle), start=2):
            specs.append(
                RequestSpec(
                    0.0,
                    _positive_int(
                        row.get("num_prefill_tokens"), path, line, "num_prefill_tokens"
                    ),
                    _positive_int(
                        row.get("num_decode_tokens"), path, line, "num_decode_tokens"
                    ),
                )
            )
    return specs


def select(
    specs: Sequence[RequestSpec], num_requests: int | None, sample: bool, seed: int
) -> list[RequestSpec]:
    """The first ``num_requests`` (or a random sample of that many, kept in
    arrival order); all when ``None``."""
    if num_requests is None or num_requests >= len(specs):
        return list(specs)
    if num_requests <= 0:
        raise WorkloadError(f"--num-requests must be > 0, got {num_requests}")
    if sample:
        chosen = sorted(random.Random(seed).sample(range(len(specs)), num_requests))
        picked = [specs[i] for i in chosen]
    else:
        picked = list(specs[:num_requests])
    if picked:
        start = picked[0].arrival_s
        picked = [replace(s, arrival_s=s.arrival_s - start) for s in picked]
    return picked


def retime(
    specs: Sequence[RequestSpec],
    *,
    time_scale: float = 1.0,
    request_rate: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[RequestSpec]:
    """Keep the trace's own times scaled by ``time_scale`` (2 = twice as
    slow), or, with ``request_rate``, draw new Gamma arrivals."""
    if time_scale <= 0:
        raise WorkloadError(f"--time-scale must be > 0, got {time_scale!r}")
    if request_rate is not None:
        times = arrival_times(len(specs), request_rate, burstiness, random.Random(seed))
        return [replace(s, arrival_s=t) for s, t in zip(specs, times, strict=True)]
    return [replace(s, arrival_s=s.arrival_s * time_scale) for s in specs]


def fit_to_model_len(
    specs: Sequence[RequestSpec], max_model_len: int, clip: bool = False
) -> tuple[list[RequestSpec], FitReport]:
    """Apply the server's length rules: a prompt of ``max_model_len`` tokens
    or more is rejected (a failed request); a longer output is capped at
    ``max_model_len - prompt`` (vLLM's ``get_max_tokens``). With ``clip``,
    the prompt is trimmed to fit instead of being rejected."""
    fitted: list[RequestSpec] = []
    rejected = capped = clipped = 0
    for spec in specs:
        if spec.input_len >= max_model_len:
            if not clip:
                rejected += 1
                fitted.append(replace(spec, rejected=True))
                continue
            clipped += 1
            output_len = min(spec.output_len, max(max_model_len // 2, 1))
            spec = replace(
                spec, input_len=max_model_len - output_len, output_len=output_len
            )
        if spec.input_len + spec.output_len > max_model_len:
            capped += 1
            spec = replace(spec, output_len=max_model_len - spec.input_len)
        fitted.append(spec)
    return fitted, FitReport(rejected, capped, clipped)


#: Requests per second of generated workloads when no rate is given.
BUILTIN_REQUEST_RATE = 1.0


@dataclass(frozen=True)
class WorkloadOptions:
    """Which requests a run serves, and when (what ``build_workload``
    makes). ``trace``: a trace file, else the built-in workload or, with
    both random lengths, vLLM's random dataset; ``None`` counts and rates
    take the source's defaults (200 generated requests at
    ``BUILTIN_REQUEST_RATE``; all of a trace at its own times)."""

    trace: str | None = None
    num_requests: int | None = None
    sample: bool = False
    request_rate: float | None = None
    burstiness: float = 1.0
    time_scale: float = 1.0
    seed: int = 0
    random_input_len: int | None = None
    random_output_len: int | None = None
    random_range_ratio: float = 0.0
    clip_to_model_len: bool = False

    @property
    def name(self) -> str:
        """The workload as reports name it: the trace's path, the random
        dataset's lengths, or ``built-in``."""
        if self.trace:
            return str(self.trace)
        if self.random_input_len is not None:
            return (
                f"random {self.random_input_len}/{self.random_output_len} "
                f"+-{self.random_range_ratio:g}"
            )
        return "built-in"


def build_workload(
    options: WorkloadOptions, max_model_len: int
) -> tuple[list[RequestSpec], FitReport]:
    """The requests ``options`` name, fitted to ``max_model_len`` as the
    server fits them (see ``fit_to_model_len``); ``WorkloadError`` naming
    an inconsistent option."""
    return fit_to_model_len(
        draw_requests(options), max_model_len, clip=options.clip_to_model_len
    )


def draw_requests(options: WorkloadOptions) -> list[RequestSpec]:
    """The requests ``options`` name, in arrival order, before any fit to
    a model length; ``WorkloadError`` naming an inconsistent option."""
    o = options
    generated_rate = (
        o.request_rate if o.request_rate is not None else BUILTIN_REQUEST_RATE
    )
    lengths = (o.random_input_len, o.random_output_len)
    if (lengths[0] is None) != (lengths[1] is None):
        raise WorkloadError(
            "--random-input-len and --random-output-len go together, got "
            f"{lengths[0]!r} and {lengths[1]!r}"
        )
    if o.trace is None and o.random_input_len is not None:
        assert o.random_output_len is not None
        specs = random_workload(
            o.num_requests or 200,
            o.random_input_len,
            o.random_output_len,
            o.random_range_ratio,
            generated_rate,
            o.burstiness,
            o.seed,
        )
    elif o.trace is None:
        specs = builtin_workload(
            o.num_requests or 200, generated_rate, o.burstiness, o.seed
        )
    else:
        if lengths[0] is not None:
            raise WorkloadError("--random-input-len and --workload exclude each other")
        specs = select(load_trace(o.trace), o.num_requests, o.sample, o.seed)
        rate = o.request_rate
        if rate is None and not any(s.arrival_s > 0 for s in specs):
            rate = math.inf  # length-only traces: everything at once, as vLLM's default
        specs = retime(
            specs,
            time_scale=o.time_scale,
            request_rate=rate,
            burstiness=o.burstiness,
            seed=o.seed,
        )
    return specs
