"""Console table shaped like ``vllm bench serve``, one column per policy,
and the optional PNG plot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from neuron_scheduler.sim.records import RunResult
from neuron_scheduler.sim.results import padding_by_bucket, request_latencies
from neuron_scheduler.sim.slo import SLO

_ROWS: list[tuple[str, str, str]] = [
    ("Successful requests:", "completed", "{:.0f}"),
    ("Benchmark duration (s):", "duration", "{:.2f}"),
    ("Total input tokens:", "total_input_tokens", "{:.0f}"),
    ("Total generated tokens:", "total_output_tokens", "{:.0f}"),
    ("Request throughput (req/s):", "request_throughput", "{:.2f}"),
    ("Request goodput (req/s):", "request_goodput", "{:.2f}"),
    ("Output token throughput (tok/s):", "output_throughput", "{:.2f}"),
    ("Total Token throughput (tok/s):", "total_token_throughput", "{:.2f}"),
]
_SECTIONS = [
    ("Time to First Token", "ttft", "TTFT"),
    ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
    ("Inter-token Latency", "itl", "ITL"),
    ("End-to-end Latency", "e2el", "E2EL"),
]
_STATIC: list[tuple[str, str | None, str]] = [
    ("Prefill padding ratio:", "prefill_padding_ratio", "{:.3f}"),
    ("Decode padding ratio:", "decode_padding_ratio", "{:.3f}"),
    ("Decode KV read padding ratio:", "decode_kv_read_padding_ratio", "{:.3f}"),
    ("Preemptions:", "num_preemptions", "{:.0f}"),
    ("Max running requests:", "max_running", "{:.0f}"),
    ("Mean running requests:", "mean_running", "{:.2f}"),
    ("Prefill / decode / mixed steps:", None, ""),
    ("Steps at largest bucket only (P/B/C):", "steps_at_largest_bucket", ""),
    ("Simulation wall time (s):", "wall_seconds", "{:.1f}"),
]
#: Rows a cost model adds (``CostModel.report()``), when it reports them.
_COST: list[tuple[str, str, str]] = [
    ("Steps charged from the profile:", "exact_steps", "{:.0f}"),
    ("Steps interpolated:", "interpolated_steps", "{:.0f}"),
]


class _Table:
    """A table of runs side by side: one label column, one column per run."""

    def __init__(self, runs: Sequence[dict[str, Any]]) -> None:
        self.runs = runs
        self.width = max(14, *(len(r["label"]) + 2 for r in runs))
        self.label_width = 42
        self.total = self.label_width + self.width * len(runs)
        self.out: list[str] = []

    def line(self, label: str, cells: Sequence[str]) -> None:
        self.out.append(
            f"{label:<{self.label_width}}"
            + "".join(f"{c:>{self.width}}" for c in cells)
        )

    def rule(self, title: str, fill: str = "-") -> None:
        self.out.append(f" {title} ".center(self.total, fill))


def format_table(runs: Sequence[dict[str, Any]]) -> str:
    """``vllm bench serve``'s result table with a column per run, then the
    static-shape counters, each replica's load and the cost model's counts
    (where a run has them)."""
    table = _Table(runs)
    table.rule("Serving Benchmark Result (simulated)", "=")
    table.line("", [r["label"] for r in runs])
    rows = list(_ROWS)
    if any(r.get("failed") for r in runs):
        # As vllm bench serve: only when a request failed.
        rows.insert(1, ("Failed requests:", "failed", "{:.0f}"))
    for name, key, fmt in rows:
        table.line(name, [fmt.format(r[key]) for r in runs])
    _latency_sections(table)
    table.rule("Static shapes")
    for name, static_key, fmt in _STATIC:
        if static_key is None:
            cells = [
                f"{r['prefill_steps']}/{r['decode_steps']}/{r['mixed_steps']}"
                for r in runs
            ]
        elif static_key == "steps_at_largest_bucket":
            cells = [
                "/".join(
                    f"{100 * part['share']:.0f}%" for part in r[static_key].values()
                )
                for r in runs
            ]
        else:
            cells = [fmt.format(r[static_key]) for r in runs]
        table.line(name, cells)
    _time_section(table)
    if any("replicas" in r for r in runs):
        _replica_section(table)
    if any("disaggregated" in r for r in runs):
        _pool_section(table)
    if any("cost_model" in r for r in runs):
        table.rule("Cost model")
        for name, key, fmt in _COST:
            table.line(
                name, [fmt.format(r.get("cost_model", {}).get(key, 0)) for r in runs]
            )
    table.out.append("=" * table.total)
    return "\n".join(table.out)


def _latency_sections(table: _Table) -> None:
    """Mean, median, p99 and every other ``pNN`` the runs have, per
    latency."""
    runs = table.runs
    for title, key, short in _SECTIONS:
        table.rule(title)
        stats = [("mean", "Mean"), ("median", "Median"), ("p99", "P99")]
        # --metric-percentiles: every pNN key the runs have, in order.
        extra = sorted(
            {
                k.split("_", 1)[0]
                for k in runs[0]
                if k.startswith("p") and k.endswith(f"_{key}_ms")
            }
            - {"p99"},
            key=lambda stat: float(stat[1:]),
        )
        stats += [(stat, stat.upper()) for stat in extra]
        for stat, name in stats:
            table.line(
                f"{name} {short} (ms):", [f"{r[f'{stat}_{key}_ms']:.2f}" for r in runs]
            )


#: (label, part) of the time section, sub-parts indented under their part.
_TIME_ROWS = [
    ("Engine seconds (duration x engines):", "engine_seconds"),
    ("Idle:", "idle"),
    ("Prefill steps:", "prefill"),
    ("  of which padding:", "prefill_padding"),
    ("  of which decodes waited:", "prefill_with_decodes_waiting"),
    ("Decode steps:", "decode"),
    ("  of which unfilled rows:", "decode_unfilled_rows"),
    ("  of which KV-read padding:", "decode_kv_read_padding"),
    ("Mixed steps (dynamic shapes):", "mixed"),
]


def _time_section(table: _Table) -> None:
    """Where the engines' time went (``time_breakdown``), in seconds."""
    table.rule("Where the time goes (engine seconds)")
    for label, part in _TIME_ROWS:
        table.line(label, [f"{r['time_breakdown'][part]:.1f}" for r in table.runs])
    if all("never_mix_lower_bound_s" in r for r in table.runs):
        table.line(
            "Never-mix lower bound (s):",
            [f"{r['never_mix_lower_bound_s']:.1f}" for r in table.runs],
        )
        table.line(
            "Duration / lower bound:",
            [f"{r['duration_over_lower_bound']:.2f}" for r in table.runs],
        )


