"""The replicas' own word on their caches: vLLM's KV events, indexed per replica
(:class:`~skymesh.routing.kv_index.KvIndexes`). Live for a replica while its events flow
in step and its blocks are the balancer's chunks."""

from __future__ import annotations

from collections.abc import Sequence

from skymesh.routing.kv_index import KvIndexes


class KvEventSource:
    name = "events"

    def __init__(self, indexes: KvIndexes) -> None:
        self.indexes = indexes

    def any_live(self) -> bool:
        return bool(self.indexes.by_replica)

    def live(self, replica_id: str) -> bool:
        return self.indexes.live(replica_id) is not None

    def match_per_target(self, chunks: Sequence[int], replica_ids: Sequence[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for rid in replica_ids:
            idx = self.indexes.live(rid)
            if idx is not None:
                out[rid] = idx.cached_chunks(chunks)
        return out
