"""Published Neuron vLLM benchmarks, and what the simulator answers for each.

Every point is one row of a results file in ``huggingface/optimum-neuron``
(``SOURCE`` at the commit named per run): Llama-3.1-8B-Instruct served by
optimum-neuron's vLLM integration and measured with guidellm 0.1 on emulated
data, prompts 1500 +- 150 and outputs 250 +- 20 tokens, each drawn uniformly
(``benchmark/vllm/benchmark.sh``; guidellm's ``request/emulated.py``).
Each run is guidellm 0.1's sweep (``neuralmagic/guidellm`` at v0.1.0:
``executor/profile_generator.py``), every benchmark from a cold start and
for at most ``WINDOW_S`` seconds (``--max-seconds``, ``guidellm/main.py``);
requests still running then are cancelled and not counted:

* "synchronous": one request at a time;
* "throughput": ``5 x`` the requests the synchronous benchmark completed
  (``create_sweep_profile``: ``max_number``), sent by a loop that keeps at
  most ``users - 1`` in flight (``scheduler/base.py``: it waits while
  ``index + 1 - completed >= max_concurrency``, with ``max_concurrency``
  the run's users), pauses 1 ms after each send and, while the gate is
  shut, looks again every 100 ms (``GUIDELLM_0_1_THROUGHPUT``);
* "asynchronous@R": R requests per second at a constant rate, R being the
  throughput benchmark's request rate (the same gate never shuts at the
  one such point here: at most 27 of 31 requests run).

guidellm reports, over the requests completed: mean TTFT, ITL pooled over
every token gap, and request and token rates over the time from the first
completed request's start to the last one's end (``core/result.py``).
Requests may end before their ``max_tokens`` (guidellm does not ignore
EOS): each point's row gives the tokens generated per request (output
tok/s / req/s), which the replay generates.

The simulator replays each load with the engine those runs used:
``neuron_vllm_policy`` (vLLM's scheduler, chunked prefill off) executed
``Execution.GRAPH_PER_PHASE``, charged by ``RooflineCostModel``; a run of
several servers behind nginx's round-robin as a fleet of that many engines
(``PublishedRun.replicas``, ``RouterKind.ROUND_ROBIN``). The single-user
points of one run per chip generation set the efficiencies
(``calibrates``); every other number is a prediction.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

from neuron_scheduler.offline.engine import EngineSettings
from neuron_scheduler.sim.cost_model import RooflineCostModel
from neuron_scheduler.sim.engines import GUIDELLM_0_1_THROUGHPUT
from neuron_scheduler.sim.policies import neuron_vllm_policy
from neuron_scheduler.sim.records import RequestRecord
from neuron_scheduler.sim.routing import RouterKind
from neuron_scheduler.sim.simulate import simulate
from neuron_scheduler.sim.workload import RequestSpec

SOURCE = "https://github.com/huggingface/optimum-neuron/blob"
#: guidellm's emulated data in these runs (``benchmark/vllm/benchmark.sh``).
PROMPT_TOKENS, PROMPT_SPREAD = 1500, 150
OUTPUT_SPREAD = 20
#: guidellm 0.1's default ``--max-seconds``: the length of every benchmark.
WINDOW_S = 120.0
#: A sweep's throughput benchmark sends this many times the requests its
#: synchronous benchmark completed.
THROUGHPUT_REQUESTS_PER_SYNC_REQUEST = 5


@dataclass(frozen=True)
class PublishedRun:
    """One served configuration: where its results are, and its engine."""

    name: str
    #: ``commit/path`` under ``SOURCE`` (and the row's date where a file has
    #: several runs).
    source: str
    hardware: str
    tensor_parallel_size: int
    #: The compiled batch (``max_num_seqs``) and sequence length
    #: (``max_model_len``).
    batch_size: int
    sequence_length: int
    model: str = "llama-3.1-8b"
    #: Independent servers behind a round-robin proxy (nginx's default).
    replicas: int = 1
    #: The request rate of the run's synchronous benchmark, where that row
    #: is not a point of its own (it sets the throughput benchmark's size).
    synchronous_requests_per_s: float | None = None


@dataclass(frozen=True)
class PublishedPoint:
    """One load of a run and what was measured there (means)."""

    run: PublishedRun
    load: str
    max_concurrency: int | None
    request_rate: float | None
    ttft_ms: float
    itl_ms: float
    output_tok_s: float
    requests_per_s: float
    #: The roofline efficiencies were set from this point's TTFT and ITL.
    calibrates: bool = False

    @property
    def label(self) -> str:
        return f"{self.run.name}, {self.load}"

    @property
    def output_len(self) -> int:
        """Tokens generated per request in this row."""
        return round(self.output_tok_s / self.requests_per_s)


TRN2_TP4 = PublishedRun(
    "trn2 TP4 BS32",
    "7092ed5747776443070a0c1d4f61fe4e63cee452/benchmark/vllm/"
    "llama-3.1-8b-trn2/vllm-results.csv (engine: serve-dp1-tp4.env)",
    "trn2",
    4,
    32,
    4096,
)
INF2_TP8 = PublishedRun(
    "inf2.48xlarge TP8 BS32",
    "d9a0c42ccf1d9c3c9fd93d4702b6b37e242eeb78/benchmark/vllm/chunked-prefill/"
    "std-ods-2026-08-25.csv (config A of its README: standard context "
    "encoding, on-device sampling)",
    "inf2",
    8,
    32,
    4096,
)
INF2_TP2 = PublishedRun(
    "inf2.24xlarge TP2 BS4",
    "1b88abef8cdaed92ca179d7eacf2e4ad855ea43a/benchmark/vllm/"
    "llama-3.1-8b-inf2-report.md",
    "inf2",
    2,
    4,
    4096,
)
INF2_TP8_CLI = PublishedRun(
    "inf2.48xlarge TP8 BS32 (CLI, 2026-03)",
    "9fdecaf6e39afbb32cf00776a4cff35e8cb34917/benchmark/vllm/llama-3.1-8b/"
    "vllm-results-cli-dp.csv, row 2026-03-17-11-49-31 (DP=1 of "
    "dp-benchmark-results.md)",
    "inf2",
    8,
    32,
    4096,
)


def _cli_dp_run(
    replicas: int, row: str, synchronous_requests_per_s: float
) -> PublishedRun:
    """A data-parallel row of the CLI file: ``replicas`` TP8 servers on one
    inf2.48xlarge behind nginx's round-robin (dp-benchmark-results.md)."""
    return PublishedRun(
        f"inf2.48xlarge {replicas}x TP8 BS32 (CLI, 2026-03)",
        "9fdecaf6e39afbb32cf00776a4cff35e8cb34917/benchmark/vllm/llama-3.1-8b/"
        f"vllm-results-cli-dp.csv, row {row} (DP={replicas} of "
        "dp-benchmark-results.md)",
        "inf2",
        8,
        32,
        4096,
        replicas=replicas,
        synchronous_requests_per_s=synchronous_requests_per_s,
    )


