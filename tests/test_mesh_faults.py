"""Fault injection on the whole local mesh (real processes on loopback): a balancer killed
or drained, the links into a region cut. Each test prints one ``FIGURES {json}`` line
(run with ``-s``); docs/reliability.md collects them with the command."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skymesh.operations.up import Mesh
from tests.mesh_helpers import report_figures
from tests.test_mesh_integration import (
    REGION_SOURCES,
    admin,
    burst,
    client_session,
    controller_topology,
    owned,
    resolve,
    running_mesh,
    wait_for,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.fault]

US, EU, AP = "us-east-1", "eu-west-1", "ap-northeast-1"


def mesh_with(tmp_path: Path, **controller: Any) -> Any:
    return running_mesh(tmp_path, controller)


def advertised_url(mesh: Mesh, ip: str) -> str:
    port = next(r.balancer.advertise.port for r in mesh.cfg.regions if r.balancer.advertise.host == ip)
    return f"http://{ip}:{port}"


async def ask(s: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 8,
              stream: bool = False) -> dict[str, Any]:
    """One completion; a connection that fails or breaks is a result too (status 0)."""
    body = {"model": "skymesh-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    try:
        async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            data = await r.read()
            return {"status": r.status, "region": r.headers.get("X-Skymesh-Region", ""),
                    "replica": r.headers.get("X-Skymesh-Replica", ""), "path": r.headers.get("X-Skymesh-Path", ""),
                    "done": (b"[DONE]" in data) if stream else r.status == 200}
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return {"status": 0, "error": type(e).__name__, "region": "", "replica": "", "path": "", "done": False}


class Client:
    """A user in one region who resolves the mesh name (TTL 1 s, re-resolved every
    request as a resolver with that TTL would at worst) and, like the OpenAI SDK, retries a
    request whose connection failed, after resolving again. Bounded: ``n`` requests."""

    def __init__(self, mesh: Mesh, region: str, n: int, pause_s: float = 0.05) -> None:
        self.mesh, self.region, self.n, self.pause_s = mesh, region, n, pause_s
        self.results: list[dict[str, Any]] = []
        self.connection_failures: list[float] = []  # when each failed attempt happened

    async def run(self) -> None:
        source = REGION_SOURCES[self.region]
        async with client_session(source) as s:
            for i in range(self.n):
                for _attempt in range(20):
                    ip = await asyncio.to_thread(resolve, self.mesh, source)
                    res = await ask(s, advertised_url(self.mesh, ip), f"{self.region} user {i % 7} asks {i}")
                    res["balancer_ip"], res["at"] = ip, time.monotonic()
                    if res["status"] != 0:
                        break
                    self.connection_failures.append(time.monotonic())
                    await asyncio.sleep(0.2)
                self.results.append(res)
                await asyncio.sleep(self.pause_s)


async def test_a_killed_balancer_fails_over_dns_moves_and_residency_holds(tmp_path: Path) -> None:
    async with mesh_with(tmp_path, probe_interval_s=0.5, failure_threshold=3) as mesh:
        eu_replicas = {r.id for r in mesh.cfg.region(EU).replicas}
        eu_ip, us_ip = mesh.cfg.region(EU).balancer.advertise.host, mesh.cfg.region(US).balancer.advertise.host
        eu_users, us_users = Client(mesh, EU, 120), Client(mesh, US, 120)
        load = asyncio.gather(eu_users.run(), us_users.run())
        await asyncio.sleep(1.0)
        t_kill = time.monotonic()
        await mesh.stop_balancer(EU, kill=True)

        async def dns_moved() -> bool:
            return await asyncio.to_thread(resolve, mesh, REGION_SOURCES[EU]) == us_ip

        dns_s = await wait_for(dns_moved, 30, "the EU clients' DNS answer moving to us-east-1")

        async def adopted() -> bool:
            st = await admin(mesh, US)
            return st is not None and eu_replicas <= set(st["replicas"])

        adopt_s = await wait_for(adopted, 30, "us-east-1 serving the adopted EU replicas") + dns_s
        await load
        eu_ok = [r for r in eu_users.results if r["status"] == 200]
        moved = [r for r in eu_ok if r["balancer_ip"] == us_ip]
        # every EU user's request was answered in the end (after retries on a refused
        # connection), and those answered through us-east-1 ran on EU replicas only
        assert len(eu_ok) == len(eu_users.results) == 120, [r for r in eu_users.results if r["status"] != 200]
        assert moved, "no EU request went through us-east-1 after the failover"
        assert {r["replica"] for r in moved} <= eu_replicas, {r["replica"] for r in moved}
        assert all(r["status"] == 200 for r in us_users.results)
        first_served = min(r["at"] for r in moved) - t_kill
        # and back: the restarted balancer takes its replicas and its clients again
        await mesh.start_balancer(EU)

        async def handed_back() -> bool:
            topo = await controller_topology(mesh)
            return (topo is not None and owned(topo, EU) == eu_replicas
                    and await asyncio.to_thread(resolve, mesh, REGION_SOURCES[EU]) == eu_ip)

        back_s = await wait_for(handed_back, 30, "replicas and DNS back to eu-west-1")
        report_figures("balancer_killed", dns_moved_s=dns_s, replicas_adopted_s=adopt_s,
                       first_eu_request_served_after_kill_s=first_served,
                       eu_requests=len(eu_users.results), eu_served_via_us_east_1=len(moved),
                       eu_connection_failures_retried=len(eu_users.connection_failures),
                       residency_violations=sum(r["replica"] not in eu_replicas for r in moved),
                       us_requests_failed=sum(r["status"] != 200 for r in us_users.results),
                       handed_back_after_restart_s=back_s, controller_probe="0.5 s x 3", dns_ttl_s=1)


async def test_a_draining_balancer_deregisters_so_dns_moves_before_it_exits(tmp_path: Path) -> None:
    # probes this slow would find the balancer gone only ~6 s after its listener closed:
    # DNS moving while it still drains can only come from the deregistration
    async with mesh_with(tmp_path, probe_interval_s=2.0, failure_threshold=3) as mesh:
        eu_replicas = {r.id for r in mesh.cfg.region(EU).replicas}
        us_ip = mesh.cfg.region(US).balancer.advertise.host
        eu_url = mesh.cfg.region(EU).balancer.advertise_url
        async with client_session(REGION_SOURCES[EU]) as s:
            # long streams, in flight when SIGTERM comes
            streams = [asyncio.create_task(ask(s, eu_url, f"long story {i}", max_tokens=1200, stream=True))
                       for i in range(6)]

            async def streaming() -> bool:
                st = await admin(mesh, EU)
                return st is not None and st["in_flight"] >= 6

            await wait_for(streaming, 20, "six streams in flight at eu-west-1")
            child = mesh.balancers[EU]
            t_term = time.monotonic()
            child.signal_group(signal.SIGTERM)

            async def dns_moved() -> bool:
                return await asyncio.to_thread(resolve, mesh, REGION_SOURCES[EU]) == us_ip

            dns_s = await wait_for(dns_moved, 30, "DNS moving off the draining balancer")
            still_draining = child.running()
            results = await asyncio.gather(*streams)
        await asyncio.to_thread(child.proc.wait, 30)  # type: ignore[union-attr]
        exit_s = time.monotonic() - t_term
        topo = await controller_topology(mesh)
        assert topo is not None
        assert still_draining, "DNS moved only after the balancer had exited (no deregistration?)"
        assert all(r["status"] == 200 and r["done"] for r in results), results  # the drain finished them
        assert child.returncode == 0
        assert eu_replicas <= owned(topo, US)  # handed to the nearest live region at once
        report_figures("balancer_drained", dns_moved_after_sigterm_s=dns_s, exited_after_sigterm_s=exit_s,
                       streams_in_flight=len(results), streams_completed=sum(r["done"] for r in results),
                       controller_probe="2.0 s x 3 (would need ~6 s)")


async def test_links_cut_into_a_region_peers_stop_offloading_there_and_resume(tmp_path: Path) -> None:
    async with mesh_with(tmp_path) as mesh:
        staleness_s = mesh.cfg.offload.heartbeat_interval_s * mesh.cfg.offload.heartbeat_miss_limit

        async def eu_seen_by(region: str, available: bool) -> bool:
            st = await admin(mesh, region)
            return st is not None and st["peers"][EU]["available"] is available

        reset = mesh.cut_links_into(EU)
        down_s = await wait_for(lambda: eu_seen_by(US, False), 20, "us-east-1 marking eu-west-1 unavailable")
        await wait_for(lambda: eu_seen_by(AP, False), 20, "ap-northeast-1 marking eu-west-1 unavailable")
        # local serving goes on everywhere; us-east-1's overflow goes to ap-northeast-1 only
        during_us, during_eu = await asyncio.gather(burst(mesh, US, 60), burst(mesh, EU, 12))
        assert all(r["status"] == 200 for r in during_us + during_eu)
        assert not any("eu-west-1" in r["path"] for r in during_us)
        offloaded_during = sum(r["offloaded"] == "1" for r in during_us)
        mesh.mend_links_into(EU)
        up_s = await wait_for(lambda: eu_seen_by(US, True), 20, "us-east-1 seeing eu-west-1 again")
        after_us = await burst(mesh, US, 60)
        assert all(r["status"] == 200 for r in after_us)
        # the nearest peer takes us-east-1's overflow again
        to_eu = sum(r["path"] == "us-east-1>eu-west-1" for r in after_us)
        assert to_eu > 0
        report_figures("links_cut_into_eu_west_1", connections_reset=reset, staleness_bound_s=staleness_s,
                       marked_unavailable_after_s=down_s, us_requests_during=len(during_us),
                       us_offloaded_during=offloaded_during, failed_during=0,
                       available_again_after_mend_s=up_s, us_offloaded_to_eu_after=to_eu)


async def ask_answer(s: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One non-streaming completion (its first byte comes only with its whole answer): the
    status, Retry-After, the OpenAI error code and when it came (status 0: no answer)."""
    body = {"model": "skymesh-sim", "prompt": prompt, "max_tokens": max_tokens}
    try:
        async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=150)) as r:
            data = await r.json(content_type=None)
            error = data.get("error") if isinstance(data, dict) else None
            return {"status": r.status, "retry_after": r.headers.get("Retry-After"), "at": time.monotonic(),
                    "code": error.get("code") if isinstance(error, dict) else None,
                    "replica": r.headers.get("X-Skymesh-Replica", "")}
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
        return {"status": 0, "error": type(e).__name__, "at": time.monotonic()}


