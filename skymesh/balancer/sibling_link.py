"""The sibling channel: the balancers of one region stream their state to each other
(docs/routing.md, "A region is a fleet"): a
:class:`~skymesh.routing.siblings.SiblingMessage` built from the region core goes on every
sibling stream; what arrives goes to the region core, which moves the push-budget units,
writes the sibling's placements into its routing history and counts its queue in the
region's heartbeat.

One stream per pair: a balancer dials each sibling whose id sorts after its own
(``MeshPeer.Siblings`` on the sibling's own gRPC address) and answers the ones that dial
it; both sides send on that stream.

When a message goes: the balancer looks at its state after a dispatch round (every
arrival, probe, completion and applied sibling message ends in one), at most once per
``siblings.interval_s``, and sends at once when the push-budget protocol moved (units,
lends, the replicas wanted, a claim of its own or of a sibling waiting for its word);
otherwise every ``siblings.keepalive_s``, carrying the placements, key usage and loads
gathered since, so a sibling's silence past ``siblings.miss_limit`` keepalives still means
it is gone. Nothing wakes the event loop just to look: on this machine a wake-up
costs about as much CPU as building and sending a message (docs/benchmarks.md, "A region
is a fleet (live)"), so an idle balancer wakes only for its keepalives. The region core
drops anything not newer than what it heard (epoch, seq).

A stream is accepted only from the mesh identity of this same region (mTLS); without TLS
the gRPC listener is loopback-only (skymesh/security/pki.py). Sibling messages are bounded
before they reach the core: a sibling is trusted with the region's budget, not with memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from skymesh.balancer.grpc_streams import answer_stream
from skymesh.balancer.ports import SiblingLinkBalancer
from skymesh.balancer.prober import ProbeResult, SharedPage
from skymesh.proto_gen import mesh_pb2, mesh_pb2_grpc
from skymesh.routing.push_shares import ShareState, Unit
from skymesh.routing.siblings import (
    MAX_PLACEMENTS_PER_MESSAGE,
    Placement,
    SiblingLoad,
    SiblingMessage,
)
from skymesh.runtime.procs import cancel_tasks
from skymesh.security.pki import (
    balancer_server_name,
    peer_identity,
    region_of_identity,
    secure_channel,
)

log = logging.getLogger("skymesh.balancer.siblings")

# bounds on one incoming message (a sibling is trusted with budgets, not with memory)
MAX_REPLICAS = 4096
MAX_UNITS = 4 * MAX_REPLICAS
MAX_CHUNKS_PER_PLACEMENT = 1 << 14
MAX_SIBLINGS = 256
MAX_KEYS = 4096
MAX_PAGE_ERROR = 200  # characters of a shared page's error kept
# a message's age by the wall clocks is taken as at most this (a clock far off, a field
# unset: its leases have long ended either way)
MAX_AGE_S = 60.0
# per stream: messages built but not yet sent (a slow stream drops its oldest)
STREAM_BACKLOG = 32
# a refused message or stream is logged at most once per cause this often (with the count
# since); every one is counted (skymesh_sibling_messages_dropped_total{reason})
DROP_LOG_INTERVAL_S = 60.0


class MessageTooLarge(ValueError):
    """A sibling message past the bounds above: dropped, counted."""


def page_to_proto(page: SharedPage, built_at: float) -> Any:
    rid, res = page
    sent_at = built_at if res.sent_at is None else res.sent_at
    return mesh_pb2.ReplicaPage(
        replica_id=rid, healthy=res.healthy, num_running=res.num_running, num_waiting=res.num_waiting,
        kv_usage=res.kv_usage, prefix_queries=res.prefix_queries, prefix_hits=res.prefix_hits,
        timed_out=res.timed_out, error=res.error[:MAX_PAGE_ERROR], age_s=max(0.0, built_at - sent_at))


def page_from_proto(pb: Any, received_at: float) -> SharedPage | None:
    """A shared page as this balancer's probe result, dated by its arrival less its age
    by the prober's own clock (never later than it was scraped: the transit only makes it
    look older, and no wall clock is read); None when a value makes no sense (dropped)."""
    floats = (pb.kv_usage, pb.prefix_queries, pb.prefix_hits, pb.age_s)
    if not pb.replica_id or not all(math.isfinite(v) and v >= 0 for v in floats):
        return None
    res = ProbeResult(healthy=pb.healthy, num_running=pb.num_running, num_waiting=pb.num_waiting,
                      kv_usage=pb.kv_usage, prefix_queries=pb.prefix_queries, prefix_hits=pb.prefix_hits,
                      error=pb.error[:MAX_PAGE_ERROR], timed_out=pb.timed_out,
                      sent_at=received_at - min(MAX_AGE_S, pb.age_s))
    return pb.replica_id, res


def to_proto(msg: SiblingMessage, pages: list[SharedPage] | None = None) -> Any:
    """``pages``: replica pages this balancer scraped since its last message, dated
    against the message's build time (``msg.sent_at``, the same loop clock)."""
    sh = msg.shares
    return mesh_pb2.SiblingState(
        pages=[page_to_proto(p, msg.sent_at) for p in pages or ()],
        region=msg.region, balancer_id=sh.balancer_id, epoch=sh.epoch, seq=sh.seq,
        sent_unix_ms=int(time.time() * 1000), queue_length=sh.queue_length,
        pending_prefill_tokens=msg.pending_prefill_tokens, placements_per_s=msg.placements_per_s,
        seen=[mesh_pb2.SiblingSeen(balancer_id=b, epoch=e, seq=s) for b, (e, s) in sh.seen.items()],
        held=[mesh_pb2.PushUnit(replica_id=u.replica_id, unit=u.index) for u in sorted(sh.held)],
        claims=[mesh_pb2.PushUnit(replica_id=u.replica_id, unit=u.index) for u in sorted(sh.claims)],
        lends=[mesh_pb2.UnitLend(replica_id=u.replica_id, unit=u.index, borrower=b, lease_ms=int(ttl * 1000))
               for u, (b, ttl) in sh.grants.items()],
        loads=[mesh_pb2.ReplicaLoad(replica_id=r, in_flight=ld.in_flight, unseen=ld.unseen,
                                    wanted=sh.wants.get(r, 0), pending_prefill_tokens=ld.pending_prefill_tokens)
               for r, ld in msg.loads.items()],
        placements=[mesh_pb2.PlacementRecord(replica_id=p.replica_id, chunk_hashes=p.chunk_hashes,
                                             age_s=max(0.0, msg.sent_at - p.at)) for p in msg.placements],
        key_usage=[mesh_pb2.KeyUsage(key_name=k, requests=r, prompt_tokens=t) for k, (r, t) in msg.key_usage.items()],
        draining=sh.draining,
    )


