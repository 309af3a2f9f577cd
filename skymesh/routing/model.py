"""One region's model of its replicas, built once per region and shared by everything
that prices or places a request there: the policy, offload and the queue discipline.

It owns the cost model (a :class:`~skymesh.routing.ttft.TTFTEstimator`: seconds of
prefill per token and the fixed part of a first token, seeded from the replica profile;
a policy that learns from observed TTFTs refits this one estimator, so offload and the
disciplines price prefill as the policy does) and the one :class:`CacheView` of what the
replicas hold, over the cache sources :func:`cache_sources` lists.

Pure: no sockets, no clock.
"""

from __future__ import annotations

from skymesh.routing.cache_sources.base import CacheSource
from skymesh.routing.cache_sources.kv_events import KvEventSource
from skymesh.routing.cache_sources.routing_history import RoutingHistory
from skymesh.routing.cache_view import CacheView
from skymesh.routing.kv_index import KvIndexes
from skymesh.routing.request import RoutingRequest
from skymesh.routing.trie import BoundedPrefixTrie
from skymesh.routing.ttft import TTFTEstimator

# the replica profile's TTFT seed when none is known: seconds per prompt token, fixed seconds
DEFAULT_PREFILL_S_PER_TOKEN = 300e-3 / 512
DEFAULT_FIRST_TOKEN_FIXED_S = 0.02
DEFAULT_TRIE_MAX_NODES = 200_000


def cache_sources(history: RoutingHistory, kv_indexes: KvIndexes | None) -> list[CacheSource]:
    """The cache sources in the order a region's :class:`CacheView` asks them (each replica
    is answered by the first one live for it). A new source is one file in
    ``cache_sources/`` and one line here; the routing history answers last, for all."""
    return [
        *([KvEventSource(kv_indexes)] if kv_indexes is not None else []),
        history,
    ]


class RegionModel:
    def __init__(
        self,
        *,
        chunk_tokens: int = 64,
        prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN,
        first_token_fixed_s: float = DEFAULT_FIRST_TOKEN_FIXED_S,
        trie_max_nodes: int = DEFAULT_TRIE_MAX_NODES,
        kv_indexes: KvIndexes | None = None,
    ) -> None:
        # the balancer's chunk size, in tokens (RoutingRequest.chunk_hashes are per chunk)
        self.chunk_tokens = chunk_tokens
        self.estimator = TTFTEstimator(prefill_s_per_token, first_token_fixed_s)
        # the replicas' KV-event indexes (the region core fills them); None: none publish
        self.kv_indexes = kv_indexes
        history = RoutingHistory(BoundedPrefixTrie(trie_max_nodes))
        self.cache = CacheView(cache_sources(history, kv_indexes), history)

    def record_dispatch(self, req: RoutingRequest, replica_id: str, now: float) -> None:
        """``req`` went to ``replica_id``: its prompt is in the routing history now. The
        region core records each dispatch once, after the policy and the discipline (which
        read the history as it was before it) were told of it."""
        self.cache.insert(req.chunk_hashes, replica_id)

    @property
    def prefill_s_per_token(self) -> float:
        return self.estimator.s_per_token

    @property
    def first_token_fixed_s(self) -> float:
        return self.estimator.fixed_s

    def prefill_s(self, tokens: int) -> float:
        """Seconds of prefill for ``tokens`` prompt tokens."""
        return self.estimator.s_per_token * tokens
