"""The stand-in's engine model: prefix caching, KV capacity, eviction, preemption, cost
model, and the fused fast-forward used by the discrete-event simulator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.hardware import PROFILES, Profile, prefill_pairs, vllm_batch_defaults
from skymesh.replica_sim.block_pool import chained_block_hashes
from skymesh.replica_sim.engine import Engine
from skymesh.replica_sim.scheduler import StepOutput
from skymesh.word_tokenizer import filler_tokens

TINY = PROFILES["tiny-test"]
BS = 16


def words(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def add(e: Engine, rid: str, prefix: str, prompt_len: int, max_tokens: int, now: float = 0.0) -> None:
    # the hashes cover the prompt and the output the stand-in will generate, as the
    # server passes them
    seq = words(prefix, prompt_len) + filler_tokens(max_tokens)
    e.add_request(rid, prompt_len, chained_block_hashes(seq, e.block_size), max_tokens, now)


class Trace:
    """Everything a sequence of steps produced, keyed by request."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.produced: dict[str, int] = {}
        self.preempted: list[str] = []
        self.steps = 0

    def record(self, out: StepOutput, end: float) -> None:
        self.steps += out.steps
        for rid in out.first_token:
            self.first[rid] = end
        for rid, n in out.tokens:
            self.produced[rid] = self.produced.get(rid, 0) + n
        for rid in out.finished:
            self.done[rid] = end
        self.preempted += out.preempted


def drain(e: Engine, t: float = 0.0, trace: Trace | None = None) -> tuple[float, Trace]:
    tr = trace or Trace()
    while e.has_work():
        out = e.step(t)
        assert out.steps == 1
        t += out.duration_s
        tr.record(out, t)
    return t, tr


def test_chained_hashes_cover_full_blocks_only_and_chain() -> None:
    a = chained_block_hashes(words("w", 40), BS)
    assert len(a) == 2
    assert a == chained_block_hashes(words("w", 32) + words("x", 8), BS)  # same two full blocks
    c = chained_block_hashes(["z"] + words("w", 31), BS)
    assert c[1] != a[1]  # block 2's tokens are equal, but block 1 differs: chained
    assert chained_block_hashes(words("w", 32), BS, parent=7) != a


def test_second_identical_prompt_hits_cache_and_is_faster() -> None:
    e = Engine(TINY)
    add(e, "a", "w", 600, 4)
    t, tr = drain(e)
    ttft_a = tr.first["a"]
    add(e, "b", "w", 600, 4, t)
    _, tr = drain(e, t)
    ttft_b = tr.first["b"] - t
    assert ttft_b < 0.5 * ttft_a
    # 600 tokens hold 37 full blocks; the last prompt token is always recomputed, which
    # still leaves all 37 (592 tokens) as hits
    assert e.prefix_cache_hits == 37 * BS
    assert e.prefix_cache_queries == 1200


def test_full_blocks_of_generated_tokens_are_cached_too() -> None:
    # vLLM caches every full block whose KV exists, generated tokens included: a next
    # turn whose prompt holds the previous prompt and answer hits on both
    e = Engine(TINY)
    add(e, "a", "w", 40, 30)  # KV of 40 + 29 tokens (the last token is never computed)
    t, _ = drain(e)
    assert e.num_cached_blocks == 69 // BS
    nxt = words("w", 40) + filler_tokens(30) + words("more", 10)
    e.add_request("b", len(nxt), chained_block_hashes(nxt + filler_tokens(2), BS), 2, t)
    drain(e, t)
    assert e.prefix_cache_hits == 4 * BS  # blocks 0-1 prompt, 2 prompt + answer, 3 answer


