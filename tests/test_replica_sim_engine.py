"""The stand-in's engine model: prefix caching, KV capacity, eviction, preemption."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.replica_sim.engine import Engine, chained_block_hashes
from skymesh.replica_sim.profiles import PROFILES

TINY = PROFILES["tiny-test"]


def words(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def drain(e: Engine, t: float = 0.0) -> tuple[float, dict[str, float], dict[str, float], dict[str, int]]:
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    produced: dict[str, int] = {}
    while e.has_work():
        out = e.step(t)
        assert out.steps == 1
        t += out.duration_s
        for rid in out.first_token:
            first[rid] = t
        for rid, n in out.tokens:
            produced[rid] = produced.get(rid, 0) + n
        for rid in out.finished:
            done[rid] = t
    return t, first, done, produced


def test_chained_hashes_cover_full_blocks_only_and_chain() -> None:
    a = chained_block_hashes(words("w", 40), 16)
    assert len(a) == 2
    b = chained_block_hashes(words("w", 32) + words("x", 8), 16)
    assert a == b  # same two full blocks
    c = chained_block_hashes(["z"] + words("w", 31), 16)
    assert c[1] != a[1]  # block 2 differs because block 1 differs (chained)


def test_second_identical_prompt_hits_cache_and_is_faster() -> None:
    e = Engine(TINY)
    toks = words("w", 600)
    h = chained_block_hashes(toks, 16)
    e.add_request("a", 600, h, 4, 0.0)
    t, first, _, _ = drain(e)
    ttft_a = first["a"]
    e.add_request("b", 600, h, 4, t)
    _, first, _, _ = drain(e, t)
    ttft_b = first["b"] - t
    assert ttft_b < 0.5 * ttft_a
    # 600 tokens = 37 full blocks; the last token is always recomputed → 37 blocks hit
    assert e.prefix_cache_hits == 37 * 16
    assert e.prefix_cache_queries == 1200


def test_waiting_when_kv_full_and_everything_completes() -> None:
    e = Engine(TINY, num_gpu_blocks=40)  # 640 tokens of KV
    for i in range(6):
        e.add_request(f"r{i}", 200, chained_block_hashes(words(f"p{i}-", 200), 16), 30, 0.0)
    out = e.step(0.0)
    assert e.num_waiting > 0 and e.num_running > 0
    assert e.kv_cache_usage > 0.5
    _, _, done, produced = drain(e, out.duration_s)
    for rid, n in out.tokens:
        produced[rid] = produced.get(rid, 0) + n
    assert len(done) == 6
    assert produced == {f"r{i}": 30 for i in range(6)}


def test_exact_output_lengths() -> None:
    e = Engine(TINY)
    for i, n in enumerate([1, 7, 33]):
        e.add_request(f"r{i}", 50, [], n, 0.0)
    _, _, _, produced = drain(e)
    assert produced == {"r0": 1, "r1": 7, "r2": 33}


def test_eviction_under_a_small_cache_forgets_old_prefixes() -> None:
    e = Engine(TINY, num_gpu_blocks=48)
    old = chained_block_hashes(words("old", 320), 16)
    e.add_request("old", 320, old, 2, 0.0)
    t, *_ = drain(e)
    for i in range(4):  # unrelated prompts that need the whole cache
        e.add_request(f"n{i}", 320, chained_block_hashes(words(f"n{i}-", 320), 16), 2, t)
        t, *_ = drain(e, t)
    assert e.evictions > 0
    hits_before = e.prefix_cache_hits
    e.add_request("old2", 320, old, 2, t)
    drain(e, t)
    assert e.prefix_cache_hits - hits_before < 19 * 16  # the old prefix is (mostly) gone


def test_preemption_when_decode_runs_out_of_blocks() -> None:
    # 3 requests whose prompts fit together but whose outputs do not
    e = Engine(TINY, num_gpu_blocks=30, max_num_batched_tokens=512)
    for i in range(3):
        e.add_request(f"r{i}", 120, chained_block_hashes(words(f"q{i}-", 120), 16), 100, 0.0)
    _, _, done, produced = drain(e)
    assert e.num_preemptions > 0
    assert len(done) == 3
    # preempted requests recompute and still produce exactly max_tokens new tokens
    assert all(produced[f"r{i}"] == 100 for i in range(3)), produced
    assert e.kv_cache_usage == 0.0


def test_request_larger_than_cache_is_rejected() -> None:
    e = Engine(TINY, num_gpu_blocks=8)
    with pytest.raises(ValueError, match="KV blocks"):
        e.add_request("big", 1000, [], 10, 0.0)


def test_abort_frees_blocks() -> None:
    e = Engine(TINY)
    e.add_request("a", 300, [], 50, 0.0)
    e.step(0.0)
    assert e.kv_cache_usage > 0
    assert e.abort("a")
    assert e.kv_cache_usage == 0.0 and not e.has_work()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(20, 300), st.integers(1, 60)), min_size=1, max_size=12))
def test_fast_forward_matches_single_steps(reqs: list[tuple[int, int]]) -> None:
    def run(fast: bool) -> tuple[dict[str, float], dict[str, int]]:
        e = Engine(TINY, num_gpu_blocks=120)
        for i, (p, m) in enumerate(reqs):
            e.add_request(f"r{i}", p, chained_block_hashes(words(f"s{i % 3}-", p), 16), m, 0.0)
        t = 0.0
        done: dict[str, float] = {}
        produced: dict[str, int] = {}
        while e.has_work():
            if fast:
                t, out = e.run_until(t, 1e9)
            else:
                out = e.step(t)
                t += out.duration_s
            for rid, n in out.tokens:
                produced[rid] = produced.get(rid, 0) + n
            for rid in out.finished:
                done[rid] = t
        return done, produced

    slow_done, slow_tokens = run(False)
    fast_done, fast_tokens = run(True)
    assert slow_tokens == fast_tokens
    assert slow_done.keys() == fast_done.keys()
    for k in slow_done:
        assert fast_done[k] == pytest.approx(slow_done[k], rel=1e-9, abs=1e-9)


def test_l4_profile_takes_about_300_ms_for_512_tokens() -> None:
    # SkyWalker's measured TTFT for a 512-token prompt on an L4 with Llama-3.1-8B
    e = Engine(PROFILES["l4-llama3.1-8b"])
    e.add_request("a", 512, [], 1, 0.0)
    out = e.step(0.0)
    assert out.first_token == ["a"]
    assert out.duration_s == pytest.approx(0.300, abs=0.005)