# Their synchronous rows are not points: one user reaches one server, yet
# TTFT grows with the servers on the host (361, 469, 586 ms at DP 1, 2, 3
# with ITL unchanged), which no engine model explains.
INF2_TP8_CLI_DP2 = _cli_dp_run(2, "2026-03-17-12-56-30", 0.1412834670561915)
INF2_TP8_CLI_DP3 = _cli_dp_run(3, "2026-03-17-13-08-12", 0.13722643347214303)

POINTS = (
    PublishedPoint(TRN2_TP4, "synchronous", 1, None, 197.2, 22.14, 43.53, 0.184, True),
    PublishedPoint(
        TRN2_TP4, "asynchronous@2.46", None, 2.46, 211.3, 47.56, 537.1, 2.273
    ),
    PublishedPoint(
        TRN2_TP4, "throughput, 32 users", 32, None, 1253.8, 44.46, 578.8, 2.460
    ),
    PublishedPoint(
        INF2_TP2, "synchronous", 1, None, 1057.7, 50.67, 18.17, 0.075, True
    ),
    PublishedPoint(
        INF2_TP2, "throughput, 4 users", 4, None, 1315.2, 59.46, 44.21, 0.188
    ),
    PublishedPoint(INF2_TP8, "synchronous", 1, None, 310.0, 23.90, 39.30, 0.196, True),
    PublishedPoint(
        INF2_TP8, "throughput, 32 users", 32, None, 1855.8, 59.74, 428.5, 1.981
    ),
    PublishedPoint(INF2_TP8_CLI, "synchronous", 1, None, 361.3, 27.95, 33.89, 0.146),
    PublishedPoint(
        INF2_TP8_CLI, "throughput, 128 users", 128, None, 20294.9, 64.54, 385.2,
        1.702,
    ),
    PublishedPoint(
        INF2_TP8_CLI_DP2, "throughput, 128 users", 128, None, 7937.9, 54.99, 678.5,
        2.982,
    ),
    PublishedPoint(
        INF2_TP8_CLI_DP3, "throughput, 128 users", 128, None, 4614.5, 46.02,
        1144.5, 4.874,
    ),
)  # fmt: skip


def sync_requests(run: PublishedRun) -> int:
    """Requests the run's synchronous benchmark completed: its request rate
    times its span, which is the window less the part of a request that did
    not fit (rounded down)."""
    rate = run.synchronous_requests_per_s
    if rate is None:
        (sync,) = (p for p in POINTS if p.run is run and p.max_concurrency == 1)
        rate = sync.requests_per_s
    return math.floor(rate * WINDOW_S + 1e-6)