async def test_requests_waiting_for_a_killed_region_are_answered_at_failover_not_at_its_return(
        tmp_path: Path) -> None:
    """EU clients that reached ap-northeast-1 (their own region's replicas are the only ones
    their residency allows) wait there for eu-west-1: forwarded and waiting for the answer,
    or queued for a free eu-west-1 replica. eu-west-1's balancer is SIGKILLed: each of them
    is answered (503 + Retry-After: nothing else may serve it) before eu-west-1 returns."""
    # the kill is seen by the heartbeat stream breaking, at once; the timeout bound is kept
    # well above a busy machine's stalls (heartbeats every 0.1 s; 3 missed, the default,
    # is 0.3 s), or the burst below could meet eu-west-1 briefly unavailable at
    # ap-northeast-1 and be answered 503 before anything is forwarded
    async with running_mesh(tmp_path, {"probe_interval_s": 0.5, "failure_threshold": 3},
                            offload={"heartbeat_miss_limit": 20}) as mesh:
        ap_url = mesh.cfg.region(AP).balancer.advertise_url
        us_ip = mesh.cfg.region(US).balancer.advertise.host
        async with client_session(REGION_SOURCES[EU]) as s:
            # ~3000 output tokens: several seconds at an eu-west-1 replica, no byte before
            waiting = [asyncio.create_task(ask_answer(s, ap_url, f"eu user {i} asks far away", 3000))
                       for i in range(24)]
            seen: dict[str, Any] = {}

            async def forwarded_and_queued() -> bool:
                # more than eu-west-1 takes at once: the rest queue at ap-northeast-1
                ap, eu = await admin(mesh, AP), await admin(mesh, EU)
                seen.update(ap=None if ap is None else {k: ap[k] for k in ("offloaded_out", "queue_length")},
                            eu=None if eu is None else eu["in_flight"],
                            answered=[t.result()["status"] for t in waiting if t.done()])
                return (ap is not None and eu is not None and ap["offloaded_out"] >= 1 and eu["in_flight"] >= 1
                        and ap["queue_length"] >= 1)

            try:
                await wait_for(forwarded_and_queued, 30, "EU requests forwarded from ap-northeast-1 and queued there")
            except TimeoutError as e:
                raise AssertionError(f"{e}; last seen: {seen}") from None
            ap_before = await admin(mesh, AP)
            assert ap_before is not None
            assert not any(t.done() for t in waiting), [t.result() for t in waiting if t.done()]
            t_kill = time.monotonic()
            await mesh.stop_balancer(EU, kill=True)

            async def eu_unavailable_at_ap() -> bool:
                st = await admin(mesh, AP)
                return st is not None and not st["peers"][EU]["available"]

            async def dns_moved() -> bool:
                return await asyncio.to_thread(resolve, mesh, REGION_SOURCES[EU]) == us_ip

            async def all_answered() -> bool:
                return all(t.done() for t in waiting)

            marked_s = await wait_for(eu_unavailable_at_ap, 30, "ap-northeast-1 seeing eu-west-1 unavailable")
            failover_s = await wait_for(dns_moved, 30, "the controller failing eu-west-1 over") + marked_s
            # bounded: answers at failover come within ~1 s; on a stranding balancer none
            # comes until eu-west-1 is back (or a 60 s queue-wait bound runs out)
            with contextlib.suppress(TimeoutError):
                await wait_for(all_answered, 30, "every waiting EU request answered")
            answered_before_restart = [t.result() for t in waiting if t.done()]
            t_restart = time.monotonic()
            await mesh.start_balancer(EU)
            results = await asyncio.gather(*waiting)
        answer_s = sorted(round(r["at"] - t_kill, 3) for r in results)
        report_figures("eu_requests_waiting_at_ap_when_eu_killed", requests=len(results),
                       forwarded_before_kill=ap_before["offloaded_out"], queued_at_ap_before_kill=ap_before["queue_length"],
                       ap_sees_eu_unavailable_s=marked_s, controller_failover_dns_moved_s=failover_s,
                       answered_after_kill_s=answer_s, answered_before_restart=len(answered_before_restart),
                       restarted_after_kill_s=round(t_restart - t_kill, 3),
                       statuses=sorted(str(r["status"]) for r in results))
        # every one answered while eu-west-1 was still down: 503 (no region its residency
        # allows is alive) with Retry-After in OpenAI's error shape
        assert len(answered_before_restart) == len(results), results
        for r in results:
            assert r["status"] == 503 and r["code"] == "no_capacity" and r["retry_after"], r