def test_a_preempted_request_looks_up_its_own_generated_blocks() -> None:
    e = Engine(TINY)
    add(e, "a", "w", 20, 40)
    for _ in range(30):  # prefill, then 29 decodes: 49 tokens of KV, 3 full blocks
        e.step(0.0)
    r = e.requests["a"]
    assert e.num_cached_blocks == 3 and r.output_tokens == 30
    e._preempt_last(StepOutput())
    # readmission may reuse the prompt and output blocks cached before (not the last
    # token, which is recomputed)
    assert len(e._lookup(r)) == min(3, (20 + 30 - 1) // BS)


def test_prompt_of_whole_blocks_recomputes_its_last_block() -> None:
    e = Engine(TINY)
    add(e, "a", "w", 64, 1)
    t, _ = drain(e)
    add(e, "b", "w", 64, 1, t)
    drain(e, t)
    assert e.prefix_cache_hits == 3 * BS  # 4 full blocks, at most 63 tokens may hit


def test_chunked_prefill_takes_ceil_prompt_over_budget_steps() -> None:
    e = Engine(TINY, max_num_batched_tokens=100)
    add(e, "a", "w", 350, 2)
    outs = []
    while "a" not in (outs[-1].first_token if outs else []):
        outs.append(e.step(0.0))
    assert [o.prefill_tokens for o in outs] == [100, 100, 100, 50]


def test_step_duration_follows_the_cost_model() -> None:
    e = Engine(TINY, time_scale=3.0)
    add(e, "a", "w", 200, 5)
    out = e.step(0.0)
    assert out.duration_s == pytest.approx(3.0 * TINY.step_time_s(200, 0, 0, prefill_pairs(200, 0)))
    out = e.step(out.duration_s)  # one decode over a context of 200 tokens
    assert out.duration_s == pytest.approx(3.0 * TINY.step_time_s(0, 1, 200))
    # the profile's TTFT seed equals what the engine does for a lone prompt
    e2 = Engine(TINY)
    add(e2, "x", "q", 1300, 1)
    _, tr = drain(e2)
    assert tr.first["x"] == pytest.approx(TINY.prefill_time_s(1300))


def test_prefill_is_a_roofline_with_a_quadratic_attention_term() -> None:
    # max(weight read, compute): a short prompt costs the weight read, a long one compute
    for p in PROFILES.values():
        assert p.step_time_s(1, 0, 0) == pytest.approx(p.weight_read_s + p.prefill_attn_s_per_pair)
        big = p.max_num_batched_tokens
        assert p.step_time_s(big, 0, 0) == pytest.approx(max(p.weight_read_s, p.compute_s_per_token * big))
        # attention grows with the square of the length: doubling a long prompt more
        # than doubles its prefill
        assert p.prefill_time_s(16384) > 2 * p.prefill_time_s(8192)
    assert prefill_pairs(4, 0) == 1 + 2 + 3 + 4 and prefill_pairs(2, 10) == 11 + 12


def per_token_ms(p: Profile, n: int) -> float:
    return 1e3 * (p.prefill_time_s(2 * n) - p.prefill_time_s(n)) / n


def test_profiles_prefill_cost_per_token_matches_the_roofline() -> None:
    # docs/replica-sim.md: an 8B model on an L4 prefills at ~0.2-0.25 ms per token at
    # moderate lengths; Qwen2.5-7B on an H100 at ~30 µs per token
    l4, h100 = PROFILES["l4-llama3.1-8b"], PROFILES["h100-qwen2.5-7b"]
    for n in (512, 1024, 2048):
        assert 0.2 <= per_token_ms(l4, n) <= 0.25, n
        assert 0.027 <= per_token_ms(h100, n) <= 0.034, n
    # a 512-token prompt is compute bound on both (past the roofline's knee)
    assert l4.prefill_time_s(512) == pytest.approx(0.114, rel=0.05)
    assert h100.prefill_time_s(512) == pytest.approx(0.0159, rel=0.05)


def test_batch_limits_follow_vllm_0_32_defaults() -> None:
    # vLLM 0.32 (engine/arg_utils.py, get_batch_defaults), OpenAI server context
    assert vllm_batch_defaults(22.5, "NVIDIA L4") == (256, 2048)
    assert vllm_batch_defaults(79.6, "NVIDIA H100 80GB HBM3") == (1024, 8192)
    assert vllm_batch_defaults(79.2, "NVIDIA A100-SXM4-80GB") == (256, 2048)
    assert vllm_batch_defaults(178.4, "NVIDIA B200") == (1024, 16384)
    l4, h100 = PROFILES["l4-llama3.1-8b"], PROFILES["h100-qwen2.5-7b"]
    assert (l4.max_num_seqs, l4.max_num_batched_tokens) == (256, 2048)
    assert (h100.max_num_seqs, h100.max_num_batched_tokens) == (1024, 8192)
    assert Engine(h100).max_num_seqs == 1024


def test_waiting_when_kv_full_and_everything_completes() -> None:
    # 640 tokens of KV; admission takes the prompt + 1 token: 13 blocks each
    e = Engine(TINY, num_gpu_blocks=40)
    for i in range(6):
        add(e, f"r{i}", f"p{i}-", 200, 30)
    out = e.step(0.0)
    assert e.num_running == 3 and e.num_waiting == 3
    assert e.kv_cache_usage == pytest.approx(39 / 40)
    tr = Trace()
    tr.record(out, out.duration_s)
    _, tr = drain(e, out.duration_s, tr)
    assert tr.produced == {f"r{i}": 30 for i in range(6)}
    assert set(tr.done) == {f"r{i}" for i in range(6)}
    assert e.kv_cache_usage == 0.0


def test_max_num_seqs_bounds_the_batch() -> None:
    e = Engine(TINY, max_num_seqs=3)
    for i in range(5):
        add(e, f"r{i}", f"p{i}-", 20, 5)
    e.step(0.0)
    assert (e.num_running, e.num_waiting) == (3, 2)


def test_exact_output_lengths() -> None:
    e = Engine(TINY)
    for i, n in enumerate([1, 7, 33]):
        add(e, f"r{i}", f"p{i}-", 50, n)
    _, tr = drain(e)
    assert tr.produced == {"r0": 1, "r1": 7, "r2": 33}


def test_eviction_under_a_small_cache_forgets_old_prefixes() -> None:
    e = Engine(TINY, num_gpu_blocks=48)
    add(e, "old", "old", 320, 2)
    t, _ = drain(e)
    assert e.num_cached_blocks == 20
    for i in range(4):  # unrelated prompts that need the whole cache
        add(e, f"n{i}", f"n{i}-", 320, 2, t)
        t, _ = drain(e, t)
    assert e.evictions > 0
    hits_before = e.prefix_cache_hits
    add(e, "old2", "old", 320, 2, t)
    drain(e, t)
    assert e.prefix_cache_hits == hits_before  # the old prefix is gone


def test_lru_keeps_the_recently_used_prefix() -> None:
    e = Engine(TINY, num_gpu_blocks=50)  # room for two idle 21-block prompts, not three
    t = 0.0
    for rid, prefix in [("a", "A"), ("b", "B"), ("a2", "A")]:  # A is touched after B
        add(e, rid, prefix, 320, 1, t)
        t, _ = drain(e, t)
    add(e, "c", "C", 320, 1, t)  # needs 21 fresh blocks: evicts from the LRU end (B)
    t, _ = drain(e, t)
    hits = e.prefix_cache_hits
    add(e, "a3", "A", 320, 1, t)
    t, _ = drain(e, t)
    assert e.prefix_cache_hits - hits == 19 * BS  # A fully cached
    hits = e.prefix_cache_hits
    add(e, "b2", "B", 320, 1, t)
    drain(e, t)
    assert e.prefix_cache_hits - hits < 19 * BS  # B lost blocks


def test_preemption_when_decode_runs_out_of_blocks() -> None:
    # 3 requests whose prompts fit together but whose outputs do not
    e = Engine(TINY, num_gpu_blocks=30, max_num_batched_tokens=512)
    for i in range(3):
        add(e, f"r{i}", f"q{i}-", 120, 100)
    out = e.step(0.0)
    assert e.num_running == 3
    tr = Trace()
    tr.record(out, out.duration_s)
    _, tr = drain(e, out.duration_s, tr)
    assert e.num_preemptions > 0 and tr.preempted
    # vLLM preempts the most recently admitted request first
    assert tr.preempted[0] == "r2"
    assert set(tr.done) == {"r0", "r1", "r2"}
    # preempted requests recompute and still produce exactly max_tokens tokens in total
    assert tr.produced == {"r0": 100, "r1": 100, "r2": 100}
    assert e.kv_cache_usage == 0.0
    assert e.num_free_blocks == 30  # nothing leaked


def test_request_larger_than_cache_is_rejected() -> None:
    e = Engine(TINY, num_gpu_blocks=8)
    with pytest.raises(ValueError, match="KV blocks"):
        e.add_request("big", 1000, [], 10, 0.0)


def test_abort_frees_blocks_running_and_waiting() -> None:
    e = Engine(TINY, max_num_seqs=1)
    add(e, "a", "w", 300, 50)
    add(e, "b", "v", 300, 50)
    e.step(0.0)
    assert e.kv_cache_usage > 0 and e.num_waiting == 1
    assert e.abort("a") and e.abort("b")
    assert not e.abort("a")
    assert e.kv_cache_usage == 0.0 and not e.has_work()
    assert e.num_free_blocks == TINY.num_gpu_blocks


def _replay(reqs: list[tuple[int, int, float]], fast: bool, fuse_s: float, blocks: int) -> tuple[Trace, Engine]:
    e = Engine(TINY, num_gpu_blocks=blocks, max_num_seqs=6)
    pending = sorted(enumerate(reqs), key=lambda x: x[1][2])
    t = 0.0
    tr = Trace()
    while pending or e.has_work():
        while pending and pending[0][1][2] <= t:
            i, (p, m, _) = pending.pop(0)
            add(e, f"r{i}", f"s{i % 3}-", p, m, t)
        if not e.has_work():
            t = pending[0][1][2]
            continue
        horizon = pending[0][1][2] if pending else float("inf")
        if fast:
            t, out = e.run_until(t, min(t + fuse_s, horizon))
        else:
            out = e.step(t)
            t += out.duration_s
        tr.record(out, t)
    return tr, e


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(20, 300), st.integers(1, 60), st.floats(0, 0.3)), min_size=1, max_size=12),
    st.sampled_from([0.001, 0.01, 1e9]),
    st.sampled_from([40, 60, 120]),
)
def test_fast_forward_matches_single_steps(reqs: list[tuple[int, int, float]], fuse_s: float, blocks: int) -> None:
    """Arrivals land between steps in both runs only if fused chunks never jump past an
    arrival, so the horizon is the next arrival; then both runs see the same schedule."""
    slow, e_slow = _replay(reqs, False, fuse_s, blocks)
    fast, e_fast = _replay(reqs, True, fuse_s, blocks)
    assert fast.produced == slow.produced
    assert all(fast.produced[f"r{i}"] == m for i, (_, m, _) in enumerate(reqs))
    assert fast.done.keys() == slow.done.keys()
    for k in slow.done:
        assert fast.done[k] == pytest.approx(slow.done[k], rel=1e-9, abs=1e-9)
        assert fast.first[k] == pytest.approx(slow.first[k], rel=1e-9, abs=1e-9)
    assert fast.preempted == slow.preempted
    assert fast.steps == slow.steps
    assert (e_fast.prefix_cache_hits, e_fast.evictions) == (e_slow.prefix_cache_hits, e_slow.evictions)


def test_fast_forward_fuses_pure_decode() -> None:
    e = Engine(TINY)
    add(e, "a", "w", 40, 200)
    add(e, "b", "v", 40, 150)
    t, out = e.run_until(0.0, 1e9)
    assert out.steps == 1 and len(out.first_token) == 2  # the prefill step is not fused
    t, out = e.run_until(t, 1e9)
    assert out.steps == 149 and out.finished == ["b"]  # fused up to b's last token
    assert dict(out.tokens) == {"a": 149, "b": 149}
    t2, out = e.run_until(t, t + 10 * TINY.step_time_s(0, 1, 200))  # deadline bounds it
    assert 1 <= out.steps <= 10 and t2 > t
