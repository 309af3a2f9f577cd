"""The other balancers of this region (active-active siblings), as the region core sees
them, pure: what each said last (:class:`SiblingMessage`), the push-budget units this
balancer holds among them (:mod:`skymesh.routing.push_shares`), and the placements made
here since the last message, which every sibling writes into its routing history so its
trie knows what a sibling placed (docs/routing.md, "A region is a fleet").

The daemon carries these messages over the sibling gRPC stream; the simulator delivers
them after the configured intra-region delay. Both call :meth:`RegionCore.sibling_message`
and :meth:`RegionCore.sibling_state`; nothing here reads a clock or touches I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from skymesh.routing.push_shares import PushShares, ShareState

# a message carries at most this many placements (the rest wait for the next message);
# bounds what one message costs to build, send and apply
MAX_PLACEMENTS_PER_MESSAGE = 2048


class SiblingLoad(NamedTuple):
    """What one balancer has on one replica, as it tells its siblings."""

    in_flight: int  # its requests there, not finished
    unseen: int  # of those, pushed and not shown by its last page of the replica yet
    pending_prefill_tokens: int  # their prefill tokens still to go (the policies' load signal)


@dataclass(frozen=True, slots=True)
class Placement:
    replica_id: str
    chunk_hashes: tuple[int, ...]
    at: float  # the sender's `now` when it placed it


@dataclass(frozen=True, slots=True)
class SiblingMessage:
    """Everything one balancer tells its region's other balancers, every interval."""

    region: str
    shares: ShareState
    sent_at: float  # the sender's `now`
    pending_prefill_tokens: int
    placements_per_s: float
    loads: Mapping[str, SiblingLoad]
    placements: tuple[Placement, ...]
    # client key name -> (requests, prompt tokens) consumed since the previous message
    key_usage: Mapping[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(slots=True)
class _Heard:
    message: SiblingMessage
    at: float


class RegionSiblings:
    """This balancer's view of its siblings and its share of the region's push budget."""

    def __init__(self, region: str, balancer_id: str, dispatch_budget: int, *, epoch: int = 1,
                 dead_after_s: float = 0.3, started_at: float = 0.0, page_lag_s: float = 0.25,
                 lease_s: float = 1.0, skew_margin_s: float = 0.25, stall_fence_s: float | None = None,
                 want_memory_s: float = 0.25) -> None:
        self.region = region
        # a push shows on the replica's page within this long (SiblingsConfig.page_lag_s)
        self.page_lag_s = page_lag_s
        self.shares = PushShares(balancer_id, dispatch_budget, epoch=epoch, dead_after_s=dead_after_s,
                                 started_at=started_at, lease_s=lease_s, skew_margin_s=skew_margin_s,
                                 stall_fence_s=dead_after_s if stall_fence_s is None else stall_fence_s,
                                 want_memory_s=want_memory_s)
        self._heard: dict[str, _Heard] = {}
        self._outbox: list[Placement] = []
        self.placements_applied = 0
        self.messages_in = 0
        # the last step gave this balancer more usable units somewhere (a dispatch round
        # may place more; otherwise a sibling's message needs none)
        self.units_grew = False
        # the live siblings' last messages as of the last step (read between steps)
        self._live: dict[str, SiblingMessage] = {}

    @property
    def balancer_id(self) -> str:
        return self.shares.balancer_id

    def expect(self, sibling_ids: Iterable[str], *, self_listed: bool = True) -> None:
        """The region's other members: the controller topology's live ones, else the
        config's (they are the push budget's homes, heard from or not); ``self_listed``
        False: the topology calls this balancer dead."""
        self.shares.set_members(sibling_ids, self_listed=self_listed)

    def live(self, now: float) -> dict[str, SiblingMessage]:
        """The last message of every sibling heard from within ``dead_after_s``."""
        horizon = self.shares.dead_after_s
        return {sid: h.message for sid, h in self._heard.items() if now - h.at <= horizon}

    def placed(self, replica_id: str, chunk_hashes: tuple[int, ...], now: float) -> None:
        if len(self._outbox) < 4 * MAX_PLACEMENTS_PER_MESSAGE:
            self._outbox.append(Placement(replica_id, chunk_hashes, now))

    def take_placements(self) -> tuple[Placement, ...]:
        out = tuple(self._outbox[:MAX_PLACEMENTS_PER_MESSAGE])
        del self._outbox[:MAX_PLACEMENTS_PER_MESSAGE]
        return out

    def heard(self, msg: SiblingMessage, now: float) -> bool:
        """A sibling's message; False (and nothing applied) for one of another region, this
        balancer's own, or one older than what was already heard."""
        if msg.region != self.region or not self.shares.on_message(msg.shares, now):
            return False
        self._heard[msg.shares.balancer_id] = _Heard(msg, now)
        self.messages_in += 1
        return True

    def step(self, now: float, unseen_pushes: Mapping[str, int], wants: Mapping[str, int]) -> None:
        """Move the push-budget units (:meth:`PushShares.step`) and take note of who is
        live, from everything heard by ``now``."""
        self.forget_dead(now)
        self._live = self.live(now)
        before = self.shares.usable_counts()
        self.shares.step(now, unseen_pushes, wants)
        after = self.shares.usable_counts()
        self.units_grew = any(n > before.get(r, 0) for r, n in after.items())

    def unseen_on(self, replica_id: str) -> int:
        """The live siblings' pushes to ``replica_id`` their last page of it did not show
        yet (their last word on it, as of the last step)."""
        return sum(ld.unseen for m in self._live.values() if (ld := m.loads.get(replica_id)) is not None)

    def pending_prefill_on(self) -> dict[str, int]:
        """Per replica, the live siblings' prefill tokens there without a first token (their
        last word, as of the last step): what a policy adds to this balancer's own to see a
        replica's load as the region made it."""
        out: dict[str, int] = {}
        for m in self._live.values():
            for rid, ld in m.loads.items():
                if ld.pending_prefill_tokens:
                    out[rid] = out.get(rid, 0) + ld.pending_prefill_tokens
        return out

    def pending_prefill_tokens_as_of_step(self) -> int:
        """The live siblings' pending prefill as of the last step (no clock needed)."""
        return sum(m.pending_prefill_tokens for m in self._live.values())

    def queue_length(self, now: float) -> int:
        return sum(m.shares.queue_length for m in self.live(now).values())

    def pending_prefill_tokens(self, now: float) -> int:
        return sum(m.pending_prefill_tokens for m in self.live(now).values())

    def placements_per_s(self, now: float) -> float:
        return sum(m.placements_per_s for m in self.live(now).values())

    def forget_dead(self, now: float, keep_for_s: float = 60.0) -> None:
        for sid in [sid for sid, h in self._heard.items() if now - h.at > keep_for_s]:
            del self._heard[sid]
        self.shares.forget_dead(now, keep_for_s)
