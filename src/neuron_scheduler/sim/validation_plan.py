"""What a ``validate`` run sends: its load levels, and how many requests
each level gets when ``--num-requests`` is not given.

Without a count, a level gets as many requests as the time budget leaves
room for (``--time-budget``, ``DEFAULT_TIME_BUDGET_S``), between
``FEWEST_REQUESTS`` and ``MOST_REQUESTS``: the levels are simulated with the
profile just measured (its steps are this machine's), and the count is the
one whose predicted duration fills what the profile and the server's start
left of the budget. A slower machine gets fewer requests, not a longer run;
and where the profile alone would fill more than ``PROFILE_SHARE`` of the
budget, it times each shape fewer times (``profile --fit-seconds``).
Once the capacity is measured, ``fit_to_time_left`` cuts the levels at its
shares to the first requests of the sample where the whole sample would not
end within the budget (a capacity below the simulated one means lower rates).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from neuron_scheduler.sim.validation_metrics import profile_note, steady_rate
from neuron_scheduler.sim.workload import (
    BUILTIN_REQUEST_RATE,
    FitReport,
    RequestSpec,
    WorkloadOptions,
    draw_requests,
    fit_to_model_len,
)

if TYPE_CHECKING:
    from neuron_scheduler.offline.engine_spec import EngineSpec
    from neuron_scheduler.offline.step_profile import Profile
    from neuron_scheduler.sim.records import RunResult

#: The default levels: shares of the measured capacity.
DEFAULT_LOAD_FRACTIONS = (0.5, 0.8, 0.95)
#: Wall seconds a default ``validate`` aims at, the profile included.
DEFAULT_TIME_BUDGET_S = 600.0
#: Requests a level gets at most, and at least, when sized to the budget.
#: At the fewest, a level's p99 of TTFT or E2EL is its largest request's
#: (as it nearly is at 16); below 16 only where the budget allows no more.
MOST_REQUESTS = 100
FEWEST_REQUESTS = 12
#: The share of the time budget the profile may fill before it times each
#: shape fewer times than five (three at the fewest).
PROFILE_SHARE = 0.3
#: Seconds a level costs beside its requests' service: the benchmark
#: client's start, its warm-up request, the simulation after it.
LEVEL_OVERHEAD_S = 10.0
#: The share of the time left that the predicted levels may fill: the
#: server's steps run somewhat slower than the profile's.
HEADROOM = 0.85


class LoadFractionError(ValueError):
    """A load fraction outside (0, 1]."""


@dataclass(frozen=True)
class Level:
    """One load level: an open loop at ``request_rate`` req/s, or a closed
    loop of ``max_concurrency`` users (requests sent as soon as possible)."""

    request_rate: float
    max_concurrency: int | None = None
    #: The share of the measured capacity this rate is (``--load-fractions``).
    load_fraction: float | None = None
    #: A run the profiles are refitted to, before the levels named.
    calibration: bool = False
    #: Send only the first this many of the sample (``None``: all of it);
    #: see ``fit_to_time_left``.
    first_requests: int | None = None

    @property
    def open_loop_rate(self) -> float | None:
        """The request rate, ``None`` for a closed loop (JSON has no inf)."""
        return self.request_rate if math.isfinite(self.request_rate) else None

    @property
    def label(self) -> str:
        if self.calibration:
            return f"calibration run ({replace(self, calibration=False).label})"
        if self.max_concurrency is not None:
            return f"concurrency {self.max_concurrency}"
        if not math.isfinite(self.request_rate):
            return "capacity (all at once)"
        if self.load_fraction is not None:
            share = f"{100 * self.load_fraction:g}% of capacity"
            return f"rate {self.request_rate:.3g} ({share})"
        return f"rate {self.request_rate:g}"


def levels_of(
    rates: list[float] | None, concurrencies: list[int] | None
) -> list[Level]:
    """The levels the options name. Default (``--config`` and
    ``--disaggregated``, whose loads are fixed): 0.5 and 1 req/s, then 8
    users (``max_num_seqs``: every slot busy)."""
    levels = [Level(r) for r in rates or []]
    levels += [Level(math.inf, c) for c in concurrencies or []]
    return levels or [Level(0.5), Level(1.0), Level(math.inf, 8)]


def check_load_fractions(fractions: list[float]) -> None:
    """``LoadFractionError`` naming the first fraction outside (0, 1]."""
    for fraction in fractions:
        if not 0 < fraction <= 1:
            raise LoadFractionError(
                f"load fraction {fraction!r} is outside (0, 1]: a share of the "
                "measured capacity"
            )


def simulate_level(
    spec: EngineSpec,
    profile: Profile,
    specs: list[RequestSpec],
    max_concurrency: int | None,
) -> tuple[RunResult, dict[str, Any]]:
    """``specs`` through the simulated ``NeuronScheduler`` of ``spec``,
    each step charged by ``profile``: the run and the cost model's report
    (its steps charged exactly and interpolated)."""
    from neuron_scheduler.scheduler import NeuronScheduler
    from neuron_scheduler.sim.engines import Policy
    from neuron_scheduler.sim.profile_cost import ProfileCostModel
    from neuron_scheduler.sim.simulate import simulate

    settings = spec.simulated(profile.kv_cache)
    policy = Policy("static", NeuronScheduler, spec.neuron_config)
    cost = ProfileCostModel(profile)
    run = simulate(specs, policy, settings, cost, max_concurrency=max_concurrency)
    return run, cost.report()


@dataclass(frozen=True)
class Sizing:
    """The requests per level a time budget allows, and why."""

    requests_per_level: int
    budget_s: float
    #: Seconds spent before the levels (the profile, the server's start).
    spent_s: float
    #: The levels' predicted seconds at ``requests_per_level``.
    predicted_s: float
    #: How many times the profile timed each shape (``None``: not said).
    profile_repetitions: int | None = None
    #: The machine's slowest and fastest moment over its median while it
    #: profiled (``None``: not said).
    profile_speed_x: tuple[float, float] | None = None

    def describe(self) -> str:
        finish = self.spent_s + self.predicted_s
        text = (
            f"{self.requests_per_level} requests a level: the levels, simulated "
            f"with this machine's profile, take about {self.predicted_s:.0f} s; "
            f"with the {self.spent_s:.0f} s spent so far, about {finish / 60:.1f} "
            f"of the --time-budget's {round(self.budget_s / 60, 2):g} min"
        )
        if self.requests_per_level == FEWEST_REQUESTS and finish > self.budget_s:
            text += f" ({FEWEST_REQUESTS} at the fewest: past the budget)"
        return text + profile_note(self.profile_repetitions, self.profile_speed_x)

    def report(self) -> dict[str, Any]:
        return {
            "requests_per_level": self.requests_per_level,
            "budget_s": self.budget_s,
            "spent_s": round(self.spent_s, 1),
            "predicted_levels_s": round(self.predicted_s, 1),
            "profile_repetitions": self.profile_repetitions,
            "profile_speed_x": self.profile_speed_x,
        }


@dataclass(frozen=True)
class GivenCount:
    """A request count given with a time budget (a comparison's later
    serving: its first serving's count, and its own share of the budget):
    the levels send that many, cut at the measured capacity
    (``fit_to_time_left``) to end within ``budget_s``."""

    requests_per_level: int
    budget_s: float

    def report(self) -> dict[str, Any]:
        return {
            "requests_per_level": self.requests_per_level,
            "budget_s": self.budget_s,
            "given": True,
        }


def size_levels(
    spec: EngineSpec,
    profile: Profile,
    workload: WorkloadOptions,
    levels: list[Level],
    fractions: list[float] | None,
    budget_s: float,
    started: float,
) -> Sizing:
    """The requests per level that fit what is left of ``budget_s`` since
    ``started`` (``time.monotonic``): the ``levels`` (after a capacity
    run and a rate at each of ``fractions`` of the simulated capacity, if
    given) simulated at ``MOST_REQUESTS`` each, scaled down to fit."""
    spent = time.monotonic() - started
    cost = levels_cost(spec, profile, workload, levels, fractions)
    count = cost.fitting_count(budget_s - spent)
    repetitions = profile.meta.get("repetitions")
    drift = profile.meta.get("drift")
    return Sizing(
        count, budget_s, spent, cost.at(count),
        repetitions if isinstance(repetitions, int) else None,
        (drift["slowest_x"], drift["fastest_x"]) if isinstance(drift, dict) else None,
    )  # fmt: skip


def _fitting_count(
    left_s: float, per_request_s: float, overhead_s: float, most: int
) -> int:
    """The requests a level whose levels, at ``per_request_s`` a request
    (all levels together) beside ``overhead_s``, fill ``HEADROOM`` of
    ``left_s``: between ``FEWEST_REQUESTS`` (``most`` where that is fewer)
    and ``most``; ``most`` where a request costs nothing (none completes in
    the simulation: no time to share)."""
    if per_request_s <= 0:
        return most
    fitting = math.floor((HEADROOM * left_s - overhead_s) / per_request_s)
    return min(most, max(min(FEWEST_REQUESTS, most), fitting))


@dataclass(frozen=True)
class LevelsCost:
    """What a run's levels cost, simulated: ``per_request_s`` for each
    request a level (every level together) beside ``overhead_s``."""

    per_request_s: float
    overhead_s: float

    def at(self, count: int) -> float:
        """The levels' seconds at ``count`` requests a level."""
        return count * self.per_request_s + self.overhead_s

    def fitting_count(self, left_s: float, most: int = MOST_REQUESTS) -> int:
        """The requests a level that fill ``HEADROOM`` of ``left_s``
        (``_fitting_count``, at most ``most``)."""
        return _fitting_count(left_s, self.per_request_s, self.overhead_s, most)


def levels_cost(
    spec: EngineSpec,
    profile: Profile,
    workload: WorkloadOptions,
    levels: list[Level],
    fractions: list[float] | None,
) -> LevelsCost:
    """The ``levels`` (after a capacity run and a rate at each of
    ``fractions`` of the simulated capacity, if given) simulated at
    ``MOST_REQUESTS`` each: seconds per request over every level, summed,
    and the levels' fixed overhead (0.0 and 0.0 where no request
    completes)."""
    planned = list(levels)
    full = replace(workload, num_requests=MOST_REQUESTS)
    seconds = 0.0
    if fractions:
        capacity_run = _simulated_level(spec, profile, full, Level(math.inf))
        if not capacity_run.finish_s:  # nothing completes: nothing to time
            return LevelsCost(0.0, 0.0)
        seconds += capacity_run.duration_s
        capacity = steady_rate(capacity_run.finish_s)
        planned = [Level(f * capacity, load_fraction=f) for f in fractions] + planned
    num_requests = 1
    for level in planned:
        simulated = _simulated_level(spec, profile, full, level)
        seconds += simulated.duration_s
        num_requests = max(num_requests, simulated.num_requests)
    count = (len(planned) + bool(fractions)) or 1
    return LevelsCost(seconds / num_requests, count * LEVEL_OVERHEAD_S)


@dataclass(frozen=True)
class Resizing:
    """The levels' requests once the capacity is measured: the first
    ``requests_per_level`` of the sample, and why."""

    requests_per_level: int
    #: The sample's size (the capacity run's requests).
    sample: int
    left_s: float
    #: The levels' predicted seconds at ``requests_per_level``.
    predicted_s: float

    def describe(self) -> str:
        if self.requests_per_level == self.sample:
            return (
                f"at the measured capacity the levels take about "
                f"{self.predicted_s:.0f} s of the {self.left_s:.0f} s left: "
                f"{self.sample} requests a level"
            )
        text = (
            f"at the measured capacity {self.sample} requests a level would "
            f"not fit the {self.left_s:.0f} s left: the first "
            f"{self.requests_per_level} of them a level, about "
            f"{self.predicted_s:.0f} s"
        )
        if self.predicted_s > self.left_s:
            text += (
                f" ({self.requests_per_level} at the fewest: past the budget by "
                f"about {self.predicted_s - self.left_s:.0f} s)"
            )
        return text

    def report(self) -> dict[str, Any]:
        return {
            "requests_per_level": self.requests_per_level,
            "sample": self.sample,
            "left_s": round(self.left_s, 1),
            "predicted_levels_s": round(self.predicted_s, 1),
        }


def fit_to_time_left(
    spec: EngineSpec,
    profile: Profile,
    workload: WorkloadOptions,
    levels: list[Level],
    left_s: float,
) -> Resizing:
    """How many of the sample's requests (``workload.num_requests``, or all
    a trace holds where it holds fewer) the ``levels`` can send in
    ``left_s``, simulated with ``profile`` (after a capacity run: the rates
    are the measured capacity's shares, and the profile refitted to its
    steps). Never more than the sample, nor fewer than ``FEWEST_REQUESTS``;
    within ``HEADROOM`` of the time left, as ``size_levels``."""
    if workload.num_requests is None:
        raise ValueError("fit_to_time_left needs a sized workload")
    simulated = [_simulated_level(spec, profile, workload, lv) for lv in levels]
    sample = max((run.num_requests for run in simulated), default=0)
    cost = LevelsCost(
        sum(run.duration_s for run in simulated) / max(sample, 1),
        len(levels) * LEVEL_OVERHEAD_S,
    )
    count = cost.fitting_count(left_s, most=sample)
    return Resizing(count, sample, left_s, cost.at(count))


@dataclass(frozen=True)
class _SimulatedLevel:
    duration_s: float
    finish_s: list[float]
    #: The requests the workload held (a trace may hold fewer than asked).
    num_requests: int


def _simulated_level(
    spec: EngineSpec, profile: Profile, workload: WorkloadOptions, level: Level
) -> _SimulatedLevel:
    """``level`` simulated: its duration and its completion times."""
    specs, _ = level_requests(
        workload, level.request_rate, spec.max_model_len, level.first_requests
    )
    run, _ = simulate_level(spec, profile, specs, level.max_concurrency)
    finish = [r.finish_s for r in run.records if not r.failed]
    return _SimulatedLevel(max(finish, default=0.0), finish, len(specs))


def level_requests(
    workload: WorkloadOptions,
    request_rate: float,
    max_model_len: int,
    first: int | None = None,
) -> tuple[list[RequestSpec], FitReport]:
    """A level's requests at ``request_rate``: the same requests whatever
    the rate, so that the capacity run and the levels at its fractions
    replay one sample; with ``first``, only the first that many of it (in
    arrival order, the rest of the sample drawn all the same). Sent all at
    once (an infinite rate) they are drawn at ``BUILTIN_REQUEST_RATE`` and
    every arrival set to 0: the built-in workload draws its lengths between
    its arrival gaps, and would draw other lengths with no gaps to draw."""
    at_once = math.isinf(request_rate)
    drawn_rate = BUILTIN_REQUEST_RATE if at_once else request_rate
    drawn = draw_requests(replace(workload, request_rate=drawn_rate))[:first]
    if at_once:
        drawn = [replace(spec, arrival_s=0.0) for spec in drawn]
    return fit_to_model_len(drawn, max_model_len, clip=workload.clip_to_model_len)
