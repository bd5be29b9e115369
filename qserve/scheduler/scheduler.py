"""Continuous batching for one model, in the manner of vLLM v1.

Each ``schedule()`` picks the work of one step under a token budget (``max_num_batched_tokens``)
and a sequence cap (``max_num_seqs``): first the RUNNING requests in FCFS (arrival) order —
a decode takes 1 token, a prompt still being prefilled takes its next chunk (chunked
prefill) — then WAITING requests in FCFS order, using prefix-cache hits, while budget, seats
and pages last. When pages run out for a running request, the newest running request is
preempted by recompute (its pages are freed; it goes back to the FRONT of the waiting queue
and later recomputes its prompt and the outputs it had so far).

Swap preemption (``set_preemption_mode("swap" | "auto", ...)``, vLLM V0's ``preemption_mode``):
the victim's computed blocks are given host slots (``HostSwapSpace``) and listed in
``SchedulerOutput.blocks_to_swap_out``; its device pages are freed and it waits at the front of
the queue as SWAPPED. When it is admitted again it gets new device pages, listed with its slots in
``blocks_to_swap_in``, and resumes where it stopped: nothing is recomputed. The runner makes the
copies before the step's forward. A victim falls back to recompute when it has no computed KV,
when the host slots run out, or (``auto``) when ``SwapCost`` says recomputing is cheaper. Blocks
shared with other requests (prefix-cache hits) are copied like the others and the request's
reference dropped; swapped back in, they are private copies (re-registered in the prefix cache
only where no other block holds their hash).

Tenants (``set_tenants``; off by default, and then nothing above changes): requests carry the
tenant of the API key that sent them. Seats are shared by weight: the next waiting request
comes from the tenant with the fewest running sequences per unit of weight (FCFS within a
tenant; a tenant at its ``max_running`` waits), and a tenant below its weighted share of the
seats (``max_num_seqs * weight / sum of the busy tenants' weights``) that has a request waiting
takes a seat from the tenant furthest above its share: that tenant's newest running request is
preempted before the step is built. When pages run out, the victim is likewise the newest
request of the tenant holding the most pages per unit of weight. So one tenant flooding the
server cannot hold every seat while another waits.

Async scheduling (``async_scheduling=True``, vLLM's name): the engine schedules step N+1 while
step N still runs, so ``schedule()`` itself advances each scheduled request's computed tokens and
gives every sampling one a placeholder for the token step N will sample
(``Request.num_output_placeholders``); the next step plans as if that token were there (a decode
of it). ``update_from_output`` then only swaps placeholders for the sampled tokens. A request
with a placeholder is never admitted from the waiting queue (a preempted one waits a step for
its token) and never finished for capacity on the strength of its placeholder.

Speculative decoding (``Request.spec_token_ids``, set by the engine before ``schedule()``): a
running request in plain decode is scheduled as its last known token plus its draft tokens
(``ScheduledSequence.spec_token_ids``), KV slots allocated for all of them, within the token
budget, ``max_model_len`` and what the pool can hold; drafts that find no pages are dropped (a
plain decode), never the reason for a preemption. ``update_from_output`` appends the tokens the
runner emitted (accepted drafts, then the target's token), counts only their KV as computed (so
the prefix cache registers accepted tokens only) and frees the pages only rejected drafts reached.

Knows: requests' token counters and statuses, the waiting / running queues, this model's
``KVCacheManager``, tenants' weights and seat caps. Must not know: torch, tensors, text, stop conditions (the engine decides
when a request is finished and calls ``finish_request``), other models' queues.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Mapping

from qserve.request import Request, RequestStatus
from qserve.scheduler.kv_cache_manager import KVCacheManager
from qserve.scheduler.output import RunnerOutput, ScheduledSequence, SchedulerOutput
from qserve.scheduler.request_queue import RequestQueue
from qserve.scheduler.swap import HostSwapSpace, SwapCost, check_preemption_mode

logger = logging.getLogger(__name__)


def _arrival(request: Request) -> int:
    return request.arrival_index


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        watermark: float = 0.0,
        watermark_per_running: int = 0,
        async_scheduling: bool = False,
        max_loras: int | None = None,
    ) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a fraction of the KV pages in [0, 1), got {watermark}")
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0 or max_model_len <= 0:
            raise ValueError(
                "max_num_seqs, max_num_batched_tokens and max_model_len must be positive, got "
                f"{max_num_seqs}, {max_num_batched_tokens}, {max_model_len}"
            )
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # Admission keeps this share of the model's pages free (vLLM's watermark) plus this many
        # pages per running request: room for the running requests to grow a while before one has
        # to be preempted and recomputed (measured in bench/RESULTS.md: fewer recomputes).
        self.watermark = watermark
        self.watermark_per_running = watermark_per_running
        self.async_scheduling = async_scheduling
        # LoRA (None: off): at most this many distinct adapters among the running requests, so every
        # step's adapters fit the device slots. A waiting request on another adapter waits; requests
        # behind it that fit (the base model, a running adapter) go ahead of it.
        self.max_loras = max_loras
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue()  # FCFS; preempted requests re-enter at the front; O(1) removal
        self.running: list[Request] = []  # sorted by arrival_index: the newest is last
        self._finished_ids: list[str] = []  # finished since the last schedule()
        self.tenant_weights: dict[str | None, float] = {}  # empty: no tenants, plain FCFS
        self.tenant_max_running: dict[str | None, int] = {}
        self.default_tenant_weight = 1.0  # requests of tenants not listed (e.g. no tenant)
        # Preemption: "recompute" unless set_preemption_mode says otherwise.
        self.preemption_mode = "recompute"
        self.swap_space: HostSwapSpace | None = None
        self.swap_cost: SwapCost | None = None
        self.num_swapped_out = 0  # preemptions that went to the host (qserve:num_swapped_out_total)
        self.num_swapped_in = 0
        self._blocks_to_swap_out: list[tuple[int, int]] = []  # this step's, see SchedulerOutput
        self._blocks_to_swap_in: list[tuple[int, int]] = []
        self._swapped_out_ids: list[str] = []

    # ---------------------------------------------------------------- preemption mode
    def set_preemption_mode(
        self, mode: str, swap_space: HostSwapSpace | None = None, swap_cost: SwapCost | None = None
    ) -> None:
        """``recompute`` (default), ``swap`` (needs ``swap_space``) or ``auto`` (needs both: swap
        where ``swap_cost`` says it is cheaper). Only while no request is swapped out."""
        check_preemption_mode(mode)
        if mode != "recompute" and swap_space is None:
            raise ValueError(f"preemption_mode={mode!r} needs a host swap space (swap_space > 0)")
        if mode == "auto" and swap_cost is None:
            raise ValueError("preemption_mode='auto' needs a swap cost estimate")
        if self.swap_space is not None and self.swap_space.num_swapped:
            raise RuntimeError("set_preemption_mode: requests are swapped out")
        self.preemption_mode = mode
        self.swap_space = swap_space if mode != "recompute" else None
        self.swap_cost = swap_cost

    # ---------------------------------------------------------------- tenants
    def set_tenants(self, weights: Mapping[str, float], max_running: Mapping[str, int | None] | None = None) -> None:
        """Share seats between tenants by ``weights``; ``max_running`` caps a tenant's running sequences."""
        bad = {name: w for name, w in weights.items() if not w > 0}
        if bad:
            raise ValueError(f"tenant weights must be positive, got {bad}")
        self.tenant_weights = dict(weights)
        self.tenant_max_running = {k: v for k, v in (max_running or {}).items() if v is not None}

    def _weight(self, tenant: str | None) -> float:
        return self.tenant_weights.get(tenant, self.default_tenant_weight)

    def _running_by_tenant(self) -> dict[str | None, int]:
        counts: dict[str | None, int] = {}
        for request in self.running:
            counts[request.tenant] = counts.get(request.tenant, 0) + 1
        return counts

    def _next_waiting(
        self, running: dict[str | None, int], admissible: Callable[[Request], bool] | None = None
    ) -> Request | None:
        """The oldest waiting request of the tenant with the fewest running sequences per weight
        (tenants at their seat cap skipped); plain FCFS without tenants. ``admissible``: requests it
        refuses are passed over (LoRA: an adapter without a free slot), the ones behind them may go."""
        if not self.tenant_weights:
            if admissible is None:
                return self.waiting.peek()
            return next((request for request in self.waiting if admissible(request)), None)
        best: Request | None = None
        best_key: tuple[float, int] | None = None
        seen: set[str | None] = set()
        for request in self.waiting:
            if admissible is not None and not admissible(request):
                continue
            tenant = request.tenant
            if tenant in seen:
                continue
            seen.add(tenant)
            cap = self.tenant_max_running.get(tenant)
            if cap is not None and running.get(tenant, 0) >= cap:
                continue
            key = (running.get(tenant, 0) / self._weight(tenant), request.arrival_index)
            if best_key is None or key < best_key:
                best, best_key = request, key
        return best

    def _preempt_for_fair_share(self) -> list[str]:
        """Free seats for waiting tenants below their weighted share, taking them from the tenants
        furthest above theirs (newest request first). Runs before the step is built."""
        preempted: list[str] = []
        while self.waiting and len(self.running) >= self.max_num_seqs:
            running = self._running_by_tenant()
            busy = set(running) | {r.tenant for r in self.waiting}
            total = sum(self._weight(t) for t in busy)
            claimant = self._next_waiting(running)
            if claimant is None:
                return preempted
            share = self.max_num_seqs * self._weight(claimant.tenant) / total
            if running.get(claimant.tenant, 0) + 1 > share:
                return preempted  # at its share already: it waits for a seat like everyone
            # Running sequences above the weighted share, per tenant.
            excess = {t: n - self.max_num_seqs * self._weight(t) / total for t, n in running.items()}
            over = max(excess, key=excess.__getitem__)
            if excess[over] <= 0:
                return preempted
            victim = next(r for r in reversed(self.running) if r.tenant == over)
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim.request_id)
        return preempted

    def _pages_per_weight(self) -> dict[str | None, float]:
        """Pages each tenant's running requests hold, per unit of its weight."""
        pages: dict[str | None, int] = {}
        for request in self.running:
            held = len(self.kv_cache_manager.block_table(request.request_id))
            pages[request.tenant] = pages.get(request.tenant, 0) + held
        return {tenant: n / self._weight(tenant) for tenant, n in pages.items()}

    def _running_order(self) -> list[Request]:
        """The order in which running requests get this step's tokens and pages."""
        if not self.tenant_weights:
            return list(self.running)  # FCFS: running is sorted by arrival
        usage = self._pages_per_weight()
        return sorted(self.running, key=lambda r: (usage[r.tenant], r.arrival_index))

    def _page_victim(self, candidates: list[Request]) -> Request:
        """Whom to preempt when pages run out: the newest candidate; with tenants, the newest of the
        tenant holding the most pages per unit of weight (``candidates`` are not yet in this step)."""
        if not self.tenant_weights:
            return candidates[-1]
        usage = self._pages_per_weight()
        over = max(dict.fromkeys(r.tenant for r in candidates), key=usage.__getitem__)  # ties: the first
        return next(r for r in reversed(candidates) if r.tenant == over)

    # ---------------------------------------------------------------- queries
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        """Waiting requests whose KV is in host memory (counted in ``num_waiting`` too)."""
        return 0 if self.swap_space is None else self.swap_space.num_swapped

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # ---------------------------------------------------------------- lifecycle
    def add_request(self, request: Request) -> None:
        num_prompt = request.num_prompt_tokens
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already in the scheduler")
        if num_prompt == 0:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        if num_prompt > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {num_prompt} tokens exceeds "
                f"max_model_len={self.max_model_len}"
            )
        kv = self.kv_cache_manager
        if kv.num_blocks_for(request.num_tokens) > kv.max_num_blocks:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {num_prompt} tokens can never fit in the KV "
                f"cache, which holds at most {kv.max_num_tokens} tokens ({kv.max_num_blocks} blocks of "
                f"{kv.block_size}) for this model"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a request (the engine decided: stop / length / abort); its pages are freed now.

        Returns the request, or None if the scheduler does not know it (already finished).
        """
        if not status.is_finished:
            raise ValueError(f"finish_request: {status} is not a finished status")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self._remove_running(request)
        else:
            self.waiting.remove(request_id)
            if self.swap_space is not None:
                self.swap_space.release(request_id)  # its host slots (only copies still to come read them)
        self.kv_cache_manager.free(request)
        request.status = status
        self._finished_ids.append(request_id)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    # ---------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        sequences: list[ScheduledSequence] = []
        preempted_ids: list[str] = []
        capacity_finished_ids: list[str] = []
        num_spec_tokens = 0

        max_num_tokens = kv.max_num_tokens  # fixed by the pool's shares: read once per step
        if self.tenant_weights:
            preempted_ids += self._preempt_for_fair_share()
        short_of_pages = False

        # 1. RUNNING requests, FCFS (with tenants: those holding the fewest pages per weight first,
        # so that when pages run out the victims, never taken from requests already in this step,
        # belong to the tenants holding the most).
        queue = self._running_order()
        index = 0
        while index < len(queue) and budget > 0:
            request = queue[index]
            num_tokens = request.num_tokens + request.num_output_placeholders
            if num_tokens > max_num_tokens and request.num_output_placeholders:
                index += 1  # its in-flight token decides (as without async scheduling): next step
                continue
            if num_tokens > max_num_tokens:  # more blocks than this model can ever hold
                self._finish_for_capacity(request)
                capacity_finished_ids.append(request.request_id)
                del queue[index]
                continue
            num_new = min(num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (no token was sampled for it); leave it be
                index += 1
                continue
            spec = request.spec_token_ids
            if spec:  # drafts to verify after its last token: only a decode, and only what fits
                request.spec_token_ids = []
                spec = self._fit_drafts(request, spec, num_new, budget, max_num_tokens)
            scheduled = True
            if spec and not kv.allocate_slots(request, num_new + len(spec)):
                spec = []  # no pages for the drafts: a plain decode (which may still preempt)
            while not spec and not kv.allocate_slots(request, num_new):
                short_of_pages = True
                victim = self._page_victim(queue[index:])  # never one already in this step
                queue.remove(victim)
                self.running.remove(victim)
                self._preempt(victim)
                preempted_ids.append(victim.request_id)
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                continue  # it gave up its own pages; the next one is at ``index`` now
            sequences.append(self._scheduled(request, num_new, spec))
            budget -= num_new + len(spec)
            num_spec_tokens += len(spec)
            index += 1

        # 2. WAITING requests, strict FCFS. Not in a step that had to preempt: pages are short.
        if not short_of_pages:
            watermark_share = math.ceil(self.watermark * kv.max_num_blocks)
            running_by_tenant = self._running_by_tenant() if self.tenant_weights else {}
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self._next_waiting(running_by_tenant, self._lora_fit())
                if request is None:
                    break  # every waiting tenant is at its seat cap, or needs an adapter slot the running hold
                if request.num_output_placeholders:
                    break  # preempted while its last step was in flight: its token lands after this step
                if request.num_tokens > max_num_tokens:  # more blocks than this model can ever hold
                    self._finish_for_capacity(request)
                    capacity_finished_ids.append(request.request_id)
                    continue
                swapped = request.status == RequestStatus.SWAPPED
                if swapped:  # its KV comes back from the host: no prefix-cache lookup, nothing recomputed
                    computed_blocks, num_computed = [], request.num_computed_tokens
                else:
                    assert request.num_computed_tokens == 0, "a waiting request holds no KV"
                    computed_blocks, num_computed = kv.get_computed_blocks(request)
                num_new = min(request.num_tokens - num_computed, budget)
                reserve = 0  # an idle model admits whatever fits
                if self.running:
                    reserve = watermark_share + self.watermark_per_running * len(self.running)
                if not kv.allocate_slots(request, num_new, computed_blocks, reserve=reserve):
                    break  # no skipping ahead: later requests wait for this one
                self.waiting.remove(request.request_id)  # O(1), wherever the tenant pick took it from
                if self.tenant_weights:
                    running_by_tenant[request.tenant] = running_by_tenant.get(request.tenant, 0) + 1
                if swapped:
                    self._swap_in(request)
                else:
                    request.num_computed_tokens = num_computed
                    request.num_cached_tokens = num_computed
                request.status = RequestStatus.RUNNING
                bisect.insort(self.running, request, key=_arrival)
                sequences.append(self._scheduled(request, num_new))
                budget -= num_new

        finished_ids, self._finished_ids = self._finished_ids, []
        swap_out, self._blocks_to_swap_out = self._blocks_to_swap_out, []
        swap_in, self._blocks_to_swap_in = self._blocks_to_swap_in, []
        swapped_out_ids, self._swapped_out_ids = self._swapped_out_ids, []
        if self.swap_space is not None:
            self.swap_space.end_step()
        if self.async_scheduling:
            for seq in sequences:  # the step counts as done; its sampled tokens as placeholders
                request = self.requests[seq.request_id]
                request.num_computed_tokens += seq.num_new_tokens
                if seq.sample:
                    request.num_output_placeholders += 1
        return SchedulerOutput(
            sequences=sequences,
            num_batched_tokens=self.max_num_batched_tokens - budget,
            preempted_request_ids=preempted_ids,
            finished_request_ids=finished_ids,
            capacity_finished_request_ids=capacity_finished_ids,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            swapped_out_request_ids=swapped_out_ids,
            num_spec_tokens=num_spec_tokens,
        )

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Advance every scheduled sequence, append sampled tokens, cache newly full blocks.

        Returns the requests that received a new token this step (the engine checks their
        stop conditions and calls ``finish_request``). Sequences finished or aborted since
        ``schedule()`` are skipped.
        """
        if self.async_scheduling:
            return self._update_from_async_output(scheduler_output, runner_output)
        kv = self.kv_cache_manager
        block_size = kv.block_size
        requests = self.requests
        running = RequestStatus.RUNNING
        sampled = runner_output.sampled_token_ids
        with_new_token: list[Request] = []
        for seq in scheduler_output.sequences:
            request = requests.get(seq.request_id)
            if request is None or request.status != running:
                continue
            num_computed = request.num_computed_tokens
            request.num_computed_tokens = num_computed + seq.num_new_tokens
            if seq.spec_token_ids:
                self._accept_drafts(request, seq, runner_output)
                with_new_token.append(request)
            elif seq.sample:
                token_id = sampled.get(seq.request_id)
                if token_id is not None:
                    request.output_token_ids.append(token_id)
                    with_new_token.append(request)
            # Blocks that are full and computed are registered in every step they become so;
            # a step that fills no block (most decode steps) has nothing new to register.
            if request.num_computed_tokens // block_size != num_computed // block_size:
                kv.cache_full_blocks(request)
        return with_new_token

    def _update_from_async_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[Request]:
        """``update_from_output`` under async scheduling: ``schedule()`` already advanced the
        computed tokens; swap each placeholder for its sampled token. A request preempted since
        (waiting again) still gets its token, as it would have without async scheduling; one
        finished or aborted since is skipped: its extra token is dropped."""
        kv = self.kv_cache_manager
        block_size = kv.block_size
        requests = self.requests
        running = RequestStatus.RUNNING
        sampled = runner_output.sampled_token_ids
        with_new_token: list[Request] = []
        for seq in scheduler_output.sequences:
            request = requests.get(seq.request_id)
            if request is None:
                continue
            end = seq.start_position + seq.num_new_tokens
            if seq.spec_token_ids:  # processed before the next schedule (the engine sees to it)
                request.num_output_placeholders -= 1
                end = self._accept_drafts(request, seq, runner_output)
                with_new_token.append(request)
            elif seq.sample:
                request.num_output_placeholders -= 1
                token_id = sampled.get(seq.request_id)
                if token_id is not None:
                    request.output_token_ids.append(token_id)
                    with_new_token.append(request)
            if request.status == running and end // block_size != seq.start_position // block_size:
                kv.cache_full_blocks(request)  # its tokens are all known now; later steps run after it
        return with_new_token

    # ---------------------------------------------------------------- speculative decoding
    def _fit_drafts(
        self, request: Request, spec: list[int], num_new: int, budget: int, max_num_tokens: int
    ) -> list[int]:
        """The drafts this step can verify after the request's last token: none unless it is a
        plain decode of known tokens; at most what the token budget, ``max_model_len`` and the
        pages this model can ever hold leave room for."""
        num_tokens = request.num_tokens
        if num_new != 1 or request.num_output_placeholders or request.num_computed_tokens != num_tokens - 1:
            return []
        room = min(budget - 1, self.max_model_len - num_tokens - 1, max_num_tokens - num_tokens)
        return spec[:room] if room > 0 else []

    def _accept_drafts(self, request: Request, seq: ScheduledSequence, runner_output: RunnerOutput) -> int:
        """Append the tokens the step emitted for a sequence with drafts (accepted drafts, then the
        target's own token); only the accepted drafts' KV counts as computed, and the pages past
        the tokens now known go back to the pool (the rejected drafts' slots). Returns the
        computed-token count, which is all the prefix cache may register."""
        tokens = runner_output.spec_token_ids[seq.request_id]
        num_rejected = len(seq.spec_token_ids) - (len(tokens) - 1)
        assert tokens and num_rejected >= 0, (seq.request_id, tokens, seq.spec_token_ids)
        request.output_token_ids.extend(tokens)
        request.num_computed_tokens = seq.start_position + seq.num_new_tokens - num_rejected
        if request.status == RequestStatus.RUNNING:
            self.kv_cache_manager.free_tail(request, request.num_tokens)
        return request.num_computed_tokens

    # ---------------------------------------------------------------- helpers
    def _lora_fit(self) -> Callable[[Request], bool] | None:
        """Whether admitting a request keeps the running requests' distinct adapters within
        ``max_loras`` (None: LoRA is off, every request fits)."""
        if self.max_loras is None:
            return None
        active = {r.lora_id for r in self.running if r.lora_id is not None}
        free = len(active) < self.max_loras
        return lambda request: request.lora_id is None or free or request.lora_id in active

    def _scheduled(self, request: Request, num_new: int, spec: list[int] | tuple[()] = ()) -> ScheduledSequence:
        start = request.num_computed_tokens
        return ScheduledSequence(
            request_id=request.request_id,
            start_position=start,
            num_new_tokens=num_new + len(spec),
            block_ids=self.kv_cache_manager.block_table(request.request_id),
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            sampling_params=request.sampling_params,
            sample=start + num_new == request.num_tokens + request.num_output_placeholders,
            pooling=request.pooling,
            lora_id=request.lora_id,
            spec_token_ids=spec,
        )

    def _preempt(self, request: Request) -> None:
        """Preempt by swap where the mode and the host slots allow, else by recompute (drop its
        KV); either way it goes back to the waiting queue (FCFS position)."""
        request.num_preemptions += 1
        request.spec_token_ids = []
        if self._swap_out(request):
            request.status = RequestStatus.SWAPPED
        else:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
        # Front of the queue, but behind any older waiting request (keeps FCFS by arrival).
        self.waiting.push_front_by_arrival(request)
        logger.debug("preempted request %s (preemption #%d)", request.request_id, request.num_preemptions)

    def _swap_out(self, request: Request) -> bool:
        """Give the request's computed blocks host slots and free its device pages; False (nothing
        changed) when it is to be recomputed instead."""
        space = self.swap_space
        if space is None or request.num_computed_tokens == 0:
            return False
        kv = self.kv_cache_manager
        num_blocks = kv.num_blocks_for(request.num_computed_tokens)  # blocks holding computed KV
        if self.preemption_mode == "auto":
            assert self.swap_cost is not None
            if not self.swap_cost.prefer_swap(num_blocks, request.num_computed_tokens):
                return False
        slots = space.swap_out(request.request_id, num_blocks)
        if slots is None:  # the host pool is full
            return False
        table = kv.block_table(request.request_id)
        assert len(table) >= num_blocks, "a running request's table covers its computed tokens"
        self._blocks_to_swap_out.extend(zip(table[:num_blocks], slots))
        self._swapped_out_ids.append(request.request_id)
        self.num_swapped_out += 1
        kv.free(request)  # after the pairs are taken: free() drops the table
        return True

    def _swap_in(self, request: Request) -> None:
        """Pair the request's host slots with the head of its new block table (just allocated)."""
        assert self.swap_space is not None
        slots = self.swap_space.swap_in(request.request_id)
        table = self.kv_cache_manager.block_table(request.request_id)
        assert len(table) >= len(slots), "the new table covers every swapped-out block"
        self._blocks_to_swap_in.extend(zip(slots, table))
        self.num_swapped_in += 1

    def _remove_running(self, request: Request) -> None:
        """Remove from ``running`` by binary search on arrival (``list.remove`` scanned it)."""
        running = self.running
        index = bisect.bisect_left(running, request.arrival_index, key=_arrival)
        while index < len(running) and running[index] is not request:
            index += 1  # equal arrival indices (only in hand-built tests): step past the others
        if index == len(running):
            running.remove(request)  # not sorted as expected; still correct
        else:
            del running[index]

    def _finish_for_capacity(self, request: Request) -> None:
        logger.warning(
            "request %s: %d tokens no longer fit in the KV cache (at most %d for this model); finishing it",
            request.request_id,
            request.num_tokens,
            self.kv_cache_manager.max_num_tokens,
        )
        self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
