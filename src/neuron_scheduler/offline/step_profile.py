"""The profile format: step times ``neuron-scheduler profile`` measured on a
real engine, per shape, with the engine, model and platform they came from
(JSON, ``FORMAT``)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from neuron_scheduler.step import StepKind


class ProfileFormatError(ValueError):
    """A profile file that is not one, or is malformed (named)."""


FORMAT = "neuron-scheduler-profile/1"


@dataclass(frozen=True)
class StepTiming:
    """Wall seconds of repeated engine steps of one shape.

    ``kind`` is ``StepKind.PREFILL`` (``tokens``: the padded token bucket,
    ``context``: tokens computed before the chunk, ``tokens_actual``: the
    real tokens among them, 0 where not recorded: the bucket full) or
    ``StepKind.DECODE`` (``rows``: the padded batch bucket, ``context``: the
    context bucket, ``tokens``: rows times tokens per row).

    ``samples_s`` are what a step of the shape costs; ``measured_s`` the
    same samples as the profiler timed them, where it scaled them to the
    machine's typical speed (``offline.drift``; empty where not)."""

    kind: StepKind
    tokens: int
    context: int
    samples_s: tuple[float, ...]
    rows: int = 0
    tokens_actual: int = 0
    measured_s: tuple[float, ...] = ()

    @property
    def fill(self) -> int:
        """The real tokens of the step (a decode's: all of them)."""
        return self.tokens_actual or self.tokens

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def spread(self) -> tuple[float, float]:
        """The 10th and 90th percentile of the samples."""
        ordered = sorted(self.samples_s)
        last = len(ordered) - 1
        return ordered[round(0.1 * last)], ordered[round(0.9 * last)]

    def to_json(self) -> dict[str, Any]:
        low, high = self.spread
        document = {
            "kind": self.kind.value,
            "tokens": self.tokens,
            "rows": self.rows,
            "context": self.context,
            "tokens_actual": self.tokens_actual,
            "median_s": self.median_s,
            "p10_s": low,
            "p90_s": high,
            "samples_s": list(self.samples_s),
        }
        if self.measured_s:
            document["measured_s"] = list(self.measured_s)
        return document


@dataclass(frozen=True)
class Profile:
    """What ``neuron-scheduler profile`` measured, and on what.

    ``engine``: the engine settings (``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``dtype``, ...);
    ``neuron_config``: the resolved buckets; ``kv_cache``: ``num_blocks``
    and ``block_size`` of the engine's KV cache; ``compile_seconds``: per
    bucket, where measured.
    """

    platform: Mapping[str, Any]
    model: Mapping[str, Any]
    engine: Mapping[str, Any]
    neuron_config: Mapping[str, Any]
    kv_cache: Mapping[str, int]
    timings: tuple[StepTiming, ...]
    compile_seconds: Mapping[str, float] | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kv_capacity_tokens(self) -> int:
        return int(self.kv_cache["num_blocks"]) * int(self.kv_cache["block_size"])

    def to_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["timings"] = [t.to_json() for t in self.timings]
        return {"format": FORMAT, **document}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile; ``ProfileFormatError`` names what is wrong with it."""
        try:
            document = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ProfileFormatError(f"cannot read profile {path}: {error}") from None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise ProfileFormatError(
                f"{path} is not a neuron-scheduler profile (format "
                f"{document.get('format') if isinstance(document, dict) else None!r}"
                f", expected {FORMAT!r})"
            )
        try:
            timings = tuple(
                StepTiming(
                    kind=StepKind(t["kind"]),
                    tokens=int(t["tokens"]),
                    context=int(t["context"]),
                    samples_s=tuple(float(s) for s in t["samples_s"]),
                    rows=int(t.get("rows", 0)),
                    tokens_actual=int(t.get("tokens_actual", 0)),
                    measured_s=tuple(float(s) for s in t.get("measured_s", ())),
                )
                for t in document["timings"]
            )
            profile = cls(
                platform=document["platform"],
                model=document["model"],
                engine=document["engine"],
                neuron_config=document["neuron_config"],
                kv_cache=document["kv_cache"],
                timings=timings,
                compile_seconds=document.get("compile_seconds"),
                meta=document.get("meta", {}),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ProfileFormatError(f"profile {path}: malformed ({error!r})") from None
        for timing in timings:
            if timing.kind is StepKind.EMPTY or not timing.samples_s:
                raise ProfileFormatError(
                    f"profile {path}: bad timing {timing.kind.value!r} with "
                    f"{len(timing.samples_s)} samples"
                )
            if timing.measured_s and len(timing.measured_s) != len(timing.samples_s):
                raise ProfileFormatError(
                    f"profile {path}: {timing.kind.value} timing with "
                    f"{len(timing.samples_s)} samples and {len(timing.measured_s)} "
                    "measured"
                )
        return profile