def emulated_workload(point: PublishedPoint, seed: int = 0) -> list[RequestSpec]:
    """guidellm's emulated data for ``point``: lengths uniform within the
    stated spread around the prompt length and the row's tokens per
    request; for a throughput benchmark its requests (all ready at once;
    the client paces them), otherwise enough to outlast the window (one
    user's requests back to back, or a constant rate)."""
    rng = random.Random(seed)
    if point.max_concurrency == 1:
        # More than the window can complete even at 10 ms per token.
        count = int(WINDOW_S / (point.output_len * 0.01)) + 1
        arrivals = [0.0] * count
    elif point.max_concurrency is not None:
        count = THROUGHPUT_REQUESTS_PER_SYNC_REQUEST * sync_requests(point.run)
        arrivals = [0.0] * count
    else:
        assert point.request_rate is not None
        count = int(WINDOW_S * point.request_rate) + 1
        arrivals = [i / point.request_rate for i in range(count)]
    mean_output = point.output_len
    return [
        RequestSpec(
            arrival,
            rng.randint(PROMPT_TOKENS - PROMPT_SPREAD, PROMPT_TOKENS + PROMPT_SPREAD),
            rng.randint(mean_output - OUTPUT_SPREAD, mean_output + OUTPUT_SPREAD),
        )
        for arrival in arrivals
    ]


def engine_settings(run: PublishedRun) -> EngineSettings:
    """optimum-neuron's platform settings: one KV block per sequence
    (``block_size = max_model_len``), a block per compiled batch slot."""
    return EngineSettings(
        max_num_seqs=run.batch_size,
        max_num_batched_tokens=run.sequence_length,
        max_model_len=run.sequence_length,
        block_size=run.sequence_length,
        num_kv_blocks=run.batch_size + 1,  # + vLLM's null block
    )


def simulate_point(point: PublishedPoint) -> dict[str, float]:
    """The simulator's answer for ``point``, as guidellm 0.1 reports it (see
    the module docstring)."""
    run = point.run
    cost = RooflineCostModel.named(run.hardware, run.model, run.tensor_parallel_size)
    in_flight, pacing = point.max_concurrency, None
    if in_flight is not None and in_flight > 1:
        # A throughput benchmark: guidellm's gate keeps one user fewer in
        # flight than it is given, and its loop polls.
        in_flight, pacing = in_flight - 1, GUIDELLM_0_1_THROUGHPUT
    result = simulate(
        emulated_workload(point),
        neuron_vllm_policy(run.sequence_length),
        engine_settings(run),
        cost,
        max_concurrency=in_flight,
        pacing=pacing,
        stop_after_s=WINDOW_S,
        replicas=run.replicas,
        router=RouterKind.ROUND_ROBIN,
    )
    done = [r for r in result.records if 0 <= r.finish_s <= WINDOW_S]
    if not done:
        raise ValueError(f"{point.label}: no request completes in {WINDOW_S:g} s")
    return guidellm_metrics(done)


def guidellm_metrics(done: list[RequestRecord]) -> dict[str, float]:
    """guidellm 0.1's means over completed requests (``core/result.py``):
    TTFT per request; ITL pooled over every token gap; output tokens per
    second from the first completed request's start to the last end."""
    first = min(done, key=lambda r: r.finish_s)
    duration = max(r.finish_s for r in done) - first.arrival_s
    gaps = sum(r.num_tokens - 1 for r in done)
    return {
        "ttft_ms": 1e3 * sum(r.first_token_s - r.arrival_s for r in done) / len(done),
        "itl_ms": 1e3 * sum(r.finish_s - r.first_token_s for r in done) / gaps,
        "output_tok_s": sum(r.num_tokens for r in done) / duration,
    }


METRICS = ("ttft_ms", "itl_ms", "output_tok_s")


def compare_all(points: tuple[PublishedPoint, ...] = POINTS) -> list[dict[str, Any]]:
    """Per point: published and simulated values and relative errors."""
    rows = []
    for point in points:
        simulated = simulate_point(point)
        rows.append(
            {
                "run": point.run.name,
                "load": point.load,
                "calibrates": point.calibrates,
                "source": f"{SOURCE}/{point.run.source}",
                "published": {key: getattr(point, key) for key in METRICS},
                "simulated": simulated,
                "relative_error": {
                    key: simulated[key] / getattr(point, key) - 1 for key in METRICS
                },
            }
        )
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A Markdown table: published / simulated (error) per metric."""
    lines = [
        "| run | load | TTFT ms | ITL ms | output tok/s |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        cells = []
        for key in METRICS:
            published, simulated = row["published"][key], row["simulated"][key]
            error = 100 * row["relative_error"][key]
            cells.append(f"{_number(published)} / {_number(simulated)} ({error:+.0f}%)")
        load = row["load"] + (" (calibration)" if row["calibrates"] else "")
        lines.append(f"| {row['run']} | {load} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _number(value: float) -> str:
    return f"{value:.0f}" if value >= 1000 else f"{value:.4g}"


def run_published(json_path: str | None) -> int:
    """``bench --published``: the table, and the rows as JSON if asked."""
    rows = compare_all()
    print(format_rows(rows))
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(rows, handle, indent=2)
    return 0
