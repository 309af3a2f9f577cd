"""SkyWalker-CH: consistent hashing on the session key (``X-Session-ID`` or OpenAI
``user``; the prompt's first chunk when neither is given), walking clockwise past
unavailable replicas."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import xxhash
from pydantic import Field

from skymesh.routing.base import Decision, PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.options import PolicyOptions
from skymesh.routing.policies.common import BasePolicy, decide
from skymesh.routing.ring import DualHashRing


class ConsistentHashOptions(PolicyOptions):
    """``policy.options`` of ``consistent_hash``."""

    virtual_nodes: int = Field(160, ge=1)  # points per replica on the hash ring


class ConsistentHashPolicy(BasePolicy):
    name = "consistent_hash"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.ring = DualHashRing(virtual_nodes=ConsistentHashOptions.parse(ctx.options).virtual_nodes)

    def set_replicas(self, replica_ids: Sequence[str]) -> None:
        super().set_replicas(replica_ids)
        self.ring.set_members(replica_ids)

    @staticmethod
    def key(req: RoutingRequest) -> int:
        if req.session_key:
            # surrogatepass: aiohttp decodes header bytes that are not UTF-8 to lone
            # surrogates (surrogateescape); such a session key must hash, not raise
            return xxhash.xxh64_intdigest(req.session_key.encode("utf-8", "surrogatepass"))
        return req.chunk_hashes[0] if req.chunk_hashes else 0

    def choose(self, req: RoutingRequest, replicas: Mapping[str, ReplicaView], now: float) -> Decision:
        for rid in self.ring.walk_from(self.key(req)):
            v = replicas.get(rid)
            if v is not None and v.available and v.healthy:
                return decide(v, "consistent_hash")
        return Decision(None, "none available")