class Asker:
    """One client of ``region`` asking ``target`` (an advertised IP; None: whatever the mesh
    name resolves to for it) one short completion after another until ``stop`` is set
    (bounded: at most ``n``). Each result carries when it was sent."""

    def __init__(self, mesh: Mesh, region: str, target: str | None, stop: asyncio.Event, n: int = 400) -> None:
        self.mesh, self.region, self.target, self.stop, self.n = mesh, region, target, stop, n
        self.results: list[dict[str, Any]] = []

    async def run(self) -> None:
        source = REGION_SOURCES[self.region]
        # a connection a request at a time: no kept-alive connection to a balancer that was
        # killed or restarted is reused
        conn = aiohttp.TCPConnector(local_addr=(source, 0), limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s:
            for i in range(self.n):
                if self.stop.is_set():
                    return
                ip = self.target or await asyncio.to_thread(resolve, self.mesh, source)
                sent = time.monotonic()
                res = await ask_answer(s, advertised_url(self.mesh, ip), f"{self.region} user {i % 5} asks {i}", 4)
                res.update(sent=sent, balancer_ip=ip)
                self.results.append(res)
                await asyncio.sleep(0.05)


async def test_the_hand_back_of_a_returning_region_answers_its_clients_and_its_peers(tmp_path: Path) -> None:
    """eu-west-1's balancer is SIGKILLed, failed over (us-east-1 adopts its replicas, DNS
    moves) and started again; the controller hands its replicas and its clients back.
    EU clients keep asking through DNS, at ap-northeast-1 and at us-east-1 (a resolver that
    kept the failover's answer), AP clients through DNS. Their residency lets EU requests
    run on EU replicas only, so a 503 (with Retry-After) is right only while no balancer
    owning them is up: once the controller has told us-east-1 and ap-northeast-1 that
    eu-west-1 is back, every request is answered 200 (the peers wait for its first
    heartbeat instead of refusing, and dial it at once instead of at the end of a backoff)."""
    async with mesh_with(tmp_path, probe_interval_s=0.5, failure_threshold=3) as mesh:
        eu_replicas = {r.id for r in mesh.cfg.region(EU).replicas}
        us_ip, ap_ip = (mesh.cfg.region(r).balancer.advertise.host for r in (US, AP))
        await mesh.stop_balancer(EU, kill=True)

        async def failed_over() -> bool:
            topo = await controller_topology(mesh)
            st_us, st_ap = await admin(mesh, US), await admin(mesh, AP)
            return (topo is not None and eu_replicas <= owned(topo, US) and st_us is not None
                    and eu_replicas <= set(st_us["replicas"]) and st_ap is not None
                    and st_ap["peers"][EU]["down"] and st_us["peers"][EU]["down"]
                    and await asyncio.to_thread(resolve, mesh, REGION_SOURCES[EU]) == us_ip)

        await wait_for(failed_over, 30, "eu-west-1 failed over to us-east-1")
        # the peers' heartbeat re-dials back off to their cap (2 s) while eu-west-1 is dead
        await asyncio.sleep(4.0)
        stop = asyncio.Event()
        askers = [Asker(mesh, EU, None, stop), Asker(mesh, EU, ap_ip, stop), Asker(mesh, EU, ap_ip, stop),
                  Asker(mesh, EU, us_ip, stop), Asker(mesh, EU, us_ip, stop), Asker(mesh, AP, None, stop)]
        load = asyncio.gather(*(a.run() for a in askers))
        before = {r: (await admin(mesh, r) or {}).get("topology_version", 0) for r in (US, AP)}
        await asyncio.sleep(0.5)
        t_restart = time.monotonic()
        restart = asyncio.create_task(mesh.start_balancer(EU))
        # the moment both peers have applied the controller's word that eu-west-1 is back
        # (the first topology after the restart), looked at every 20 ms: bounded by count
        for _ in range(3000):
            versions = [(await admin(mesh, r) or {}).get("topology_version", 0) for r in (US, AP)]
            if all(v > before[r] for v, r in zip(versions, (US, AP), strict=True)):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("us-east-1 and ap-northeast-1 were never told that eu-west-1 is back")
        t_told = time.monotonic()
        # EU clients arriving at that moment at us-east-1 (whose adopted EU replicas just
        # left) and at ap-northeast-1: the region is between owners for them
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                local_addr=(REGION_SOURCES[EU], 0), limit=0, force_close=True)) as s:
            at_once = await asyncio.gather(*(
                ask_answer(s, advertised_url(mesh, ip), f"eu user {k} arrives at the hand-back", 4)
                for ip in (us_ip, ap_ip) for k in range(8)))
        for k, r in enumerate(at_once):
            r.update(sent=t_told, asker=f"{EU}@{(us_ip, ap_ip)[k // 8]} (at the hand-back)")
        await restart

        async def peers_hear_eu() -> bool:
            sts = [await admin(mesh, r) for r in (US, AP)]
            return all(st is not None and st["peers"][EU]["available"] for st in sts)

        await wait_for(peers_hear_eu, 30, "us-east-1 and ap-northeast-1 hearing eu-west-1 again")
        t_heard = time.monotonic()

        async def handed_back() -> bool:
            topo = await controller_topology(mesh)
            return (topo is not None and owned(topo, EU) == eu_replicas
                    and await asyncio.to_thread(resolve, mesh, REGION_SOURCES[EU]) == mesh.cfg.region(EU).balancer.advertise.host)

        await wait_for(handed_back, 30, "replicas and DNS back to eu-west-1")
        # a few more rounds of every client after the hand-back, then stop
        counts = [len(a.results) for a in askers]

        async def each_asked_again() -> bool:
            return all(len(a.results) >= c + 5 for a, c in zip(askers, counts, strict=True))

        await wait_for(each_asked_again, 60, "every client asking five more times")
        stop.set()
        await load
    every = [dict(r, asker=f"{a.region}@{a.target or 'dns'}") for a in askers for r in a.results] + at_once
    told = [r for r in every if r["sent"] >= t_told]
    before = [r for r in every if r["sent"] < t_told]
    refused_before = [r for r in before if r["status"] != 200]
    report_figures("hand_back_after_a_killed_balancer_returns", requests=len(every),
                   sent_before_peers_told=len(before), refused_before_peers_told=len(refused_before),
                   sent_after_peers_told=len(told), refused_after_peers_told=sum(r["status"] != 200 for r in told),
                   peers_told_after_restart_s=t_told - t_restart, peers_heard_eu_within_s_of_told=t_heard - t_told,
                   at_the_hand_back=sorted(str(r["status"]) for r in at_once),
                   statuses=sorted({str(r["status"]) for r in every}))
    # once its peers know eu-west-1 is back, everything is answered
    assert all(r["status"] == 200 for r in told), [r for r in told if r["status"] != 200]
    # before: 200, or 503 no_capacity with Retry-After (no balancer owning an EU replica was up)
    for r in refused_before:
        assert r["status"] == 503 and r["code"] == "no_capacity" and r["retry_after"], r
    # residency held throughout: EU requests ran on EU replicas only
    eu_served = [r for r in every if r["asker"].startswith(EU) and r["status"] == 200]
    assert eu_served and {r["replica"] for r in eu_served} <= eu_replicas
