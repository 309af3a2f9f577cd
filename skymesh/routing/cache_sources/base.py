"""What a cache source is: something that can say, for the replicas it knows of right
now, how many leading chunks of a prompt each holds. A :class:`CacheView` asks its
sources in order; each replica is answered by the first source live for it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class CacheSource(Protocol):
    # what the balancer's status calls it ("events", "routing-history")
    name: str

    def any_live(self) -> bool:
        """Whether it can answer for some replica now (else the view skips it at once)."""
        ...

    def live(self, replica_id: str) -> bool:
        """Whether it can answer for ``replica_id`` now."""
        ...

    def match_per_target(self, chunks: Sequence[int], replica_ids: Sequence[str]) -> dict[str, int]:
        """Per replica of ``replica_ids`` (each one it is live for), how many leading
        chunks of the prompt whose chunk hashes are ``chunks`` it holds."""
        ...