def from_proto(pb: Any, now: float) -> SiblingMessage:
    """A received SiblingState as the routing core's message; its send time and placement
    times are rebased on the receiver's clock (``now`` less their age by the wall clocks,
    never less than 0: a lease is counted from when the message was built, so a clock
    behind the sender's lengthens it by the skew, which the home's margin covers).
    Raises MessageTooLarge."""
    if (len(pb.loads) > MAX_REPLICAS or len(pb.pages) > MAX_REPLICAS or len(pb.held) + len(pb.claims) + len(pb.lends) > 3 * MAX_UNITS
            or len(pb.seen) > MAX_SIBLINGS or len(pb.placements) > MAX_PLACEMENTS_PER_MESSAGE
            or len(pb.key_usage) > MAX_KEYS
            or any(len(p.chunk_hashes) > MAX_CHUNKS_PER_PLACEMENT for p in pb.placements)):
        raise MessageTooLarge(f"sibling message from {pb.balancer_id[:64]!r} past its bounds")
    age_s = min(MAX_AGE_S, max(0.0, time.time() - pb.sent_unix_ms / 1000)) if pb.sent_unix_ms else 0.0
    sent_at = now - age_s
    shares = ShareState(
        balancer_id=pb.balancer_id, epoch=pb.epoch, seq=pb.seq, queue_length=pb.queue_length,
        wants={ld.replica_id: ld.wanted for ld in pb.loads if ld.wanted > 0},
        held=frozenset(Unit(u.replica_id, u.unit) for u in pb.held),
        claims=frozenset(Unit(u.replica_id, u.unit) for u in pb.claims),
        grants={Unit(ln.replica_id, ln.unit): (ln.borrower, ln.lease_ms / 1000) for ln in pb.lends},
        seen={s.balancer_id: (s.epoch, s.seq) for s in pb.seen},
        draining=pb.draining, sent_at=sent_at,
    )
    return SiblingMessage(
        region=pb.region, shares=shares, sent_at=sent_at, pending_prefill_tokens=pb.pending_prefill_tokens,
        placements_per_s=pb.placements_per_s,
        loads={ld.replica_id: SiblingLoad(ld.in_flight, ld.unseen, ld.pending_prefill_tokens) for ld in pb.loads},
        placements=tuple(Placement(p.replica_id, tuple(p.chunk_hashes), sent_at - max(0.0, p.age_s))
                         for p in pb.placements),
        key_usage={k.key_name: (k.requests, k.prompt_tokens) for k in pb.key_usage},
    )


