"""Admission inside the parent's own scan of the waiting queues.

``NeuronScheduler`` leaves waiting requests where they are. For one pass of
vLLM's ``Scheduler.schedule()`` it wraps ``waiting`` and
``kv_holding_waiting`` in ``AdmissionGate``: the parent walks them as usual
(``bool``, peek, pop to schedule or to pass over), and a gate shows it a
request only while ``StepAdmission`` admits it, so the parent's scan ends at
our first refusal. Everything the parent reads about the queues (``len``,
``get_request_counts``, which requests it passes over) stays true, and every
request it passes over goes back through the real queue's own methods.

``StepAdmission`` learns what became of each request the parent popped
before deciding on the next: a prefill started this step (``RUNNING``), a KV
load started (``WAITING_FOR_REMOTE_KVS``: the request now holds blocks but
computes nothing, so it is not a prefill), or passed over (nothing).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request, RequestStatus

from neuron_scheduler.admission import (
    AdmissionLimits,
    AdmissionRule,
    Candidate,
    StepOccupancy,
    admission_refusal,
)


class StepAdmission:
    """The admission decisions of one step, taken as the parent scans.

    ``candidate_of(request, holds_kv)`` describes a waiting request;
    ``is_ready(request)`` is ``False`` for a request in a blocked state that
    the parent will pass over itself (grammar compiling, KV still loading);
    ``on_refusal`` is told the rule of the step's first refusal.
    ``passes_over(request)`` is ``True`` for a ready request that vLLM's own
    rules pass over this step but the parent cannot tell while decodes are
    hidden from it (an adapter beyond ``max_loras``): the gate sets it aside.
    ``chunk_limit`` is the most tokens vLLM gives one prefill this step (its
    long-prefill threshold; 0: none); ``draft_slots`` the input slots vLLM
    also takes per scheduled request for parallel drafting (a packed
    follower must fit with them, or vLLM would cut it). ``holds_kv_of``
    tells whether a request holds KV blocks where its queue does not say
    (a queue whose ``holds_kv`` is ``None``). With ``decode_only`` (a decode
    pass) only prompt ends start, joining the decodes. After the first
    request that may not start, the step starts nothing more (FIFO), except,
    with ``holders_first`` (queues that mix holders and others, vLLM 0.29
    and 0.30), KV holders behind it, which later vLLMs drain first.
    """

    def __init__(
        self,
        limits: AdmissionLimits,
        occupancy: StepOccupancy,
        candidate_of: Callable[[Request, bool], Candidate],
        is_ready: Callable[[Request], bool],
        on_refusal: Callable[[AdmissionRule], None],
        chunk_limit: int = 0,
        draft_slots: int = 0,
        passes_over: Callable[[Request], bool] | None = None,
        holds_kv_of: Callable[[Request], bool] | None = None,
        holders_first: bool = False,
    ) -> None:
        self.limits = limits
        self.occupancy = occupancy
        self.decode_only = False
        #: Set once the step starts nothing more (the rule, if one refused).
        self.stopped = False
        self.refusal: AdmissionRule | None = None
        #: Holders may still start after a refusal (see ``_refuse``).
        self.holders_first = holders_first
        #: Set by the first refusal under ``holders_first``.
        self.holders_only = False
        self._candidate_of = candidate_of
        self._is_ready = is_ready
        self._on_refusal = on_refusal
        self._chunk_limit = chunk_limit
        self._draft_slots = draft_slots
        self._passes_over = passes_over
        self._holds_kv_of = holds_kv_of
        self._holds_kv_seen: dict[Request, bool] = {}
        #: The last request shown to the parent and how admission saw it
        #: (``None``: not ready, the parent passes it over).
        self._shown: tuple[Request, Candidate | None] | None = None
        #: Requests the parent popped since the last decision.
        self._popped: list[tuple[Request, Candidate | None]] = []

    def candidate(self, request: Request, holds_kv: bool) -> Candidate:
        """``request`` as admission sees it this step."""
        candidate = self._candidate_of(request, holds_kv)
        tokens = candidate.prefill_tokens
        if 0 < self._chunk_limit < tokens:
            tokens = self._chunk_limit
        return replace(candidate, prefill_tokens=tokens + self._draft_slots)

    def holds_kv(self, request: Request, queue_holds_kv: bool | None) -> bool:
        """Whether ``request`` holds KV blocks: its queue's ``holds_kv``, or,
        where that is ``None``, ``holds_kv_of(request)`` as first asked this
        step (before the parent promoted it: a finished load can reset a
        holder's computed tokens to 0)."""
        if queue_holds_kv is not None:
            return queue_holds_kv
        holds = self._holds_kv_seen.get(request)
        if holds is None:
            assert self._holds_kv_of is not None, "a mixed queue needs holds_kv_of"
            holds = self._holds_kv_seen[request] = self._holds_kv_of(request)
        return holds

    def first_ready(
        self,
        queues: Sequence[tuple[Iterable[Request], bool | None]],
        by_priority: bool = False,
    ) -> tuple[Request, bool] | None:
        """The first request of ``queues`` (each with its ``holds_kv``), in
        the parent's order, that is neither blocked nor passed over, with
        whether it holds KV. The parent drains the queues one after the
        other, or, ``by_priority``, takes the better head each time."""
        if by_priority:
            # Both queues mix holders and others here (vLLM 0.29, 0.30).
            merged = list(heapq.merge(*(iter(q) for q, _ in queues)))
            queues = [(merged, None)]
        # With holders_first, the holders (of any queue) come first, as the
        # queue of their own that later vLLMs drain first.
        for holders_pass in (True, False) if self.holders_first else (None,):
            for queue, queue_holds_kv in queues:
                for request in queue:
                    holds_kv = self.holds_kv(request, queue_holds_kv)  # pre-promotion
                    if holders_pass is not None and holds_kv is not holders_pass:
                        continue
                    if self._is_ready(request) and not self.passes_over(request):
                        return request, holds_kv
        return None

    def passes_over(self, request: Request) -> bool:
        """Should the gate set ``request`` aside this step (see class doc)?"""
        if self.stopped:
            return False
        if self.holders_only:
            return self._is_ready(request) and not self.holds_kv(request, None)
        return (
            self._passes_over is not None
            and self._is_ready(request)
            and self._passes_over(request)
        )

    def allows(self, request: Request, holds_kv: bool) -> bool:
        """May the parent look at ``request`` (the head of a waiting queue)?"""
        self._settle()
        if self.stopped:
            return False
        if not self._is_ready(request):
            self._shown = (request, None)
            return True
        candidate = self.candidate(request, holds_kv)
        refusal = admission_refusal(self.limits, self.occupancy, candidate)
        if self.decode_only and not candidate.prompt_end:
            # A decode step starts no prefill: say why only if a rule does
            # (the stall bound's or the DP throttle's turn).
            self._refuse(holds_kv, refusal if refusal in _TURN_RULES else None)
            return False
        if refusal is not None:
            self._refuse(holds_kv, refusal)
            return False
        self._shown = (request, candidate)
        return True

    def _refuse(self, holds_kv: bool, refusal: AdmissionRule | None) -> None:
        """Start nothing more this step, or, with ``holders_first`` and a
        request that holds no KV, nothing more but KV holders: vLLM 0.31 and
        later drain waiting holders before the others, so one never sits
        behind a refused request (before 0.31 they share a queue)."""
        if self.holders_first and not holds_kv and not self.holders_only:
            self.holders_only = True
            self._record(refusal)
        else:
            self._stop(refusal)

    def popped(self, request: Request) -> None:
        """The parent took ``request`` off a gated queue."""
        shown = self._shown
        candidate = shown[1] if shown is not None and shown[0] is request else None
        self._popped.append((request, candidate))
        self._shown = None

    def _stop(self, refusal: AdmissionRule | None) -> None:
        self.stopped = True
        self._record(refusal)

    def _record(self, refusal: AdmissionRule | None) -> None:
        """Note the step's first refusal (counted once)."""
        if self.refusal is None and refusal is not None:
            self.refusal = refusal
            self._on_refusal(refusal)

    def _settle(self) -> None:
        """Count what the popped requests became: started (``RUNNING``: a
        prefill, or a prompt end joining the step), a KV load started (a new
        holder that computes nothing yet), or passed over (nothing)."""
        occupancy = self.occupancy
        for request, candidate in self._popped:
            if candidate is None:
                continue
            new_holder = 0 if candidate.holds_kv else 1
            if request.status == RequestStatus.RUNNING:
                prefill = 0 if candidate.prompt_end else 1
                # Hits found by the parent (a synchronous KV load) lower it.
                tokens = min(
                    candidate.prefill_tokens,
                    request.num_tokens
                    - request.num_computed_tokens
                    + self._draft_slots,
                )
                occupancy = replace(
                    occupancy,
                    num_admitted=occupancy.num_admitted + 1,
                    # A waiting holder now runs: it leaves the loading.
                    num_loading=occupancy.num_loading - (1 - new_holder),
                    num_prefills=occupancy.num_prefills + prefill,
                    admitted_tokens=occupancy.admitted_tokens + tokens,
                    kv_holders=occupancy.kv_holders + new_holder,
                    kv_blocks_committed=occupancy.kv_blocks_committed
                    + candidate.kv_blocks_needed,
                )
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                occupancy = replace(
                    occupancy,
                    kv_holders=occupancy.kv_holders + new_holder,
                    num_loading=occupancy.num_loading + new_holder,
                    kv_blocks_committed=occupancy.kv_blocks_committed
                    + candidate.kv_blocks_needed,
                )
        self._popped.clear()
        self.occupancy = occupancy


#: Refusals that give a whole step to the decodes.
_TURN_RULES = (
    AdmissionRule.DECODE_TURN,
    AdmissionRule.DP_THROTTLE,
    AdmissionRule.PREFILL_INTERVAL,
)


class AdmissionGate(RequestQueue):
    """A waiting queue as the parent sees it during one pass.

    Non-empty (``bool``) only while ``admission`` allows its head; with
    ``admission=None`` the gate is shut. A head that admission passes over
    is set aside (``passed_over``) until ``restore()`` puts it back in front.
    In a ``GateGroup`` it is non-empty only while the parent's next pick
    across the group is its head. Every other operation, ``len`` included,
    is the real queue's.
    """

    def __init__(
        self,
        queue: RequestQueue,
        admission: StepAdmission | None,
        holds_kv: bool | None,
        group: GateGroup | None = None,
    ) -> None:
        self.queue = queue
        self.admission = admission
        self.holds_kv = holds_kv
        self.passed_over: list[Request] = []
        self.group = group
        if group is not None:
            group.gates.append(self)

    def __bool__(self) -> bool:
        admission = self.admission
        if admission is None:
            return False
        if self.group is None:
            head = self.head()
            return head is not None and admission.allows(
                head, admission.holds_kv(head, self.holds_kv)
            )
        while True:
            pick = self.group.pick()
            if pick is None or pick[0] is not self:
                return False
            head = pick[1]
            if admission.allows(head, admission.holds_kv(head, self.holds_kv)):
                return True
            if admission.stopped:
                return False
            # Only holders may start now: the next pick sets this one aside.

    def head(self) -> Request | None:
        """The queue's head once the heads admission passes over are set
        aside (``None``: nothing left)."""
        admission = self.admission
        assert admission is not None
        while self.queue:
            head = self.queue.peek_request()
            if not admission.passes_over(head):
                return head
            self.passed_over.append(self.queue.pop_request())
        return None

    def restore(self) -> list[Request]:
        """Put the requests set aside back in front of the queue, in their
        order (ahead of any the parent passed over itself), and return them."""
        passed_over, self.passed_over = self.passed_over, []
        if passed_over:
            # prepend_requests reverses (FCFS): vLLM's own convention.
            self.queue.prepend_requests(reversed(passed_over))
        return passed_over

    def pop_request(self) -> Request:
        request = self.queue.pop_request()
        if self.admission is not None:
            self.admission.popped(request)
        return request

    def peek_request(self) -> Request:
        return self.queue.peek_request()

    def add_request(self, request: Request) -> None:
        self.queue.add_request(request)

    def prepend_request(self, request: Request) -> None:
        self.queue.prepend_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self.queue.prepend_requests(requests)

    def remove_request(self, request: Request) -> None:
        self.queue.remove_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        self.queue.remove_requests(requests)

    def __len__(self) -> int:
        return len(self.queue) + len(self.passed_over)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.queue)


class GateGroup:
    """The gates of one pass over waiting queues that the parent asks all of
    before it picks one (``SchedulerFeatures.picks_across_queues``): the
    first gate with a head, in the parent's order, or ``by_priority`` the
    gate with the better head."""

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self.gates: list[AdmissionGate] = []

    def pick(self) -> tuple[AdmissionGate, Request] | None:
        """The gate the parent draws from next, with its head."""
        heads = [(g, h) for g in self.gates if (h := g.head()) is not None]
        if not heads:
            return None
        if self.by_priority:
            return min(heads, key=lambda pair: pair[1])  # the first on a tie
        return heads[0]