def _replica_section(table: _Table) -> None:
    """Each replica's requests, mean running and prefill padding."""
    runs = table.runs
    table.rule("Replicas: requests / mean running / prefill padding")
    count = max(len(r.get("replicas", ())) for r in runs)
    for index in range(count):
        cells = []
        for r in runs:
            loads = r.get("replicas", ())
            load = loads[index] if index < len(loads) else None
            cells.append(
                f"{load['requests']}/{load['mean_running']:.1f}/"
                f"{load['prefill_padding_ratio']:.2f}"
                if load
                else "-"
            )
        table.line(f"Replica {index}:", cells)


#: (label, pool, key, format) of the disaggregated section.
_POOL_ROWS = [
    ("Prefill engines:", "prefill", "engines", "{:.0f}"),
    ("Prefill utilisation:", "prefill", "utilisation", "{:.2f}"),
    ("Mean prefill queue (ms):", "prefill", "mean_queue_ms", "{:.2f}"),
    ("P99 prefill queue (ms):", "prefill", "p99_queue_ms", "{:.2f}"),
    ("Mean prefill latency (ms):", "prefill", "mean_prefill_ms", "{:.2f}"),
    (
        "Mean wait for a decode slot (ms):",
        "transfer",
        "mean_wait_for_slot_ms",
        "{:.2f}",
    ),
    ("P99 wait for a decode slot (ms):", "transfer", "p99_wait_for_slot_ms", "{:.2f}"),
    ("Mean KV transfer (ms):", "transfer", "mean_transfer_ms", "{:.2f}"),
    ("P99 KV transfer (ms):", "transfer", "p99_transfer_ms", "{:.2f}"),
    ("Mean KV per request (MB):", "transfer", "mean_bytes", "{:.1f}"),
    ("Decode engines:", "decode", "engines", "{:.0f}"),
    ("Decode utilisation:", "decode", "utilisation", "{:.2f}"),
    (
        "Mean first token after KV (ms):",
        "decode",
        "mean_first_token_after_transfer_ms",
        "{:.2f}",
    ),
]


def _pool_section(table: _Table) -> None:
    """An xPyD run's pools: utilisation, queueing, the transfer."""
    table.rule("Disaggregated: pools and KV transfer")
    for label, pool, key, fmt in _POOL_ROWS:
        cells = []
        for r in table.runs:
            pools = r.get("disaggregated")
            if pools is None:
                cells.append("-")
                continue
            value = pools[pool][key]
            cells.append(fmt.format(value / 1e6 if key == "mean_bytes" else value))
        table.line(label, cells)