def _page_shows(res: ProbeResult) -> tuple[bool, bool, int, int]:
    """What of a page its siblings act on at once: health, silence, running, waiting
    (a change sends a message after the page wait; the rest rides the next message)."""
    return res.healthy, res.timed_out, res.num_running, res.num_waiting


@dataclasses.dataclass(frozen=True, slots=True)
class _Sent:
    """What the siblings were last told of the push-budget protocol."""

    held: frozenset[Unit]
    claims: frozenset[Unit]
    grants: frozenset[tuple[Unit, str]]
    wants: frozenset[str]
    draining: bool


def _protocol_state(msg: SiblingMessage) -> _Sent:
    sh = msg.shares
    return _Sent(sh.held, sh.claims, frozenset((u, b) for u, (b, _) in sh.grants.items()), frozenset(sh.wants),
                 sh.draining)


def _why_now(now_state: _Sent, sent: _Sent | None, unanswered_claim: bool) -> str | None:
    """Why a sibling may be waiting for what changed since the last message (None: nothing
    it waits for): a new claim of ours (one already sent waits for the answers, and rides
    every later message), a sibling's claim heard since our last message (our next one
    answers it: it shows what we hold and claim, having seen the claim), a unit given up
    (a lease released: its home may use it again), a grant made or recalled, a replica
    newly wanted (its home may lend), draining. A unit taken, a want gone, a grant renewed
    (leases outlast several keepalives), placements, key usage, loads and queue length
    wait for the next keepalive: no sibling waits for them. Safety never
    depends on when a message goes (tests/test_push_shares.py delays and drops them at
    will), only how soon a unit moves."""
    if sent is None:
        return "first"
    for why, changed in (("claim", bool(now_state.claims - sent.claims)), ("answer", unanswered_claim),
                         ("gave_up", bool(sent.held - now_state.held)), ("grants", now_state.grants != sent.grants),
                         ("wants", bool(now_state.wants - sent.wants)), ("draining", now_state.draining != sent.draining)):
        if changed:
            return why
    return None


