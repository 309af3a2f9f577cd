"""What an event-loop wake-up and a sibling message cost in CPU on this machine.

Why the sibling channel looks at its state only after dispatch rounds and sends only what
a sibling waits for (skymesh/balancer/sibling_link.py): on a VM a wake-up of an idle
asyncio loop (a timer firing out of ``epoll_wait``) costs far more CPU than the Python it
runs. Two measurements, each the process's user+system CPU over a bounded loop:

* an asyncio loop doing nothing but ``asyncio.sleep(interval)``, CPU per wake-up;
* one ``MeshPeer.Siblings`` bidi stream over loopback gRPC (grpc.aio, no TLS), an
  echo server and a client in this process, one 6-unit ``SiblingState`` every
  ``--pace-ms``: CPU per round trip (two sends and two receives), less the wake-ups of
  the pacing sleep itself.

    PYTHONPATH=. .venv/bin/python -m benchmarks.wake_cost --messages 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
from collections.abc import AsyncIterator
from typing import Any

import grpc

from skymesh.proto_gen import mesh_pb2, mesh_pb2_grpc


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def sleep_loop(interval_s: float, wakes: int) -> float:
    """CPU seconds per wake-up of a loop that only sleeps ``interval_s``."""
    c0 = cpu_s()
    for _ in range(wakes):
        await asyncio.sleep(interval_s)
    return (cpu_s() - c0) / wakes


class _Echo(mesh_pb2_grpc.MeshPeerServicer):
    async def Siblings(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802 (gRPC's name)
        async for m in request_iterator:
            yield m


async def grpc_round_trips(messages: int, pace_s: float) -> float:
    """CPU seconds per round trip on one bidi stream, paced like the channel."""
    server = grpc.aio.server()
    mesh_pb2_grpc.add_MeshPeerServicer_to_server(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    msg = mesh_pb2.SiblingState(region="us-east-1", balancer_id="us-east-1-b0", epoch=1, seq=1,
                                held=[mesh_pb2.PushUnit(replica_id=f"r{i}", unit=j) for i in range(3) for j in range(2)])
    outgoing: asyncio.Queue[Any] = asyncio.Queue()

    async def send() -> AsyncIterator[Any]:
        while (m := await outgoing.get()) is not None:
            yield m

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = mesh_pb2_grpc.MeshPeerStub(channel).Siblings(send())
            received = 0

            async def read() -> None:
                nonlocal received
                async for _ in call:
                    received += 1
                    if received == messages:
                        return

            reader = asyncio.create_task(read())
            c0 = cpu_s()
            for _ in range(messages):
                outgoing.put_nowait(msg)
                await asyncio.sleep(pace_s)
            await asyncio.wait_for(reader, timeout=60)
            spent = cpu_s() - c0
            outgoing.put_nowait(None)
    finally:
        await server.stop(None)
    return spent / messages


async def main(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for interval in (0.002, 0.02):
        wakes = max(50, int(args.seconds / interval))
        out[f"cpu_us_per_wake_sleep_{int(interval * 1000)}ms"] = round(await sleep_loop(interval, wakes) * 1e6, 1)
    pace = args.pace_ms / 1000
    per_trip = await grpc_round_trips(args.messages, pace)
    pacing = await sleep_loop(pace, args.messages)
    out.update(grpc_cpu_us_per_round_trip=round(per_trip * 1e6, 1),
               grpc_cpu_us_per_round_trip_less_pacing=round((per_trip - pacing) * 1e6, 1),
               pace_ms=args.pace_ms, messages=args.messages)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=1000)
    p.add_argument("--pace-ms", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=2.0, help="per sleep-loop measurement")
    print(json.dumps(asyncio.run(main(p.parse_args())), indent=2))
