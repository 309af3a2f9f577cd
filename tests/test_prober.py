"""parse_probe: a well-formed vLLM page is read; a malformed one is an unhealthy result,
never an exception (one used to stop the balancer's probe loop and freeze availability)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.balancer.prober import parse_probe

L = '{engine="0",model_name="m"}'
GOOD = f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{L} 3.0
vllm:num_requests_waiting{L} 1.0
vllm:kv_cache_usage_perc{L} 0.25
vllm:prefix_cache_queries_total{L} 100.0
vllm:prefix_cache_hits_total{L} 40.0
"""


def test_a_well_formed_page_is_healthy() -> None:
    r = parse_probe(GOOD)
    assert r.healthy and r.error == ""
    assert (r.num_running, r.num_waiting, r.kv_usage) == (3, 1, 0.25)
    assert (r.prefix_queries, r.prefix_hits) == (100.0, 40.0)


@pytest.mark.parametrize("metric", ["vllm:num_requests_running", "vllm:num_requests_waiting",
                                    "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total"])
@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-1.0", "1e999"])
def test_a_non_finite_or_negative_value_is_unhealthy(metric: str, value: str) -> None:
    page = "\n".join(
        f"{metric}{L} {value}" if line.startswith(metric + "{") else line for line in GOOD.splitlines()
    )
    r = parse_probe(page)
    assert not r.healthy
    assert metric in r.error


@pytest.mark.parametrize("page", [
    "",
    "<html>502 Bad Gateway</html>",
    f"vllm:num_requests_running{L} three\nvllm:num_requests_waiting{L} 0\n",
    "vllm:num_requests_running\nvllm:num_requests_waiting\n",
    f"vllm:num_requests_running{L}\nvllm:num_requests_waiting{L} 0\n",
    "vllm:num_requests_running{engine=\"0\" 1\n\x00\xff\n",
])
def test_garbage_is_unhealthy(page: str) -> None:
    r = parse_probe(page)
    assert not r.healthy and r.error


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.text(max_size=40),
    st.builds(lambda name, value: f"{name}{L} {value}",
              st.sampled_from(["vllm:num_requests_running", "vllm:num_requests_waiting",
                               "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total"]),
              st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr),
                        st.sampled_from(["NaN", "+Inf", "-Inf", "nan", "1e999", "-0", "0x1p3", ""]),
                        st.text(max_size=8))),
), max_size=8))
def test_parse_probe_never_raises(lines: list[str]) -> None:
    r = parse_probe("\n".join(lines))
    assert r.healthy or r.error
    if r.healthy:
        assert r.num_running >= 0 and r.num_waiting >= 0 and r.kv_usage >= 0


REAL_PAGE = (Path(__file__).parent / "golden" / "vllm_metrics.txt").read_text()


def test_a_real_vllm_0_32_page_is_read() -> None:
    """A page real vLLM 0.32 (CPU) served with requests running and waiting (recorded by
    tests/test_vllm_real.py): ~50 KB, ~370 vllm: series, vllm:num_requests_waiting_by_reason
    next to vllm:num_requests_waiting (a longer name the reader must not add in)."""
    want = {}
    for line in REAL_PAGE.splitlines():
        m = re.fullmatch(r'(vllm:[a-z_]+)\{engine="0",model_name="skymesh-sim"\} (\S+)', line)
        if m:
            want[m.group(1)] = float(m.group(2))
    r = parse_probe(REAL_PAGE)
    assert r.healthy, r.error
    assert r.num_running == want["vllm:num_requests_running"] and r.num_waiting == want["vllm:num_requests_waiting"]
    assert r.num_waiting > 0  # the page was recorded under a burst
    assert r.kv_usage == want["vllm:kv_cache_usage_perc"]
    assert r.prefix_queries == want["vllm:prefix_cache_queries_total"]
    assert r.prefix_hits == want["vllm:prefix_cache_hits_total"]
    assert "vllm:num_requests_waiting_by_reason{" in REAL_PAGE and "vllm:gpu_cache_usage_perc" not in REAL_PAGE


def test_engines_of_one_server_add_up_and_kv_usage_is_their_mean() -> None:
    """vLLM with data parallelism: one series per engine on one page."""
    page = "\n".join(
        f'{name}{{engine="{e}",model_name="m"}} {value}'
        for e, (run, wait, kv, q, h) in enumerate([(3, 1, 0.5, 100, 40), (1, 0, 0.1, 50, 10)])
        for name, value in [("vllm:num_requests_running", run), ("vllm:num_requests_waiting", wait),
                            ("vllm:kv_cache_usage_perc", kv), ("vllm:prefix_cache_queries_total", q),
                            ("vllm:prefix_cache_hits_total", h)]
    )
    r = parse_probe(page)
    assert (r.num_running, r.num_waiting, r.prefix_queries, r.prefix_hits) == (4, 1, 150.0, 50.0)
    assert r.kv_usage == pytest.approx(0.3)