class SiblingLink:
    """Streams this balancer's state to its siblings and applies theirs."""

    def __init__(self, balancer: SiblingLinkBalancer,
                 supervise: Callable[[str, Callable[[], Any]], asyncio.Task[None]]) -> None:
        self.balancer = balancer
        self._supervise = supervise
        self.creds = balancer.mesh_credentials()
        self.interval = balancer.sibling_interval_s()
        self._streams: set[asyncio.Queue[Any]] = set()
        self._tasks: list[asyncio.Task[Any]] = []
        self._dialing: dict[str, asyncio.Task[Any]] = {}
        self.messages_in = 0
        self.messages_out = 0
        self.refused_streams = 0
        self.dropped: dict[str, int] = {}  # incoming messages dropped, by reason
        # reason -> (when it was last logged, drops since then): one log line per cause a minute
        self._drop_logged: dict[str, tuple[float, int]] = {}
        self.skipped_quiet = 0  # looks that sent nothing: nothing new since the last message
        self.looks = 0  # times the state was looked at (a message built)
        self.sent_because: dict[str, int] = {}  # messages sent, by the first reason (_why_now)
        self._last_sent: _Sent | None = None
        self._keepalive_s = balancer.sibling_keepalive_s()
        self._last_sent_at = float("-inf")
        self._last_look_at = float("-inf")
        self._look_scheduled: asyncio.TimerHandle | asyncio.Handle | None = None
        # siblings that claimed units in a message heard since our last one (they wait
        # for our word: the next message answers them)
        self._unanswered: set[str] = set()
        # gathered for messages that were skipped: sent with the next one
        self._carried_placements: list[Placement] = []
        self._carried_usage: dict[str, tuple[float, float]] = {}
        # replica pages scraped here not sent yet (the newest of each replica); what the
        # last one sent of each replica showed; when the oldest page that shows a change
        # was taken (None: none waits)
        self._pages: dict[str, ProbeResult] = {}
        self._page_shown: dict[str, tuple[bool, bool, int, int]] = {}
        self._change_since: float | None = None
        self._page_wait_s = balancer.sibling_page_wait_s()

    def _with_carried(self, msg: SiblingMessage) -> SiblingMessage:
        if not self._carried_placements and not self._carried_usage:
            return msg
        usage = dict(self._carried_usage)
        for key, (r, t) in msg.key_usage.items():
            r0, t0 = usage.get(key, (0.0, 0.0))
            usage[key] = (r0 + r, t0 + t)
        placements = (*self._carried_placements, *msg.placements)[-MAX_PLACEMENTS_PER_MESSAGE:]
        return dataclasses.replace(msg, placements=placements, key_usage=usage)

    def counts(self) -> dict[str, int]:
        """What the channel did since start: messages sent (one per fan-out, whatever the
        streams), applied, looks at the state, looks that sent nothing, incoming messages
        dropped by reason, streams refused."""
        out = {"sent": self.messages_out, "applied": self.messages_in, "looks": self.looks,
               "quiet_looks": self.skipped_quiet, "refused_streams": self.refused_streams}
        out.update({f"dropped_{reason}": n for reason, n in self.dropped.items()})
        out.update({f"sent_{why}": n for why, n in self.sent_because.items()})
        return out

    # ------------------------------------------------------------------ sending

    def poke(self) -> None:
        """Something happened here (a dispatch round ran): look at the state now, or when
        an interval has passed since the last look (one look however many pokes)."""
        if self._look_scheduled is not None or not self.balancer.has_siblings():
            return
        loop = asyncio.get_running_loop()
        wait = self._last_look_at + self.interval - loop.time()
        # now: at the end of this loop iteration (no wake-up of its own)
        self._look_scheduled = loop.call_soon(self._look) if wait <= 0 else loop.call_later(wait, self._look)

    def _look(self) -> None:
        self._look_scheduled = None
        if self.balancer.has_siblings():
            self._fan_out(asyncio.get_running_loop().time())

    def _fan_out(self, now: float) -> None:
        self._last_look_at = now
        self.looks += 1
        msg = self._with_carried(self.balancer.sibling_message())
        state = _protocol_state(msg)
        why = _why_now(state, self._last_sent, bool(self._unanswered))
        # replica pages this member scraped (the siblings that do not probe those replicas
        # route by them: skymesh/routing/probe_owners.py) ride the next message. One that
        # shows a change (health, running, waiting) sends one after the page wait, so a
        # probe round's pages share a message with the protocol's moves; pages that show
        # none ride the keepalive (an idle fleet sends no more messages for its probes)
        self._take_pages(now)
        if why is None and self._change_since is not None:
            if now - self._change_since >= self._page_wait_s:
                why = "pages"
            elif self._look_scheduled is None:
                self._look_scheduled = asyncio.get_running_loop().call_later(
                    self._change_since + self._page_wait_s - now, self._look)
        if why is None and now - self._last_sent_at < self._keepalive_s:
            # what it gathered (placements, key usage) goes with the next one sent
            self._carried_placements = list(msg.placements[-MAX_PLACEMENTS_PER_MESSAGE:])
            self._carried_usage = dict(msg.key_usage)
            self.skipped_quiet += 1
            return
        self._carried_placements, self._carried_usage = [], {}
        self._last_sent, self._last_sent_at = state, now
        self._unanswered.clear()  # this message has seen every claim heard so far
        why = why or "keepalive"
        self.sent_because[why] = self.sent_because.get(why, 0) + 1
        pages = list(self._pages.items())
        for rid, res in pages:
            self._page_shown[rid] = _page_shows(res)
        self._pages, self._change_since = {}, None
        pb = to_proto(msg, pages)
        self.messages_out += 1
        for q in self._streams:
            if q.full():
                q.get_nowait()  # a slow stream loses its oldest (the next one repeats the state)
            q.put_nowait(pb)

    def _take_pages(self, now: float) -> None:
        for rid, res in self.balancer.take_shared_pages():
            self._pages.pop(rid, None)  # the newest last: the dict keeps the scrape order
            if len(self._pages) >= MAX_REPLICAS:
                self._pages.pop(next(iter(self._pages)))
            self._pages[rid] = res
            if self._change_since is None and self._page_shown.get(rid) != _page_shows(res):
                self._change_since = now
        if len(self._page_shown) > 2 * MAX_REPLICAS:
            self._page_shown.clear()  # replicas that left, many times over: start afresh

    async def _keepalive(self) -> None:
        """The keepalive (when nothing else sent a message for ``keepalive_s``)
        and the dial loops; sleeps until the next keepalive is due."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            if self.balancer.has_siblings() and now - self._last_sent_at >= self._keepalive_s:
                self._fan_out(now)
            self._sync_dialers()
            due = self._last_sent_at + self._keepalive_s if self.balancer.has_siblings() else now + self._keepalive_s
            await asyncio.sleep(max(self.interval, due - loop.time()))

    async def _outgoing(self) -> AsyncIterator[Any]:
        q: asyncio.Queue[Any] = asyncio.Queue(STREAM_BACKLOG)
        self._streams.add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._streams.discard(q)

    # ------------------------------------------------------------------ receiving

    def _drop(self, reason: str, pb: Any) -> None:
        """Count a dropped message; log its cause at most once per DROP_LOG_INTERVAL_S."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        now = time.monotonic()
        last, since = self._drop_logged.get(reason, (float("-inf"), 0))
        if now - last < DROP_LOG_INTERVAL_S:
            self._drop_logged[reason] = (last, since + 1)
            return
        self._drop_logged[reason] = (now, 0)
        log.warning("dropped a sibling message", extra={
            "region": self.balancer.region, "reason": reason, "claimed_id": str(pb.balancer_id)[:64],
            "claimed_epoch": int(pb.epoch), "dropped_since_last_log": since, "dropped_total": self.dropped[reason]})

    def receive(self, pb: Any, stream_region: str | None) -> None:
        b = self.balancer
        if self.creds is not None and stream_region != b.region:
            self._drop("wrong_region", pb)
            return
        if pb.region != b.region or pb.balancer_id == b.balancer_id:
            self._drop("not_a_sibling", pb)
            return
        # who may speak as a sibling: the controller's topology (or the config) names the
        # id and the epoch it registered with (skymesh/balancer/fleet.py)
        refused = b.sibling_refusal(pb.balancer_id, pb.epoch)
        if refused is not None:
            self._drop(refused, pb)
            return
        if len(pb.claims) > 0 and (pb.balancer_id in self._unanswered or len(self._unanswered) < MAX_SIBLINGS):
            self._unanswered.add(pb.balancer_id)
        now = asyncio.get_running_loop().time()
        try:
            msg = from_proto(pb, now)
        except MessageTooLarge:
            self._drop("too_large", pb)
            return
        if b.apply_sibling_message(msg):
            self.messages_in += 1
            pages = [page for page in (page_from_proto(p, now) for p in pb.pages) if page is not None]
            if len(pages) < len(pb.pages):
                self._drop("bad_page", pb)
            if pages:
                b.apply_shared_pages(pages)

    async def serve(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """The server side of ``MeshPeer.Siblings`` (PeerMesh delegates here)."""
        stream_region = region_of_identity(peer_identity(context))
        if self.creds is not None and stream_region != self.balancer.region:
            self.refused_streams += 1
            log.warning("refused a sibling stream from another identity",
                        extra={"region": self.balancer.region, "identity_region": stream_region or "none",
                               "refused_total": self.refused_streams})
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "only this region's balancers are siblings")

        async for pb in answer_stream(request_iterator, lambda m: self.receive(m, stream_region), self._outgoing()):
            yield pb

    async def _dial(self, sibling_id: str) -> None:
        backoff = self.interval
        region = self.balancer.region
        while True:
            address = self.balancer.sibling_addresses().get(sibling_id)
            if address is None:
                return
            try:
                channel = (grpc.aio.insecure_channel(address) if self.creds is None
                           else secure_channel(address, self.creds, balancer_server_name(region)))
                async with channel:
                    call = mesh_pb2_grpc.MeshPeerStub(channel).Siblings(self._outgoing())
                    async for pb in call:
                        backoff = self.interval
                        self.receive(pb, region)
            except (grpc.aio.AioRpcError, grpc.RpcError, OSError) as e:
                log.debug("sibling stream to %s ended: %s", sibling_id, type(e).__name__)
            await asyncio.sleep(backoff)
            backoff = min(1.0, backoff * 2)

    def _sync_dialers(self) -> None:
        """One dial loop per sibling the balancer knows now (config or controller) whose
        id sorts after this one's: the other side of each pair dials."""
        me = self.balancer.balancer_id
        wanted = {sid for sid in self.balancer.sibling_addresses() if sid > me}
        for sid in [s for s in self._dialing if s not in wanted]:
            self._dialing.pop(sid).cancel()
        for sid in wanted - set(self._dialing):
            self._dialing[sid] = self._supervise(f"sibling-{sid}", functools.partial(self._dial, sid))

    async def start(self) -> None:
        self.balancer.on_dispatch_round(self.poke)
        self._tasks.append(self._supervise("sibling-keepalive", self._keepalive))

    async def stop(self) -> None:
        if self._look_scheduled is not None:
            self._look_scheduled.cancel()
            self._look_scheduled = None
        await cancel_tasks([*self._tasks, *self._dialing.values()])
        self._dialing.clear()
