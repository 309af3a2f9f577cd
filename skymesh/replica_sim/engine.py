"""The stand-in's engine model (vLLM-v1-like continuous batching, pure: no clock, no I/O):
the :class:`~skymesh.replica_sim.scheduler.Scheduler`, stepped one iteration at a time
by the HTTP stand-in, plus the fast-forward the discrete-event simulator drives it with
(same class, simulated clock): ``run_until`` fuses a stretch of pure decode into one call
with the result of the single steps, and ``decode_horizon`` says how far that stretch goes.
"""

from __future__ import annotations

from collections.abc import Callable

from skymesh.replica_sim.request_state import RUNNING
from skymesh.replica_sim.scheduler import Scheduler, StepOutput


class Engine(Scheduler):
    """The scheduler plus fused decode steps; see the scheduler for one step's rules and
    :class:`~skymesh.replica_sim.block_pool.BlockPool` for KV blocks and KV events."""

    # a fused stretch's output lists each step's duration (a simulator measuring token
    # intervals sets it; off, the stretch costs O(batch), not O(steps))
    record_step_durations = False

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
        if self.record_step_durations:
            ends = [duration(j) for j in range(k + 1)]
            out.step_durations = [ends[j + 1] - ends[j] for j in range(k)]
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
                b = self.pool.alloc()  # bounded by extra_blocks(k) <= free
                assert b is not None
                r.blocks.append(b)
            elif self.pool.register_block(r, q):
                self.pool.emit_stored(r, q, q + 1)
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
