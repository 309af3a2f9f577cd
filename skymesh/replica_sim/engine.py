"""The stand-in's engine model: vLLM-v1-like continuous batching, pure (no clock, no I/O).

Per step (``Engine.step(now)``):
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
duration``.

KV events (vLLM 0.32's, off unless :meth:`Engine.enable_kv_events`): every change of the
prefix cache is recorded as vLLM records it: a block newly cached ->
``BlockStored`` (one event per request and step for its run of new blocks, with their
token ids and the parent's hash), a cached block evicted -> ``BlockRemoved``, the cache
emptied (:meth:`Engine.reset_prefix_cache`, :meth:`Engine.drop_all_requests`) ->
``AllBlocksCleared``. :meth:`Engine.take_kv_events` hands them over, one step's worth at
a time. The discrete-event simulator drives this same class with a simulated clock and
``run_until`` fuses stretches of pure decode into one call.

Every step is O(batch + newly admitted prompt blocks): requests carry their own state so
no list membership test or removal scans the batch per request.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import xxhash

from skymesh.replica_sim.kv_events import AllBlocksCleared, StandInEvent, removed, stored
from skymesh.replica_sim.profiles import Profile, prefill_pairs

WAITING, RUNNING, DONE = 0, 1, 2


def chained_block_hashes(tokens: Sequence[str], block_size: int, parent: int = 0) -> list[int]:
    """vLLM-style prefix-caching keys: one hash per FULL block, each seeded with the hash
    of the previous block, so equal hashes mean equal whole prefixes, not just equal blocks.
    A trailing partial block gets no hash (vLLM never caches it)."""
    out: list[int] = []
    h = parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        # \x1f cannot occur inside a whitespace-split token, so the join is unambiguous
        h = xxhash.xxh64_intdigest("\x1f".join(tokens[start : start + block_size]).encode(), seed=h)
        out.append(h)
    return out


# eq=False: requests are compared by identity; a generated field-by-field __eq__ would make
# every deque/list lookup cost a tuple build per element
@dataclass(slots=True, eq=False)
class EngineRequest:
    request_id: str
    prompt_len: int
    block_hashes: list[int]
    max_tokens: int
    arrival: float
    state: int = WAITING
    admitted_seq: int = -1
    num_computed: int = 0  # tokens whose KV is in the cache (prompt + regenerated output)
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    blocks: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    preemptions: int = 0
    first_scheduled_at: float | None = None  # step start of its first admission
    # tokens to compute before the next token can be sampled, set at admission: the
    # prompt, plus the output generated so far when a preempted request is recomputed
    target_tokens: int = 0
    # the token ids behind block_hashes (prompt, then output), for KV events only
    token_ids: list[int] | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_len

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.target_tokens


@dataclass(slots=True)
class StepOutput:
    duration_s: float = 0.0
    steps: int = 0  # engine iterations this output covers (0: nothing could run)
    prefill_tokens: int = 0
    first_token: list[str] = field(default_factory=list)
    tokens: list[tuple[str, int]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


class Engine:
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
        # per block: reference count and the prefix hash it holds (None: not cached)
        self._ref = [0] * self.num_blocks
        self._hash: list[int | None] = [None] * self.num_blocks
        # no hash, ref 0; a stack: which free block is used first does not matter
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0, LRU order
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._used = 0  # blocks with ref > 0
        self.waiting: deque[EngineRequest] = deque()
        # in admission order, so the most recently admitted request is always the last
        self.running: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}
        self._admit_seq = 0
        # counters (vLLM counts prefix-cache queries and hits in tokens)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.evictions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # vLLM's KV cache events since the last take_kv_events (None: not recorded)
        self.kv_events: list[StandInEvent] | None = None

    # ------------------------------------------------------------------ KV events

    def enable_kv_events(self) -> None:
        """Record KV cache events from now on (requests then need ``token_ids``)."""
        if self.kv_events is None:
            self.kv_events = []

    def take_kv_events(self) -> list[StandInEvent]:
        """The events recorded since the last call, oldest first."""
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    def _emit_stored(self, r: EngineRequest, first: int, end: int) -> None:
        """BlockStored for ``r``'s blocks ``first`` .. ``end - 1``, newly cached; the
        parent is the hash of the block before them (None for a prompt's first block)."""
        if self.kv_events is None or r.token_ids is None or end <= first:
            return
        bs = self.block_size
        self.kv_events.append(stored(r.block_hashes[first:end], r.block_hashes[first - 1] if first else None,
                                     r.token_ids[first * bs : end * bs], bs))

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: forget every cached block, only while no
        request holds a block (False otherwise, nothing changed)."""
        if self._used:
            return False
        for b in self._evictable:
            self._hash[b] = None
            self._free.append(b)
        self._evictable.clear()
        self._cached.clear()
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return True

    # ------------------------------------------------------------------ public state

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of blocks referenced by requests (vLLM: cached-but-idle blocks count as
        free, since they can be evicted at any time)."""
        return self._used / self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

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
    ) -> None:
        """``block_hashes``: the chained hashes of the full blocks of the prompt followed
        by the output (see :func:`chained_block_hashes`); ``token_ids``: the same tokens as
        ids, needed when KV events are recorded (each BlockStored carries them)."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError("prompt_len and max_tokens must be >= 1")
        need = self.blocks_needed(prompt_len, max_tokens)
        if need > self.num_blocks:
            # it could never run, even alone: vLLM rejects it up front as well
            raise ValueError(f"request needs {need} KV blocks, the cache has {self.num_blocks}")
        r = EngineRequest(request_id, prompt_len, list(block_hashes), max_tokens, now)
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

    def drop_all_requests(self) -> list[str]:
        """Forget every request and the whole KV cache; returns the dropped request ids.

        The recovery after ``step`` raised: a step that failed halfway may have left the
        queues, block references and cache index inconsistent with each other (so
        ``abort`` itself could fail), and none of them can be trusted any more. This only
        builds fresh structures, so it cannot fail; the counters are kept (a restarted
        engine loop is the same server to a scraper)."""
        dropped = list(self.requests)
        self.requests = {}
        self.waiting = deque()
        self.running = []
        self._ref = [0] * self.num_blocks
        self._hash = [None] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._evictable = OrderedDict()
        self._cached = {}
        self._used = 0
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return dropped

    # ------------------------------------------------------------------ KV blocks

    def _alloc(self) -> int | None:
        if self._free:
            b = self._free.pop()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            h = self._hash[b]
            if h is not None and self._cached.get(h) == b:
                del self._cached[h]
                if self.kv_events is not None:
                    self.kv_events.append(removed(h))
            self._hash[b] = None
            self.evictions += 1
        else:
            return None
        self._ref[b] = 1
        self._used += 1
        return b

    def _alloc_many(self, n: int, into: list[int]) -> None:
        """Append ``n`` blocks to ``into``; the caller has checked there are enough.
        Free blocks are taken with one slice (long prompts need hundreds of blocks)."""
        free = self._free
        take = min(n, len(free))
        if take:
            got = free[len(free) - take :]
            del free[len(free) - take :]
            ref = self._ref
            for b in got:
                ref[b] = 1
            self._used += take
            into += got
        for _ in range(n - take):
            b = self._alloc()
            assert b is not None
            into.append(b)

    def _release(self, r: EngineRequest) -> None:
        ref, hashes, cached = self._ref, self._hash, self._cached
        # reversed: a request's last blocks are the least likely to be shared, so they
        # are put first in LRU order and evicted before its prefix (vLLM does the same)
        for b in reversed(r.blocks):
            ref[b] -= 1
            if ref[b] == 0:
                self._used -= 1
                h = hashes[b]
                if h is not None and cached.get(h) == b:
                    self._evictable[b] = None  # stays cached until evicted (LRU)
                else:
                    hashes[b] = None
                    self._free.append(b)
        r.blocks = []

    def _register_computed(self, r: EngineRequest, before: int) -> None:
        """Publish the hashes of the blocks that became fully computed since ``before``
        computed tokens: prompt blocks and, as vLLM caches them too (``cache_blocks`` up to
        the tokens whose KV exists), blocks of generated tokens."""
        bs = self.block_size
        last = r.num_computed // bs
        run = -1  # first block of the current run of newly cached blocks (KV events)
        end = min(last, len(r.block_hashes), len(r.blocks))
        for i in range(before // bs, end):
            if self._register_block(r, i):
                if run < 0:
                    run = i
            elif run >= 0:
                self._emit_stored(r, run, i)
                run = -1
        if run >= 0:
            self._emit_stored(r, run, end)

    def _register_block(self, r: EngineRequest, i: int) -> bool:
        """Cache block ``i`` of ``r`` under its hash; False when that hash is already
        cached (the stand-in keeps one block per hash)."""
        h = r.block_hashes[i]
        if h in self._cached:
            return False
        b = r.blocks[i]
        self._hash[b] = h
        self._cached[h] = b
        return True

    @staticmethod
    def _max_hit_blocks(r: EngineRequest, bs: int) -> int:
        """Full blocks a lookup may reuse: at least one token is always recomputed, as vLLM
        needs its logits; a preempted request looks up its output so far too."""
        return min(len(r.block_hashes), (r.prompt_len + r.output_tokens - 1) // bs)

    def _lookup(self, r: EngineRequest) -> list[int]:
        """Blocks of the longest cached prefix of ``r`` (full blocks only)."""
        max_hit_blocks = self._max_hit_blocks(r, self.block_size)
        hits: list[int] = []
        cached = self._cached
        for h in r.block_hashes[:max_hit_blocks]:
            b = cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _admission_shortfall(self, r: EngineRequest, hits: list[int]) -> int:
        """How many blocks admitting ``r`` lacks right now (<= 0: it fits)."""
        target = r.prompt_len + r.output_tokens
        fresh_needed = -(-(target + 1) // self.block_size) - len(hits)
        # cached hits that are idle are counted as evictable capacity but will be reused
        reusable_idle = sum(1 for b in hits if self._ref[b] == 0)
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
        ref = self._ref
        for b in hits:
            if ref[b] == 0:
                del self._evictable[b]
                self._used += 1
            ref[b] += 1
        n_hits = len(hits)
        r.target_tokens = r.prompt_len + r.output_tokens
        # extended in place with the fresh blocks; enough exist (shortfall checked)
        self._alloc_many(-(-(r.target_tokens + 1) // bs) - n_hits, hits)
        r.blocks = hits
        r.num_computed = n_hits * bs
        if r.preemptions == 0:
            # vLLM counts a request's prefix-cache query once, and keeps preempted
            # requests' re-queries out of these counters
            r.cached_tokens = r.num_computed
            self.prefix_cache_queries += r.prompt_len
            self.prefix_cache_hits += r.num_computed
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
                b = self._alloc()
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
                if self._register_block(r, q):
                    self._emit_stored(r, q, q + 1)
            r.output_tokens += 1
            tokens.append((r.request_id, 1))
            if r.output_tokens >= r.max_tokens:
                self._finish(r, out)
                any_finished = True
        for r, n in prefill:
            before = r.num_computed
            r.num_computed += n
            self._register_computed(r, before)
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
        """Release a finished request; the caller drops it from ``running`` in one pass."""
        self._release(r)
        r.state = DONE
        self.requests.pop(r.request_id, None)
        out.finished.append(r.request_id)

    # ------------------------------------------------------------------ fast-forward

    def _pure_decode(self) -> bool:
        """True when the next steps are decode-only until a finish or a block shortage:
        nothing in prefill, and no waiting request can be admitted. A blocked head stays
        blocked without a finish, because decode only ever shrinks free capacity."""
        running = self.running
        # more decodes than the token budget: only some decode each step
        if not running or len(running) > self.max_num_batched_tokens:
            return False
        for r in running:
            if r.num_computed < r.target_tokens:
                return False
        if (
            not self.waiting
            or len(running) >= self.max_num_seqs
            or len(running) == self.max_num_batched_tokens  # no budget left to admit
        ):
            return True
        head = self.waiting[0]
        return self._surely_blocked(head) or self._admission_shortfall(head, self._lookup(head)) > 0

    def decode_horizon(self) -> float | None:
        """Seconds until the end of the step in which the first running request finishes,
        if every step until then is pure decode and needs no preemption — exactly what
        :meth:`run_until` fuses into one call; None otherwise. Does not change the engine
        (the discrete-event simulator schedules one wake-up there instead of one per step)."""
        if not self._pure_decode():
            return None
        k = min(r.max_tokens - r.output_tokens for r in self.running)
        if k < 2:
            return None
        if self._fused_extra_blocks(k) > self.num_free_blocks:
            return None
        return self._fused_duration()(k)

    def _fused_duration(self) -> Callable[[int], float]:
        """k -> duration of k fused decode steps of the running batch (constants summed once,
        as the bisection in run_until calls it several times)."""
        p = self.profile
        n = len(self.running)
        # a decode-only step: n tokens through the linear layers, n sequences' overhead,
        # and the KV read that grows by one token per sequence per step
        per_step = p.linear_time_s(n) + p.decode_s_per_seq * n
        ctx0 = sum(r.num_computed for r in self.running)
        a = p.attn_s_per_context_token
        ts = self.time_scale

        def duration(k: int) -> float:
            # step j (0-based) attends ctx0 + n*j tokens
            return (k * (per_step + a * ctx0) + a * n * k * (k - 1) / 2) * ts

        return duration

    def _fused_extra_blocks(self, k: int) -> int:
        """Blocks ``k`` fused decode steps need beyond those held: the last of the k steps
        starts with num_computed + k - 1 tokens and needs room for one more."""
        bs = self.block_size
        return sum(max(0, (r.num_computed + k - 1) // bs + 1 - len(r.blocks)) for r in self.running)

    def run_until(self, now: float, deadline: float) -> tuple[float, StepOutput]:
        """Advance from ``now`` by one step, or — when only decodes can run — by as many
        fused decode steps as fit before ``deadline`` (at least one), ending no later than
        the step in which the first request finishes and never needing a preemption.
        Returns (time reached, aggregated output); the result equals repeated ``step``
        calls up to float rounding of the summed durations."""
        if not self._pure_decode():
            out = self.step(now)
            return now + out.duration_s, out
        bs = self.block_size
        running = self.running
        n = len(running)
        k_max = min(r.max_tokens - r.output_tokens for r in running)
        duration = self._fused_duration()
        extra_blocks = self._fused_extra_blocks

        def largest(ok: Callable[[int], bool], hi: int) -> int:
            """Largest k in [1, hi] with ok(k) (ok monotone, ok(1) assumed)."""
            lo = 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if ok(mid):
                    lo = mid
                else:
                    hi = mid - 1
            return lo

        span = deadline - now
        k = k_max if duration(k_max) <= span else largest(lambda m: duration(m) <= span, k_max)
        free = self.num_free_blocks
        if extra_blocks(1) > free:
            out = self.step(now)  # the very next step must preempt
            return now + out.duration_s, out
        if extra_blocks(k) > free:
            k = largest(lambda m: extra_blocks(m) <= free, k)
        if k == 1:
            out = self.step(now)
            return now + out.duration_s, out
        out = StepOutput(steps=k, duration_s=duration(k))
        tokens = out.tokens
        any_finished = False
        # the k steps' block events in the order single steps meet them: by step, then
        # each step's allocations before the blocks it fills are published, each in batch
        # order; every block is taken before any finisher releases its own. Evictions and
        # publications therefore interleave as in single steps (a block's hash is only
        # published if no other block holds it at that moment).
        events: list[tuple[int, int, int, int]] = []  # (step, 0 alloc / 1 publish, position, block)
        for pos, r in enumerate(running):
            nc = r.num_computed
            for m in range(len(r.blocks), (nc + k - 1) // bs + 1):
                events.append((max(0, m * bs - nc), 0, pos, m))
            q, nh = nc // bs, len(r.block_hashes)
            while q < nh and (j := (q + 1) * bs - nc - 1) < k:
                events.append((j, 1, pos, q))
                q += 1
        events.sort()
        for _, kind, pos, q in events:
            r = running[pos]
            if kind == 0:
                b = self._alloc()  # bounded by extra_blocks(k) <= free
                assert b is not None
                r.blocks.append(b)
            elif self._register_block(r, q):
                self._emit_stored(r, q, q + 1)
        for r in running:
            r.num_computed += k
            r.output_tokens += k
            tokens.append((r.request_id, k))
            if r.output_tokens >= r.max_tokens:
                self._finish(r, out)
                any_finished = True
        if any_finished:
            self.running = [r for r in running if r.state == RUNNING]
        self.generation_tokens_total += k * n
        return now + out.duration_s, out
