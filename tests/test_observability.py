"""The dashboard and the scrape config that ship: every query names a metric the mesh
exports, promtool accepts the generated config, and a real Prometheus scraping the local
mesh answers every query of the dashboard with data."""

from __future__ import annotations

import asyncio
import math
import re
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controller.metrics import ControllerMetrics
from skymesh.balancer.metrics import BalancerMetrics, BalancerSnapshot
from skymesh.config import parse_config
from skymesh.operations.observability import (
    dashboard,
    dashboard_queries,
    scrape_config,
    write_files,
)
from skymesh.runtime.procs import free_port
from skymesh.testing import prometheus_env
from tests.mesh_helpers import local_config_free_ports
from tests.test_mesh_faults import AP, EU, REGION_SOURCES
from tests.test_mesh_integration import client_session, running_mesh, wait_for

GOLDEN = Path(__file__).parent / "golden"
# PromQL words that are not metric names
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
             "unless", "inf", "nan"}


def metric_names_in(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label lists, matchers, ranges and
    function names taken out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # label lists
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word, rest = m.group(0), expr[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue  # a function or aggregation
        names.add(word)
    return names


def exported_series_names(page: str) -> set[str]:
    """The sample names a /metrics page can carry, from its families (a histogram's
    _bucket/_sum/_count, a counter's _total) even when a labelled family has no sample yet."""
    out: set[str] = set()
    for fam in text_string_to_metric_families(page):
        if fam.type == "histogram":
            out |= {fam.name + "_bucket", fam.name + "_sum", fam.name + "_count"}
        elif fam.type == "counter":
            out |= {fam.name + "_total", fam.name}
        else:
            out.add(fam.name)
        out |= {s.name for s in fam.samples}
    return out


def test_metric_names_are_read_from_promql() -> None:
    assert metric_names_in('histogram_quantile(0.95, sum by (le, region) (rate(a_bucket{job="x"}[1m])))') == \
        {"a_bucket"}
    assert metric_names_in("max by (region, replica) (vllm:num_requests_waiting) or b") == \
        {"vllm:num_requests_waiting", "b"}


def test_every_dashboard_query_names_a_metric_the_mesh_exports() -> None:
    balancer = BalancerMetrics("us-east-1", lambda: BalancerSnapshot(0, 0, 0, 0.0, [], []))
    pages = [generate_latest(balancer.registry).decode(), generate_latest(ControllerMetrics().registry).decode(),
             # real vLLM 0.32's page: the replica panels read what vLLM exports, not only the stand-in
             (GOLDEN / "vllm_metrics.txt").read_text()]
    exported = set().union(*(exported_series_names(p) for p in pages))
    queries = dashboard_queries()
    assert len(queries) >= 12
    missing = {(title, name) for title, expr in queries for name in metric_names_in(expr) if name not in exported}
    assert not missing, missing
    # every panel has a query, a title and a unit; ids are unique
    panels = dashboard()["panels"]
    assert all(p["targets"] and p["title"] and p["fieldConfig"]["defaults"]["unit"] for p in panels)
    assert len({p["id"] for p in panels}) == len(panels)


def test_the_scrape_config_names_every_balancer_replica_and_the_controller(tmp_path: Path) -> None:
    cfg = parse_config(local_config_free_ports(siblings=1))
    conf = scrape_config(cfg, token_file=tmp_path / "admin-token")
    jobs = {j["job_name"]: j for j in conf["scrape_configs"]}
    balancers = [t for sc in jobs["skymesh-balancer"]["static_configs"] for t in sc["targets"]]
    assert sorted(balancers) == sorted(f"{m.listen.host}:{m.listen.port}" for r in cfg.regions
                                       for m in r.balancer_members)
    assert len(balancers) == 2 * len(cfg.regions)  # both members of every region
    replicas = {sc["labels"]["replica"]: sc["labels"]["region"] for sc in jobs["vllm"]["static_configs"]}
    assert replicas == {rep.id: r.name for r in cfg.regions for rep in r.replicas}
    assert jobs["skymesh-balancer"]["authorization"]["credentials_file"] == str(tmp_path / "admin-token")
    assert "authorization" not in jobs["vllm"]  # vLLM's page is open


def promtool() -> Path:
    reason = prometheus_env.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return prometheus_env.binary("promtool")


def test_promtool_accepts_the_generated_scrape_config(tmp_path: Path) -> None:
    tool = promtool()
    cfg = parse_config(local_config_free_ports())
    token = tmp_path / "admin-token"
    token.write_text("t\n")
    scrape, _ = write_files(cfg, tmp_path / "obs", token_file=token)
    out = subprocess.run([str(tool), "check", "config", str(scrape)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    # and the check can fail: a scrape config Prometheus would refuse
    bad = tmp_path / "bad.yml"
    bad.write_text(scrape.read_text().replace("scrape_interval:", "scrape_intervall:", 1))
    refused = subprocess.run([str(tool), "check", "config", str(bad)], capture_output=True, text=True, check=False)
    assert refused.returncode != 0


async def _query(s: aiohttp.ClientSession, base: str, expr: str) -> list[dict[str, Any]]:
    async with s.get(base + "/api/v1/query", params={"query": expr}) as r:
        doc = await r.json()
    assert doc["status"] == "success", doc
    return list(doc["data"]["result"])


async def _stream(s: aiohttp.ClientSession, url: str, prompt: str) -> int:
    body = {"model": "skymesh-sim", "prompt": prompt, "max_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True}}
    async with s.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status


async def test_a_real_prometheus_scrapes_the_local_mesh_and_answers_every_dashboard_query(tmp_path: Path) -> None:
    prometheus = prometheus_env.binary("prometheus")
    promtool()  # skips without the binaries
    async with running_mesh(tmp_path, profile="tiny-test") as mesh:
        scrape, _ = write_files(mesh.cfg, tmp_path / "obs", interval_s=1.0)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with (tmp_path / "prometheus.log").open("w") as log:
            proc = await asyncio.create_subprocess_exec(
                str(prometheus), f"--config.file={scrape}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h",
                stdout=asyncio.subprocess.DEVNULL, stderr=log)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                expected_targets = sum(len(sc["targets"]) for j in scrape_config(mesh.cfg)["scrape_configs"]
                                       for sc in j["static_configs"])

                async def all_targets_up() -> bool:
                    try:
                        up = await _query(s, base, "up == 1")
                    except (aiohttp.ClientError, OSError):
                        return False
                    return len(up) == expected_targets

                await wait_for(all_targets_up, 60, "prometheus scraping every target of the mesh")
                # traffic after the first scrapes, in two waves: a labelled series exists from its
                # first request on, and rate() sees it rise only between two scrapes that both
                # have it. Streamed answers in every region, EU clients at ap-northeast-1
                # (forwarded to eu-west-1: their residency), and a body the balancer refuses (400)
                async def wave(tag: str) -> None:
                    for region in mesh.cfg.regions:
                        async with client_session(REGION_SOURCES[region.name]) as c:
                            url = region.balancer.advertise_url
                            statuses = await asyncio.gather(*(_stream(c, url, f"hello {region.name} {tag}{i}")
                                                              for i in range(3)))
                            assert statuses == [200] * 3
                    async with client_session(REGION_SOURCES[EU]) as c:
                        ap_url = mesh.cfg.region(AP).balancer.advertise_url
                        statuses = await asyncio.gather(*(_stream(c, ap_url, f"eu user {tag}{i} far away")
                                                          for i in range(2)))
                        assert statuses == [200] * 2
                        async with c.post(ap_url + "/v1/completions", json={"model": "skymesh-sim", "prompt": 7}) as r:
                            assert r.status == 400

                await wave("a")

                async def first_wave_scraped() -> bool:
                    got = await _query(s, base, "sum(skymesh_client_e2e_seconds_count)")
                    return bool(got) and float(got[0]["value"][1]) == 11

                await wait_for(first_wave_scraped, 30, "the first wave's answers scraped")
                await wave("b")

                queries = dashboard_queries()

                async def every_query_has_data() -> bool:
                    for _, expr in queries:
                        result = await _query(s, base, expr)
                        if not any(math.isfinite(float(x["value"][1])) for x in result):
                            return False
                    return True

                try:
                    await wait_for(every_query_has_data, 60, "every dashboard query answered with data")
                except TimeoutError:
                    empty = [title for title, expr in queries
                             if not any(math.isfinite(float(x["value"][1])) for x in await _query(s, base, expr))]
                    raise AssertionError(f"panels without data: {empty}") from None
                # every query having data says nothing of the last scrape of each balancer:
                # wait until both waves' answers are in (a balancer scraped before its second
                # wave ended would read short)
                async def both_waves_scraped() -> bool:
                    got = await _query(s, base, "sum(skymesh_client_e2e_seconds_count)")
                    return bool(got) and float(got[0]["value"][1]) == 22

                await wait_for(both_waves_scraped, 30, "both waves' answers scraped")
                served = await _query(s, base, "sum by (region, served) (skymesh_client_e2e_seconds_count)")
                by = {(x["metric"]["region"], x["metric"]["served"]): float(x["value"][1]) for x in served}
                # the forwarded ones are counted once, where their client called
                assert by[(AP, "peer")] >= 4
                for r in mesh.cfg.regions:
                    answered = by.get((r.name, "local"), 0) + by.get((r.name, "peer"), 0)
                    assert answered == (10 if r.name == AP else 6), by
        finally:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
