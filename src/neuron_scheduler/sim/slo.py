"""Latency objectives: one type for ``plan --slo`` (a percentile of a run's
values) and ``bench --goodput`` (each request; vLLM's ``KEY:MS`` syntax),
one parser for both, and the percentile names reports use."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: Latencies a run reports (``vllm bench serve``'s names).
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
#: Those a single request has one value of (ITL is per token gap).
PER_REQUEST_METRICS = ("ttft", "tpot", "e2el")


class SLOError(ValueError):
    """A malformed objective, named with the option it came from."""


def percentile_key(percentile: float) -> str:
    """``p99``, ``p99.9``: ``vllm bench serve``'s names."""
    return f"p{int(percentile) if percentile == int(percentile) else percentile}"


def parse_percentile(item: str, where: str) -> float:
    """``"90"`` (or ``"p90"``) -> ``90.0``; ``ValueError`` starting with
    ``where`` and naming ``item`` when it is not a number in (0, 100]."""
    try:
        value = float(item.removeprefix("p"))
    except ValueError:
        raise ValueError(f"{where}: {item!r} is not a number") from None
    if not 0 < value <= 100:
        raise ValueError(f"{where}: {item!r} is not in (0, 100]")
    return value


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"50,90,99"`` -> ``(50.0, 90.0, 99.0)``; ``ValueError`` naming the
    offending value when one is not a number in (0, 100]."""
    where = f"--metric-percentiles {text!r}"
    return tuple(parse_percentile(item, where) for item in text.split(","))


@dataclass(frozen=True)
class SLO:
    """``metric`` at most ``ms`` milliseconds: at ``percentile`` of a run's
    values, or with ``percentile`` ``None`` for each request (goodput
    counts the requests that meet every such objective)."""

    metric: str
    percentile: float | None
    ms: float

    @classmethod
    def parse(cls, text: str, option: str = "--slo") -> SLO:
        """``ttft:p90:2000`` (the ``p`` is optional) for ``--slo``,
        ``ttft:2000`` for ``--goodput``; ``SLOError`` naming ``option``,
        the text and what is wrong."""
        per_request = option == "--goodput"
        where = f"{option} {text!r}"
        parts = text.split(":")
        if len(parts) != (2 if per_request else 3):
            form = "METRIC:MS" if per_request else "METRIC:pPERCENTILE:MS"
            raise SLOError(f"{where}: expected {form}")
        metric, ms_text = parts[0], parts[-1]
        metrics = PER_REQUEST_METRICS if per_request else LATENCY_METRICS
        if metric not in metrics:
            raise SLOError(
                f"{where}: unknown metric {metric!r} (one of {', '.join(metrics)})"
            )
        try:
            percentile = None if per_request else parse_percentile(parts[1], where)
        except ValueError as error:
            raise SLOError(str(error)) from None
        try:
            ms = float(ms_text)
        except ValueError:
            raise SLOError(
                f"{where}: milliseconds {ms_text!r} is not a number"
            ) from None
        if not ms > 0:
            raise SLOError(f"{where}: milliseconds must be > 0")
        return cls(metric, percentile, ms)

    @property
    def key(self) -> str:
        """The ``bench`` metric key of a percentile objective: ``p90_ttft_ms``."""
        assert self.percentile is not None, "a per-request SLO has no run key"
        return f"{percentile_key(self.percentile)}_{self.metric}_ms"

    def met_by(self, latencies_ms: Mapping[str, float]) -> bool:
        """Whether a request with these latencies meets it (a latency it
        does not have, such as one token's TPOT, meets it)."""
        value = latencies_ms.get(self.metric)
        return value is None or value <= self.ms

    def __str__(self) -> str:
        if self.percentile is None:
            return f"{self.metric}:{self.ms:g}"
        return f"{self.metric}:{percentile_key(self.percentile)}:{self.ms:g}"


#: ``bench --goodput``'s default: TTFT 2 s, TPOT 100 ms.
DEFAULT_GOODPUT = (SLO("ttft", None, 2000.0), SLO("tpot", None, 100.0))


def parse_goodput(items: Iterable[str]) -> tuple[SLO, ...]:
    """vLLM's ``--goodput ttft:2000 tpot:100``: one per-request SLO per
    metric (a metric given twice: the last)."""
    by_metric = {}
    for item in items:
        slo = SLO.parse(item, "--goodput")
        by_metric[slo.metric] = slo
    return tuple(by_metric.values())


def goodput_limits(slos: Sequence[SLO]) -> dict[str, float | None]:
    """The per-request limits as reports write them: every per-request
    metric, ``None`` where not checked."""
    limits: dict[str, float | None] = dict.fromkeys(PER_REQUEST_METRICS)
    for slo in slos:
        limits[slo.metric] = slo.ms
    return limits