def plot(results: Sequence[RunResult], path: str) -> None:
    """TTFT and TPOT CDFs per policy, prefill padding per bucket, running
    requests over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ttft_ax, tpot_ax), (pad_ax, run_ax) = axes
    for result in results:
        latencies = request_latencies(result)
        ttft = np.sort(latencies.ttft_ms)
        tpot = np.sort(latencies.defined_tpot_ms)
        for ax, values in ((ttft_ax, ttft), (tpot_ax, tpot)):
            if len(values):
                ax.plot(
                    values,
                    np.arange(1, len(values) + 1) / len(values),
                    label=result.label,
                )
        times = [t for t, _ in result.running_timeline]
        counts = [n for _, n in result.running_timeline]
        run_ax.step(times, counts, where="post", label=result.label)
    for result in results:
        if result.prefill_buckets:  # policies differ in buckets: x is the size
            ratios = padding_by_bucket(result.prefill_buckets)
            pad_ax.plot(
                list(ratios), list(ratios.values()), marker="o", label=result.label
            )
    ttft_ax.set(title="TTFT CDF", xlabel="ms", ylabel="fraction", xscale="log")
    tpot_ax.set(title="TPOT CDF", xlabel="ms", ylabel="fraction", xscale="log")
    pad_ax.set(
        title="Prefill padding per token bucket",
        xlabel="bucket (tokens)",
        ylabel="padding / padded",
        xscale="log",
    )
    run_ax.set(title="Running requests", xlabel="simulated s", ylabel="requests")
    for ax in axes.flat:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_plans(plans: list[dict[str, Any]], slos: list[SLO]) -> str:
    """One line per config: the answer, chips, cost, each SLO at it; with
    several xPyD pairs, the cheapest of them after."""
    width = max([28] + [len(plan["label"]) + 2 for plan in plans])
    header = f"{'config':<{width}}{'replicas':>9}{'rate req/s':>12}{'chips':>8}"
    if any("cost_per_hour" in p for p in plans):
        header += f"{'cost/h':>10}"
    header += "".join(f"{str(s):>22}" for s in slos)
    lines = [header]
    for plan in plans:
        rate = plan.get("max_rate", plan.get("rate"))
        engines = _cell(plan["replicas"], "{:d}")
        if plan.get("prefill_engines"):
            engines = f"{plan['prefill_engines']}P{plan['decode_engines']}D"
        line = (
            f"{plan['label']:<{width}}"
            f"{engines:>9}"
            f"{_cell(rate, '{:.2f}'):>12}"
            f"{_cell(plan['chips'], '{:g}'):>8}"
        )
        if any("cost_per_hour" in p for p in plans):
            line += f"{_cell(plan.get('cost_per_hour'), '{:.2f}'):>10}"
        for slo in slos:
            value = plan["slos"][str(slo)]["value_ms"]
            line += f"{_cell(value, '{:.0f} ms'):>22}"
        lines.append(line)
        if "note" in plan:
            lines.append(f"  {plan['note']}")
    pairs = [p for p in plans if "prefill_engines" in p]
    answered = [p for p in pairs if p["chips"] is not None]
    if len(pairs) > 1 and answered:
        best = min(answered, key=lambda p: p["chips"])
        lines.append(
            f"cheapest xPyD: {best['label']}, {best['prefill_engines']}P"
            f"{best['decode_engines']}D, {best['chips']:g} chips"
        )
    return "\n".join(lines)


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def plot_plans(plans: list[dict[str, Any]], slos: list[SLO], path: str) -> None:
    """Each SLO's value as a share of its target (at or below 1 meets)
    against the searched quantity, one line per config; runs stopped early
    (a miss certain) are crosses above the line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(slos), figsize=(5 * len(slos), 4), squeeze=False)
    by_rate = "max_rate" in plans[0]
    for axis, slo in zip(axes[0], slos, strict=True):
        for number, plan in enumerate(plans):
            color = f"C{number}"
            xs, ys, missed = [], [], []
            for e in plan["evaluations"]:
                x = e["rate"] if by_rate else e["replicas"]
                if e["values_ms"] is None:
                    missed.append(x)
                else:
                    xs.append(x)
                    ys.append(e["values_ms"][str(slo)] / slo.ms)
            axis.plot(xs, ys, marker="o", color=color, label=plan["label"])
            if missed:
                top = max([2.0, *ys])
                axis.scatter(missed, [top] * len(missed), marker="x", color=color)
        axis.axhline(1.0, color="grey", linestyle="--")
        axis.set_yscale("log")
        axis.set_xlabel("request rate (req/s)" if by_rate else "replicas")
        axis.set_ylabel(f"{slo} / target (x: missed, run stopped early)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)
