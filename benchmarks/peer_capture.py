"""What a listener on the path between two balancers reads of a forwarded request.

Two balancers in this process (us-east-1, whose only replica is down, and eu-west-1, with
a stand-in replica), the mesh's certificates from skymesh.security.pki, and a recording TCP relay
on loopback in front of the address us-east-1 forwards to: eu-west-1's peer listener
where the tree has one (mTLS), else its client port (the forward in plain HTTP, as on
1da6a04). Sends ``--forwards`` requests with a recognisable prompt to us-east-1 and
counts, in the captured bytes, the peer token, the prompt and the forward's HTTP
request line / hop header. Prints one JSON line.

    PYTHONPATH=. .venv/bin/python -m benchmarks.peer_capture [--forwards 10]

Self-contained (no test helpers), so the same file runs on an export of an older tree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiohttp import ClientSession, web  # noqa: E402

from skymesh.balancer.request_flow import HOP_HEADER  # noqa: E402
from skymesh.balancer.server import Balancer  # noqa: E402
from skymesh.balancer.services import attach_services  # noqa: E402
from skymesh.config import BalancerConfig, parse_config  # noqa: E402
from skymesh.runtime.procs import free_port  # noqa: E402
from skymesh.security.pki import generate_mesh_pki  # noqa: E402

PROMPT = "the quarterly figures of ACME-7f3a9c, strictly confidential " * 4
IDLE_METRICS = "vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n"


class RecordingRelay:
    """A TCP relay on loopback that keeps every byte it carries (both directions): what
    anyone on the path between two balancers could read."""

    def __init__(self, port: int, target: tuple[str, int]) -> None:
        self.port = port
        self.target = target
        self.captured = bytearray()
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                self.captured += data
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers.append(up_writer)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            w.close()
        if self._server is not None:
            await self._server.wait_closed()


async def _stand_in() -> tuple[web.AppRunner, str]:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=IDLE_METRICS)

    async def completions(request: web.Request) -> web.Response:
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": "skymesh-sim",
                                  "choices": [{"index": 0, "text": "eu0", "finish_reason": "length"}]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def capture(forwards: int) -> dict[str, Any]:
    has_peer_listener = "peer_listen" in BalancerConfig.model_fields
    replica, replica_url = await _stand_in()
    relay_port = free_port()

    def balancer() -> dict[str, str]:
        b = {"listen": f"127.0.0.1:{free_port()}", "grpc_listen": f"127.0.0.1:{free_port()}"}
        if has_peer_listener:
            b["peer_listen"] = f"127.0.0.1:{free_port()}"
        return b

    us, eu = balancer(), balancer()
    # the relay sits where us-east-1 sends its forwards
    target = eu["peer_listen" if has_peer_listener else "listen"]
    eu["peer_advertise" if has_peer_listener else "advertise"] = f"127.0.0.1:{relay_port}"
    with tempfile.TemporaryDirectory() as tmp:
        data = {
            "model": "skymesh-sim",
            "regions": [
                {"name": "us-east-1", "source_networks": ["127.1.0.0/16"], "balancer": us,
                 "replicas": [{"id": "use1-r0", "url": f"http://127.0.0.1:{free_port()}"}]},
                {"name": "eu-west-1", "source_networks": ["127.2.0.0/16"], "balancer": eu,
                 "replicas": [{"id": "euw1-r0", "url": replica_url}]},
            ],
            "latencies": [{"regions": ["us-east-1", "eu-west-1"], "one_way_ms": 40}],
            "controller": {"listen": f"127.0.0.1:{free_port()}", "http_listen": f"127.0.0.1:{free_port()}"},
            "dns": {"name": "llm.skymesh.local", "listen": f"127.0.0.1:{free_port(span=2)}"},
            "policy": {"name": "round_robin", "ttft_slo_s": 2.0, "probe_interval_s": 0.05},
            "offload": {"enabled": True, "trigger": "saturated", "heartbeat_interval_s": 0.05},
            "health": {"unhealthy_threshold": 1},
            "emulate_latency": False,
            "tls": generate_mesh_pki(Path(tmp) / "pki", ["us-east-1", "eu-west-1"]),
        }
        cfg = parse_config(data)
        host, port = target.rsplit(":", 1)
        relay = RecordingRelay(relay_port, (host, int(port)))
        await relay.start()
        balancers: list[Balancer] = []
        statuses: list[int] = []
        try:
            for name in ("eu-west-1", "us-east-1"):
                b = Balancer(cfg, name)
                attach_services(b, peers=True, controller=False)
                await b.start()  # the config's ports: the relay forwards to one of them
                balancers.append(b)
            b_eu, b_us = balancers
            loop = asyncio.get_running_loop()
            for _ in range(400):
                if "eu-west-1" in b_us.core.offload.candidates(loop.time()):
                    break
                await asyncio.sleep(0.025)
            body = {"model": "skymesh-sim", "prompt": PROMPT, "max_tokens": 4}
            async with ClientSession() as s:
                for _ in range(forwards):
                    async with s.post(f"http://127.0.0.1:{b_us.bound_port}/v1/completions", json=body) as r:
                        await r.read()
                        statuses.append(r.status)
            token = b_us.peer_token
        finally:
            for b in reversed(balancers):
                await b.stop()
            await relay.stop()
            await replica.cleanup()
    captured = bytes(relay.captured)
    return {
        "transport": "peer listener (mTLS)" if has_peer_listener else "client port (plain HTTP)",
        "forwards_served": sum(st == 200 for st in statuses),
        "offloaded_in": b_eu.offloaded_in,
        "bytes_captured": len(captured),
        "token_matches": captured.count(token.encode()),
        "prompt_matches": captured.count(PROMPT.encode()),
        "header_matches": captured.count(HOP_HEADER.encode()) + captured.count(b"POST /v1/completions"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forwards", type=int, default=10)
    args = p.parse_args()
    # a fresh peer token for this run (nothing written to a state dir)
    os.environ.setdefault("SKYMESH_PEER_TOKEN", secrets.token_urlsafe(24))
    print(json.dumps(asyncio.run(capture(args.forwards))))


if __name__ == "__main__":
    main()
