"""A byte-level TCP delay proxy that makes one machine feel like several regions.

It listens on a balancer's advertised address and forwards to its real listen address,
delaying every chunk in each direction by the one-way latency of the link the connection
comes from: the client's source IP is matched against the regions' ``source_networks``
(a client at 127.2.0.5, or a balancer that bound its egress to 127.2.0.1, is in
eu-west-1), and the delay is ``one_way_ms(source region, this region)``. Unknown sources
get ``local_latency_ms``. Byte-level, so it carries HTTP (incl. SSE streaming) and gRPC.

Chunks are released in order at (arrival + delay): a per-direction queue with release
times, not a sleep per chunk, so delays never add up along a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Callable

from skymesh.config import MeshConfig

log = logging.getLogger("skymesh.latency_proxy")
_CHUNK = 64 * 1024


def delay_for(cfg: MeshConfig, region: str) -> Callable[[str], float]:
    """Source IP -> one-way delay (seconds) into ``region``."""
    nets = sorted(((n, r.name) for r in cfg.regions for n in r.source_networks), key=lambda x: -x[0].prefixlen)

    def delay(ip: str) -> float:
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return cfg.local_latency_ms / 1000
        for net, src in nets:
            if addr.version == net.version and addr in net:
                return cfg.one_way_ms(src, region) / 1000
        return cfg.local_latency_ms / 1000

    return delay


class DelayProxy:
    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay: Callable[[str], float]) -> None:
        self.listen = listen
        self.target = target
        self.delay = delay
        self._server: asyncio.Server | None = None
        self._conns: dict[asyncio.Task[None], list[asyncio.StreamWriter]] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.listen[0], self.listen[1], reuse_address=True)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        # closing the sockets ends every pipe on its own (cancelling stream handler
        # tasks makes asyncio log spurious errors)
        for writers in list(self._conns.values()):
            for w in writers:
                w.close()
        tasks = list(self._conns)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=2.0)
            for t in pending:
                t.cancel()

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        writers = self._conns[task] = [cwriter]
        peer = cwriter.get_extra_info("peername")
        d = self.delay(peer[0] if peer else "")
        try:
            try:
                ureader, uwriter = await asyncio.open_connection(*self.target)
            except OSError:
                return  # upstream down: the client sees the connection close
            writers.append(uwriter)
            try:
                await asyncio.gather(self._pipe(creader, uwriter, d), self._pipe(ureader, cwriter, d))
            finally:
                uwriter.close()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            cwriter.close()
            self._conns.pop(task, None)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def release() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    with contextlib.suppress(OSError, RuntimeError):
                        if writer.can_write_eof():
                            writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()  # backpressure: a slow reader slows the whole pipe

        sender = asyncio.create_task(release())
        try:
            while True:
                data = await reader.read(_CHUNK)
                queue.put_nowait((loop.time() + delay, data))
                if not data:
                    break
            await sender
        except (ConnectionError, OSError):
            sender.cancel()
        finally:
            if not sender.done():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await sender


def proxies_for(cfg: MeshConfig) -> list[DelayProxy]:
    """One HTTP and one gRPC delay proxy per region whose advertised address differs from
    its listen address."""
    out = []
    for r in cfg.regions:
        b = r.balancer
        d = delay_for(cfg, r.name)
        if b.advertise != b.listen:
            out.append(DelayProxy((b.advertise.host, b.advertise.port), (b.listen.host, b.listen.port), d))
        if b.grpc_advertise != b.grpc_listen:
            out.append(DelayProxy((b.grpc_advertise.host, b.grpc_advertise.port),
                                  (b.grpc_listen.host, b.grpc_listen.port), d))
    return out
