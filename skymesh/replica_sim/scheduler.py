"""The stand-in engine's scheduler: vLLM-v1-like continuous batching, one iteration at a
time, pure (no clock, no I/O). It owns the queues and the admission and preemption policy;
KV blocks come from the :class:`~skymesh.replica_sim.block_pool.BlockPool`.

Per step (``Scheduler.step(now)``):
1. running requests in decode get one token each; a decode that crosses into a new KV
   block allocates one (free blocks first, then LRU eviction of unreferenced cached blocks);
   when none is left the most recently admitted running request is preempted (recompute:
   blocks released, back to the FRONT of the waiting queue — vLLM v1's policy).
2. running requests still in prefill continue their chunk within the token budget
   (``max_num_batched_tokens``, chunked prefill).
3. waiting requests are admitted FCFS while ``max_num_seqs`` and the KV cache allow: the
   longest run of cached full blocks (chained block hashes) is reused, the rest of the
   prompt gets fresh blocks, and its first prefill chunk joins the step.
The step's duration follows the profile's cost model; its tokens appear at ``now +
duration``. Every step is O(batch + newly admitted prompt blocks): requests carry their own
state so no list membership test or removal scans the batch per request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from skymesh.hardware import Profile, prefill_pairs
from skymesh.replica_sim.block_pool import BlockPool
from skymesh.replica_sim.kv_events import StandInEvent
from skymesh.replica_sim.request_state import DONE, RUNNING, WAITING, EngineRequest


@dataclass(slots=True)
class StepOutput:
    duration_s: float = 0.0
    steps: int = 0  # engine iterations this output covers (0: nothing could run)
    prefill_tokens: int = 0
    first_token: list[str] = field(default_factory=list)
    tokens: list[tuple[str, int]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # the duration of each of the ``steps`` steps, when the engine records them
    # (``Engine.record_step_durations``) and the output covers several (a fused stretch)
    step_durations: list[float] | None = None


class Scheduler:
    """The waiting and running queues, admission and preemption, one ``step`` at a time;
    its KV blocks are ``self.pool``."""

    def __init__(
        self,
        profile: Profile,
        time_scale: float = 1.0,
        num_gpu_blocks: int | None = None,
        block_size: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.profile = profile
        self.time_scale = time_scale
        self.block_size = block_size or profile.block_size
        self.num_blocks = num_gpu_blocks or profile.num_gpu_blocks
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or profile.max_num_batched_tokens
        if min(self.block_size, self.num_blocks, self.max_num_seqs, self.max_num_batched_tokens) < 1:
            raise ValueError("block_size, num_gpu_blocks, max_num_seqs, max_num_batched_tokens must be >= 1")
        self.pool = BlockPool(self.num_blocks, self.block_size)
        self.waiting: deque[EngineRequest] = deque()
        # in admission order, so the most recently admitted request is always the last
        self.running: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}
        # finished prefill legs whose blocks the decode side has not read yet
        self.held: dict[str, list[int]] = {}
        self._admit_seq = 0
        # counters (vLLM counts prefix-cache queries and hits in tokens)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # prompt tokens whose KV a decode leg received from its prefill replica (vLLM's
        # prompt_tokens_by_source{source="external_kv_transfer"})
        self.external_tokens_total = 0

    # ------------------------------------------------------------------ KV events

    @property
    def kv_events(self) -> list[StandInEvent] | None:
        """vLLM's KV cache events since the last take_kv_events (None: not recorded)."""
        return self.pool.kv_events

    def enable_kv_events(self) -> None:
        """Record KV cache events from now on (requests then need ``token_ids``)."""
        self.pool.enable_kv_events()

    def take_kv_events(self) -> list[StandInEvent]:
        """The events recorded since the last call, oldest first."""
        return self.pool.take_kv_events()

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: forget every cached block, only while no
        request holds a block (False otherwise, nothing changed)."""
        return self.pool.reset_prefix_cache()

    # ------------------------------------------------------------------ public state

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_never_admitted(self) -> int:
        """Waiting requests that never ran (pushed, not yet admitted), leaving out the ones
        preempted back to the queue (vLLM's num_requests_waiting counts both)."""
        return sum(1 for r in self.waiting if r.preemptions == 0)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of blocks referenced by requests (vLLM: cached-but-idle blocks count as
        free, since they can be evicted at any time)."""
        return self.pool.used / self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached

    @property
    def evictions(self) -> int:
        return self.pool.evictions

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        return -(-(prompt_len + max_tokens) // self.block_size)

    def add_request(
        self,
        request_id: str,
        prompt_len: int,
        block_hashes: Sequence[int],
        max_tokens: int,
        now: float,
        token_ids: Sequence[int] | None = None,
        *,
        external_tokens: int = 0,
        hold_blocks: bool = False,
    ) -> None:
        """``block_hashes``: the chained hashes of the full blocks of the prompt followed
        by the output (see :func:`~skymesh.replica_sim.block_pool.chained_block_hashes`); ``token_ids``: the same tokens as
        ids, needed when KV events are recorded (each BlockStored carries them).
        ``external_tokens``: a decode leg's prompt tokens whose KV arrived from its prefill
        replica (all but the last are counted computed, as vLLM's decode side recomputes
        the last one for its logits); ``hold_blocks``: a prefill leg, whose blocks stay
        held after it finishes until :meth:`release_held`."""
        if request_id in self.requests or request_id in self.held:
            raise ValueError(f"duplicate request id {request_id!r}")
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError("prompt_len and max_tokens must be >= 1")
        need = self.blocks_needed(prompt_len, max_tokens)
        if need > self.num_blocks:
            # it could never run, even alone: vLLM rejects it up front as well
            raise ValueError(f"request needs {need} KV blocks, the cache has {self.num_blocks}")
        r = EngineRequest(request_id, prompt_len, list(block_hashes), max_tokens, now,
                          external_tokens=max(0, min(external_tokens, prompt_len)), hold_blocks=hold_blocks)
        if token_ids is not None:
            r.token_ids = list(token_ids)
        self.requests[request_id] = r
        self.waiting.append(r)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (client went away); its blocks are released.
        Returns False when the request is unknown or already finished."""
        r = self.requests.pop(request_id, None)
        if r is None:
            return False
        if r.state == RUNNING:
            self.running.remove(r)
            self._release(r)
        else:
            self.waiting.remove(r)
        r.state = DONE
        return True

    def release_held(self, request_id: str) -> bool:
        """The decode side read a finished prefill leg's blocks (or its lease ran out):
        they are released, and stay cached until evicted. False: none held."""
        blocks = self.held.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.release(blocks)
        return True

    def cached_prefix_tokens(self, block_hashes: Sequence[int], prompt_len: int) -> int:
        """Prompt tokens of a request with ``block_hashes`` this engine's prefix cache holds
        now (full blocks; the last prompt token never counts, as at admission)."""
        bs = self.block_size
        return len(self.pool.lookup(list(block_hashes), min(len(block_hashes), (prompt_len - 1) // bs))) * bs

    def drop_all_requests(self) -> list[str]:
        """Forget every request and the whole KV cache; returns the dropped request ids.

        The recovery after ``step`` raised: a step that failed halfway may have left the
        queues, block references and cache index inconsistent with each other (so
        ``abort`` itself could fail), and none of them can be trusted any more. This only
        builds fresh structures, so it cannot fail; the counters are kept (a restarted
        engine loop is the same server to a scraper)."""
        dropped = list(self.requests)
        self.requests = {}
        self.held = {}
        self.waiting = deque()
        self.running = []
        self.pool.clear()
        return dropped

    # ------------------------------------------------------------------ admission

    def _release(self, r: EngineRequest) -> None:
        self.pool.release(r.blocks)
        r.blocks = []

    @staticmethod
    def _max_hit_blocks(r: EngineRequest, bs: int) -> int:
        """Full blocks a lookup may reuse: at least one token is always recomputed, as vLLM
        needs its logits; a preempted request looks up its output so far too."""
        return min(len(r.block_hashes), (r.prompt_len + r.output_tokens - 1) // bs)

    def _lookup(self, r: EngineRequest) -> list[int]:
        """Blocks of the longest cached prefix of ``r`` (full blocks only)."""
        return self.pool.lookup(r.block_hashes, self._max_hit_blocks(r, self.block_size))

    def _admission_shortfall(self, r: EngineRequest, hits: list[int]) -> int:
        """How many blocks admitting ``r`` lacks right now (<= 0: it fits)."""
        target = r.prompt_len + r.output_tokens
        fresh_needed = -(-(target + 1) // self.block_size) - len(hits)
        # cached hits that are idle are counted as evictable capacity but will be reused
        reusable_idle = self.pool.num_idle(hits)
        return fresh_needed - (self.num_free_blocks - reusable_idle)

    def _surely_blocked(self, r: EngineRequest) -> bool:
        """Cheap test (no prefix lookup): even if every full prompt block were a cache
        hit, ``r`` would not fit. Lets a blocked queue head cost O(1) per step."""
        bs = self.block_size
        max_hits = self._max_hit_blocks(r, bs)
        total = -(-(r.prompt_len + r.output_tokens + 1) // bs)
        return total - max_hits > self.num_free_blocks

    def _try_admit(self, r: EngineRequest) -> bool:
        if self._surely_blocked(r):
            return False
        hits = self._lookup(r)
        if self._admission_shortfall(r, hits) > 0:
            return False
        bs = self.block_size
        self.pool.share(hits)
        n_hits = len(hits)
        r.target_tokens = r.prompt_len + r.output_tokens
        # extended in place with the fresh blocks; enough exist (shortfall checked)
        self.pool.alloc_many(-(-(r.target_tokens + 1) // bs) - n_hits, hits)
        r.blocks = hits
        r.num_computed = n_hits * bs
        if r.external_tokens and r.preemptions == 0:
            # the moved KV fills fresh blocks, cached as they are filled (vLLM caches
            # received blocks); the last prompt token is recomputed
            r.num_computed = max(r.num_computed, min(r.external_tokens, r.prompt_len - 1))
            self.pool.register_computed(r, n_hits * bs)
        if r.preemptions == 0:
            # vLLM counts a request's prefix-cache query once, and keeps preempted
            # requests' re-queries out of these counters
            r.cached_tokens = n_hits * bs
            self.external_tokens_total += r.num_computed - n_hits * bs
            self.prefix_cache_queries += r.prompt_len
            self.prefix_cache_hits += n_hits * bs
            self.prompt_tokens_total += r.prompt_len
        r.admitted_seq = self._admit_seq
        self._admit_seq += 1
        r.state = RUNNING
        return True

    def _preempt_last(self, out: StepOutput) -> EngineRequest:
        v = self.running.pop()
        self._release(v)
        v.num_computed = 0
        v.target_tokens = 0
        v.preemptions += 1
        v.state = WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(v)
        out.preempted.append(v.request_id)
        return v

    # ------------------------------------------------------------------ stepping

    def _step_cost(self, prefill_tokens: int, decodes: int, context: int, pairs: int) -> float:
        return self.profile.step_time_s(prefill_tokens, decodes, context, pairs) * self.time_scale

    def step(self, now: float) -> StepOutput:
        """One scheduler iteration starting at ``now``; its tokens exist at ``now +
        out.duration_s``. ``out.steps == 0`` when nothing can run."""
        out = StepOutput(steps=1)
        bs = self.block_size
        budget = self.max_num_batched_tokens
        running = self.running
        decode: list[EngineRequest] = []
        prefill: list[tuple[EngineRequest, int]] = []
        # 1. decodes (one token each), allocating a block when crossing a boundary
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            if r.num_computed < r.target_tokens:  # still in prefill: step 2
                i += 1
                continue
            needed = r.num_computed // bs + 1  # blocks to hold num_computed + 1 tokens
            while len(r.blocks) < needed:
                b = self.pool.alloc()
                if b is None:
                    # vLLM v1: preempt the most recently admitted request (the list's
                    # tail, which is never before position i) until this one fits or is
                    # itself the one preempted
                    if self._preempt_last(out) is r:
                        break
                    continue
                r.blocks.append(b)
            if r.state != RUNNING:
                break  # r was the tail: nothing after it is left
            decode.append(r)
            budget -= 1
            i += 1
        # 2. running prefills continue (their blocks were allocated at admission)
        for r in running:
            if budget <= 0:
                break
            if r.num_computed < r.target_tokens:
                n = min(budget, r.target_tokens - r.num_computed)
                prefill.append((r, n))
                budget -= n
        # 3. admit waiting requests FCFS; a blocked head blocks everyone behind it
        while self.waiting and budget > 0 and len(running) < self.max_num_seqs:
            r = self.waiting[0]
            if not self._try_admit(r):
                break
            self.waiting.popleft()
            running.append(r)
            if r.first_scheduled_at is None:
                r.first_scheduled_at = now
            n = min(budget, r.target_tokens - r.num_computed)
            prefill.append((r, n))
            budget -= n
        if not decode and not prefill:
            out.steps = 0
            return out
        prefill_tokens = 0
        context = 0  # KV tokens the decodes read
        pairs = 0  # query-key pairs of the prefill chunks (causal)
        for r in decode:
            context += r.num_computed
        for r, n in prefill:
            prefill_tokens += n
            pairs += prefill_pairs(n, r.num_computed)
        out.duration_s = dur = self._step_cost(prefill_tokens, len(decode), context, pairs)
        out.prefill_tokens = prefill_tokens
        end = now + dur
        tokens = out.tokens
        any_finished = False
        for r in decode:
            r.num_computed += 1
            if not r.num_computed % bs and r.num_computed // bs <= len(r.block_hashes):
                q = r.num_computed // bs - 1  # a generated block filled up
                if self.pool.register_block(r, q):
                    self.pool.emit_stored(r, q, q + 1)
            r.output_tokens += 1
            tokens.append((r.request_id, 1))
            if r.output_tokens >= r.max_tokens:
                self._finish(r, out)
                any_finished = True
        for r, n in prefill:
            before = r.num_computed
            r.num_computed += n
            self.pool.register_computed(r, before)
            if r.num_computed >= r.target_tokens:
                if r.output_tokens == 0:
                    r.first_token_at = end
                    out.first_token.append(r.request_id)
                # a recomputed (preempted) request resumes sampling where it stopped
                r.output_tokens += 1
                tokens.append((r.request_id, 1))
                if r.output_tokens >= r.max_tokens:
                    self._finish(r, out)
                    any_finished = True
        if any_finished:
            self.running = [r for r in running if r.state == RUNNING]
        self.generation_tokens_total += len(tokens)
        return out

    def _finish(self, r: EngineRequest, out: StepOutput) -> None:
        """Release a finished request (a prefill leg's blocks stay held); the caller drops
        it from ``running`` in one pass."""
        if r.hold_blocks:
            self.held[r.request_id] = r.blocks
            r.blocks = []
        else:
            self._release(r)
        r.state = DONE
        self.requests.pop(r.request_id, None)
        out.finished.append(r.request_id)
