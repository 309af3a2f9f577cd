"""The stand-in's KV event publisher: vLLM 0.32's ZMQ PUB + ROUTER replay protocol.

Framing (``vllm/distributed/kv_events.py`` ``ZmqEventPublisher``):

* PUB, one multipart message per batch: ``[topic, seq, payload]`` — the topic as UTF-8
  bytes (``""`` by default: subscribe to the prefix ``b""``), ``seq`` the batch's
  sequence number as 8 bytes big-endian (0, 1, 2, ... per process), ``payload`` the
  msgpack batch (:class:`skymesh.replica_sim.kv_events.KVEventBatch`).
* Replay (ROUTER, when ``replay_endpoint`` is set): a request is ``[identity, b"",
  start_seq]`` with ``start_seq`` 8 bytes big-endian (a DEALER sends ``[b"", start]``; a
  REQ adds the empty frame itself but accepts only the first reply). Every batch still
  in the buffer (the last ``buffer_steps``) with ``seq >= start_seq`` is answered as
  ``[identity, b"", topic, seq, payload]``, then ``[identity, b"", b"", END_SEQ, b""]``
  with ``END_SEQ`` = -1 as 8 bytes big-endian signed (``ff`` * 8). A request of any
  other shape is ignored. A replay answers every batch published (``publish`` returned)
  before the request arrived, even one the thread had not sent yet when it woke.

As in vLLM, a thread owns the sockets and does the encoding and sending; the engine loop
only enqueues. Unlike vLLM, whose ``publish`` blocks when its queue is full, the
stand-in's never blocks: a batch that finds the queue full (``max_queue_size``) is
dropped and its sequence number skipped, so a subscriber sees the gap. Sequence numbers
are given at ``publish`` (vLLM gives them in the thread; the same numbers either way).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections import deque
from typing import Protocol

import msgspec
import zmq

from skymesh.replica_sim.kv_events import KVEventBatch, KVEventsConfig, StandInEvent, binds

log = logging.getLogger("skymesh.replica_sim.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventPublisher(Protocol):
    endpoint: str | None  # the PUB endpoint (as bound when it binds)
    replay_endpoint: str | None  # the replay endpoint as bound, None without replay
    pub_bound: bool

    def publish(self, events: list[StandInEvent]) -> None: ...

    def close(self) -> None: ...


class NullPublisher:
    """Events disabled (vLLM's ``NullEventPublisher``)."""

    endpoint: str | None = None
    replay_endpoint: str | None = None
    pub_bound = False

    def publish(self, events: list[StandInEvent]) -> None:
        return

    def close(self) -> None:
        return


def _bind(sock: zmq.Socket[bytes], endpoint: str, host: str) -> str:
    """Bind and return the endpoint bound. The wildcard of ``tcp://*:PORT`` is the
    stand-in's ``--host``, where its HTTP server listens too (vLLM: every interface, i.e.
    ``--host 0.0.0.0``); ``tcp://*:0`` takes a free port there (vLLM: on the node's IP)."""
    if endpoint.startswith("tcp://*:"):
        port = endpoint[len("tcp://*:"):]
        where = f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        if port == "0":
            return f"{where}:{sock.bind_to_random_port(where)}"
        endpoint = f"{where}:{port}"
    sock.bind(endpoint)
    return endpoint


def tcp_port(endpoint: str | None) -> int | None:
    """The port of a ``tcp://host:port`` endpoint (None for other transports)."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return None
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() else None


class ZmqPublisher:
    """vLLM 0.32's ZMQ publisher: sockets are set up here (a bad endpoint fails now, in
    the caller), then owned by one daemon thread until :meth:`close`."""

    def __init__(self, cfg: KVEventsConfig, host: str = "127.0.0.1") -> None:
        self._topic = cfg.topic.encode("utf-8")
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self.pub_bound = False
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(maxsize=max(1, cfg.max_queue_size))
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(0, cfg.buffer_steps))
        self._next_seq = 0
        self.dropped = 0
        self._closed = False
        self._ctx = zmq.Context()
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        # the engine loop wakes the thread through this pair (zmq sockets are not
        # thread-safe, so the thread polls a plain socket beside its own)
        self._wake_r, self._wake_w = socket.socketpair()
        try:
            self._pub.set_hwm(cfg.hwm)
            # whether the PUB socket listens (else it connects to a subscriber that does)
            self.pub_bound = binds(cfg.endpoint)
            if self.pub_bound:
                self.endpoint = _bind(self._pub, cfg.endpoint, host)
            else:
                self._pub.connect(cfg.endpoint)
                self.endpoint = cfg.endpoint
            self.replay_endpoint = None
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = _bind(self._replay, cfg.replay_endpoint, host)
        except BaseException:
            self._close_sockets()
            raise
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine side

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get (= batches published so far)."""
        return self._next_seq

    def publish(self, events: list[StandInEvent]) -> None:
        """Queue one batch (one engine step's events); never blocks."""
        if not events or self._closed:
            return
        seq = self._next_seq
        self._next_seq += 1
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1
            log.warning("kv events queue full: batch %d dropped", seq)
            return
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        if self._closed:
            return
        self._closed = True
        # the sentinel goes behind every queued batch; a full queue makes room by
        # blocking at most until the thread takes one
        while True:
            try:
                self._queue.put(None, timeout=0.1)
                break
            except queue.Full:
                if not self._thread.is_alive():
                    break
        self._wake()
        self._thread.join()
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------------ thread

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError, OSError):
                        while self._wake_r.recv(4096):
                            pass
                # queued batches first: a replay request that arrived with them (the
                # thread woke late) must answer every batch published before it was sent
                stop = not self._send_queued(encoder)
                if self._replay is not None and self._replay in ready:
                    self._serve_replays()
                if stop:
                    return
        except Exception:  # never take the process down; the stream just stops
            log.exception("kv events publisher failed")
        finally:
            self._close_sockets()

    def _send_queued(self, encoder: msgspec.msgpack.Encoder) -> bool:
        """Send every queued batch; False once the stop sentinel is reached."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            seq, batch = item
            payload = encoder.encode(batch)
            seq_bytes = seq.to_bytes(8, "big")
            # PUB never blocks: past the high-water mark ZMQ drops, as for vLLM
            self._pub.send_multipart((self._topic, seq_bytes, payload))
            self._buffer.append((seq, payload))

    def _serve_replays(self) -> None:
        replay = self._replay
        assert replay is not None
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                log.warning("invalid kv events replay request (%d frames)", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", b"", END_SEQ, b""))


def make_publisher(cfg: KVEventsConfig | None, host: str = "127.0.0.1") -> ZmqPublisher | NullPublisher:
    if cfg is None or not cfg.publishes:
        return NullPublisher()
    return ZmqPublisher(cfg, host)
