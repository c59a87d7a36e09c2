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

from collections.abc import Callable, Iterable, Iterator
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
    follower must fit with them, or vLLM would cut it). With ``decode_only``
    (a decode pass) only prompt ends start, joining the decodes. After the
    first request that may not start, the step starts nothing more (FIFO).
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
    ) -> None:
        self.limits = limits
        self.occupancy = occupancy
        self.decode_only = False
        #: Set once the step starts nothing more (the rule, if one refused).
        self.stopped = False
        self.refusal: AdmissionRule | None = None
        self._candidate_of = candidate_of
        self._is_ready = is_ready
        self._on_refusal = on_refusal
        self._chunk_limit = chunk_limit
        self._draft_slots = draft_slots
        self._passes_over = passes_over
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

    def first_ready(
        self, queues: Iterable[tuple[RequestQueue, bool]]
    ) -> tuple[Request, bool] | None:
        """The first request of ``queues`` (each with its ``holds_kv``), in
        the parent's order, that is neither blocked nor passed over, with its
        ``holds_kv``."""
        for queue, holds_kv in queues:
            for request in queue:
                if self._is_ready(request) and not self.passes_over(request):
                    return request, holds_kv
        return None

    def passes_over(self, request: Request) -> bool:
        """Should the gate set ``request`` aside this step (see class doc)?"""
        return (
            self._passes_over is not None
            and not self.stopped
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
            self._stop(refusal if refusal in _TURN_RULES else None)
            return False
        if refusal is not None:
            self._stop(refusal)
            return False
        self._shown = (request, candidate)
        return True

    def popped(self, request: Request) -> None:
        """The parent took ``request`` off a gated queue."""
        shown = self._shown
        candidate = shown[1] if shown is not None and shown[0] is request else None
        self._popped.append((request, candidate))
        self._shown = None

    def _stop(self, refusal: AdmissionRule | None) -> None:
        self.stopped = True
        self.refusal = refusal
        if refusal is not None:
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
                    kv_blocks_committed=occupancy.kv_blocks_committed
                    + candidate.kv_blocks_needed,
                )
        self._popped.clear()
        self.occupancy = occupancy


#: Refusals that give a whole step to the decodes.
_TURN_RULES = (AdmissionRule.DECODE_TURN, AdmissionRule.DP_THROTTLE)


class AdmissionGate(RequestQueue):
    """A waiting queue as the parent sees it during one pass.

    Non-empty (``bool``) only while ``admission`` allows its head; with
    ``admission=None`` the gate is shut. A head that admission passes over
    is set aside (``passed_over``) until ``restore()`` puts it back in front.
    Every other operation, ``len`` included, is the real queue's.
    """

    def __init__(
        self, queue: RequestQueue, admission: StepAdmission | None, holds_kv: bool
    ) -> None:
        self.queue = queue
        self.admission = admission
        self.holds_kv = holds_kv
        self.passed_over: list[Request] = []

    def __bool__(self) -> bool:
        admission = self.admission
        if admission is None:
            return False
        while self.queue:
            head = self.queue.peek_request()
            if not admission.passes_over(head):
                return admission.allows(head, self.holds_kv)
            self.passed_over.append(self.queue.pop_request())
        return False

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
