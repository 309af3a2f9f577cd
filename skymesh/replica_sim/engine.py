"""The stand-in's engine model: vLLM-v1-like continuous batching, pure (no clock, no I/O).

Per step (``Engine.step(now)``):
1. running requests in decode get one token each; a decode that crosses into a new KV
   block allocates one (free blocks first, then LRU eviction of unreferenced cached blocks);
   when none is left the most recently admitted running request is preempted (recompute:
   blocks released, back to the FRONT of the waiting queue — vLLM's policy).
2. running requests still in prefill continue their chunk within the token budget
   (``max_num_batched_tokens``, chunked prefill).
3. waiting requests are admitted FCFS while ``max_num_seqs`` and the KV cache allow: the
   longest run of cached full blocks (chained block hashes) is reused, the rest of the
   prompt gets fresh blocks, and its first prefill chunk joins the step.
The step's duration follows the profile's cost model; its tokens appear at ``now +
duration``. The discrete-event simulator drives this same class with a simulated clock and
``run_until`` fuses stretches of pure decode into one call.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from skymesh.replica_sim.profiles import Profile


def chained_block_hashes(tokens: Sequence[str], block_size: int, parent: int = 0) -> list[int]:
    """vLLM-style prefix-caching keys: one hash per FULL block, chained to the previous."""
    out: list[int] = []
    h = parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = xxhash.xxh64_intdigest("\x1f".join(tokens[start : start + block_size]).encode(), seed=h)
        out.append(h)
    return out


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_len: int
    block_hashes: list[int]
    max_tokens: int
    arrival: float
    admitted_seq: int = -1
    num_computed: int = 0  # tokens whose KV is in the cache (prompt + regenerated output)
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    blocks: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    preemptions: int = 0
    # tokens to compute before the next token can be sampled, set at admission: the
    # prompt, plus the output generated so far when a preempted request is recomputed
    target_tokens: int = 0

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.target_tokens


@dataclass(slots=True)
class StepOutput:
    duration_s: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    first_token: list[str] = field(default_factory=list)
    tokens: list[tuple[str, int]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


class _Block:
    __slots__ = ("ref", "hash")

    def __init__(self) -> None:
        self.ref = 0
        self.hash: int | None = None


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
        self.profile = profile
        self.time_scale = time_scale
        self.block_size = block_size or profile.block_size
        self.num_blocks = num_gpu_blocks or profile.num_gpu_blocks
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or profile.max_num_batched_tokens
        self._blocks = [_Block() for _ in range(self.num_blocks)]
        self._free: deque[int] = deque(range(self.num_blocks))  # no hash, ref 0
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0, LRU order
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._used = 0  # blocks with ref > 0
        self.waiting: deque[EngineRequest] = deque()
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

    # ------------------------------------------------------------------ public state

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self._used / self.num_blocks

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add_request(
        self,
        request_id: str,
        prompt_len: int,
        block_hashes: Sequence[int],
        max_tokens: int,
        now: float,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError("prompt_len and max_tokens must be >= 1")
        need = -(-(prompt_len + max_tokens) // self.block_size)
        if need > self.num_blocks:
            raise ValueError(
                f"request needs {need} KV blocks, the cache has {self.num_blocks}"
            )
        r = EngineRequest(request_id, prompt_len, list(block_hashes), max_tokens, now)
        self.requests[request_id] = r
        self.waiting.append(r)

    def abort(self, request_id: str) -> bool:
        r = self.requests.pop(request_id, None)
        if r is None:
            return False
        if r in self.running:
            self.running.remove(r)
            self._release(r)
        else:
            try:
                self.waiting.remove(r)
            except ValueError:
                pass
        return True

    # ------------------------------------------------------------------ KV blocks

    def _alloc(self) -> int | None:
        if self._free:
            b = self._free.popleft()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            blk = self._blocks[b]
            if blk.hash is not None and self._cached.get(blk.hash) == b:
                del self._cached[blk.hash]
            blk.hash = None
            self.evictions += 1
        else:
            return None
        self._blocks[b].ref = 1
        self._used += 1
        return b

    def _free_capacity(self) -> int:
        return len(self._free) + len(self._evictable)

    def _release(self, r: EngineRequest) -> None:
        for b in r.blocks:
            blk = self._blocks[b]
            blk.ref -= 1
            if blk.ref == 0:
                self._used -= 1
                if blk.hash is not None and self._cached.get(blk.hash) == b:
                    self._evictable[b] = None  # stays cached until evicted (LRU)
                else:
                    blk.hash = None
                    self._free.append(b)
        r.blocks = []

    def _register_computed(self, r: EngineRequest, before: int) -> None:
        """Publish hashes of prompt blocks that became fully computed."""
        bs = self.block_size
        first = before // bs
        last = min(r.num_computed, r.prompt_len) // bs
        for i in range(first, min(last, len(r.block_hashes), len(r.blocks))):
            h = r.block_hashes[i]
            if h not in self._cached:
                b = r.blocks[i]
                self._blocks[b].hash = h
                self._cached[h] = b

    def _try_admit(self, r: EngineRequest) -> bool:
        bs = self.block_size
        # at least one prompt token is always recomputed (vLLM needs logits for it)
        max_hit_blocks = min(len(r.block_hashes), (r.prompt_len - 1) // bs)
        hits: list[int] = []
        for h in r.block_hashes[:max_hit_blocks]:
            b = self._cached.get(h)
            if b is None:
                break
            hits.append(b)
        target = r.target_tokens = r.prompt_len + r.output_tokens
        total_blocks = -(-(target + 1) // bs)
        fresh_needed = total_blocks - len(hits)
        reusable_evictable = sum(1 for b in hits if self._blocks[b].ref == 0)
        if self._free_capacity() - reusable_evictable < fresh_needed:
            return False
        for b in hits:
            blk = self._blocks[b]
            if blk.ref == 0:
                self._evictable.pop(b, None)
                self._used += 1
            blk.ref += 1
        r.blocks = list(hits)
        for _ in range(fresh_needed):
            b = self._alloc()
            assert b is not None
            r.blocks.append(b)
        r.num_computed = len(hits) * bs
        if r.preemptions == 0:
            r.cached_tokens = r.num_computed
            self.prefix_cache_queries += r.prompt_len
            self.prefix_cache_hits += r.num_computed
            self.prompt_tokens_total += r.prompt_len
        r.admitted_seq = self._admit_seq
        self._admit_seq += 1
        return True

    def _preempt_one(self, out: StepOutput, protect: EngineRequest | None) -> bool:
        victims = [x for x in self.running if x is not protect] or list(self.running)
        if not victims:
            return False
        v = max(victims, key=lambda x: x.admitted_seq)
        self.running.remove(v)
        self._release(v)
        v.num_computed = 0
        v.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(v)
        out.preempted.append(v.request_id)
        return v is not protect

    # ------------------------------------------------------------------ stepping

    def step(self, now: float) -> StepOutput:
        out = StepOutput(steps=1)
        p = self.profile
        bs = self.block_size
        budget = self.max_num_batched_tokens
        decode: list[EngineRequest] = []
        prefill: list[tuple[EngineRequest, int]] = []
        context = 0
        # 1. decodes (one token each), allocating a block when crossing a boundary
        for r in list(self.running):
            if r not in self.running or r.in_prefill:
                continue
            needed_blocks = -(-(r.num_computed + 1) // bs)
            while len(r.blocks) < needed_blocks:
                b = self._alloc()
                if b is not None:
                    r.blocks.append(b)
                    continue
                if not self._preempt_one(out, protect=r):
                    break
            if r not in self.running or len(r.blocks) < needed_blocks:
                continue
            if budget <= 0:
                break
            decode.append(r)
            budget -= 1
        decode = [r for r in decode if r in self.running]
        # 2. running prefills continue
        for r in self.running:
            if budget <= 0:
                break
            if r.in_prefill:
                n = min(budget, r.target_tokens - r.num_computed)
                prefill.append((r, n))
                budget -= n
        # 3. admit waiting requests FCFS
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if not self._try_admit(r):
                break
            self.waiting.popleft()
            self.running.append(r)
            n = min(budget, r.target_tokens - r.num_computed)
            prefill.append((r, n))
            budget -= n
        if not decode and not prefill:
            out.duration_s = 0.0
            out.steps = 0
            return out
        prefill_tokens = sum(n for _, n in prefill)
        for r in decode:
            context += r.num_computed
        for r, n in prefill:
            context += r.num_computed + n // 2
        dur = (
            p.step_fixed_s
            + p.prefill_s_per_token * prefill_tokens
            + p.decode_s_per_seq * len(decode)
            + p.attn_s_per_context_token * context
        ) * self.time_scale
        out.duration_s = dur
        out.prefill_tokens = prefill_tokens
        end = now + dur
        finished: list[EngineRequest] = []
        for r in decode:
            r.num_computed += 1
            r.output_tokens += 1
            out.tokens.append((r.request_id, 1))
            if r.output_tokens >= r.max_tokens:
                finished.append(r)
        for r, n in prefill:
            before = r.num_computed
            r.num_computed += n
            self._register_computed(r, before)
            if not r.in_prefill:
                if r.output_tokens == 0:
                    r.first_token_at = end
                    out.first_token.append(r.request_id)
                # a recomputed (preempted) request resumes sampling where it stopped
                r.output_tokens += 1
                out.tokens.append((r.request_id, 1))
                if r.output_tokens >= r.max_tokens:
                    finished.append(r)
        for r in finished:
            self._finish(r)
            out.finished.append(r.request_id)
        self.generation_tokens_total += len(out.tokens)
        return out

    def _finish(self, r: EngineRequest) -> None:
        self.running.remove(r)
        self._release(r)
        self.requests.pop(r.request_id, None)

    def run_until(self, now: float, deadline: float) -> tuple[float, StepOutput]:
        """Advance from ``now`` by one step, or — when only decodes run and nothing can be
        admitted — by as many fused decode steps as fit before ``deadline`` and before the
        first request finishes or the cache runs out of blocks. Returns (time reached,
        aggregated output)."""
        if not self._pure_decode():
            out = self.step(now)
            return now + out.duration_s, out
        p = self.profile
        bs = self.block_size
        n = len(self.running)
        k_max = min(r.max_tokens - r.output_tokens for r in self.running)
        per_step = p.step_fixed_s + p.decode_s_per_seq * n
        ctx0 = sum(r.num_computed for r in self.running)
        a = p.attn_s_per_context_token

        def duration(k: int) -> float:
            return (k * (per_step + a * ctx0) + a * n * k * (k - 1) / 2) * self.time_scale

        lo, hi = 1, max(1, k_max)
        if duration(hi) > deadline - now:
            while lo < hi:  # largest k >= 1 with duration(k) <= deadline - now
                mid = (lo + hi + 1) // 2
                if duration(mid) <= deadline - now:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        else:
            k = hi
        # blocks the k steps need; fall back to single steps if the cache is short
        extra = sum(-(-(r.num_computed + k) // bs) - len(r.blocks) for r in self.running)
        if k <= 1 or extra > self._free_capacity():
            out = self.step(now)
            return now + out.duration_s, out
        for r in self.running:
            while len(r.blocks) < -(-(r.num_computed + k) // bs):
                b = self._alloc()
                assert b is not None
                r.blocks.append(b)
        out = StepOutput(steps=k, duration_s=duration(k))
        finished = []
        for r in self.running:
            r.num_computed += k
            r.output_tokens += k
            out.tokens.append((r.request_id, k))
            if r.output_tokens >= r.max_tokens:
                finished.append(r)
        for r in finished:
            self._finish(r)
            out.finished.append(r.request_id)
        self.generation_tokens_total += k * n
        return now + out.duration_s, out

    def _pure_decode(self) -> bool:
        if not self.running or any(r.in_prefill for r in self.running):
            return False
        # a waiting request that could be admitted must get its chance every step
        return not self.waiting or len(self.running) >= self.max_num_seqs
