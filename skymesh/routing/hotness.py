"""DualMap's adaptive hash-prefix length: a hotness tree over prefix keys.

Every request walks its prefix keys from ``base_chunks`` outward. A key whose share of the
sliding window of recent requests exceeds 2/n (n = replicas) is *hot*: requests under it
are keyed one chunk deeper, so a hot system prompt's traffic splits over the pairs of its
children instead of hammering one pair. A hot key cools when its share falls below 1/n
(hysteresis avoids flapping).

The window holds the last ``window`` requests and, when ``window_s`` is given, only those
observed in the last ``window_s`` seconds (``now`` is passed in; nothing reads a clock).
The tree is implicit: a cumulative chunk hash names its whole prefix, so counting keys by
hash is counting tree nodes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class HotnessTree:
    def __init__(
        self,
        base_chunks: int = 1,
        window: int = 512,
        max_extra_chunks: int = 16,
        window_s: float | None = None,
    ) -> None:
        self.base_chunks = max(1, base_chunks)
        self.window = window
        self.window_s = window_s
        self.max_extra_chunks = max_extra_chunks
        self._recent: deque[tuple[float, tuple[int, ...]]] = deque()
        self._counts: dict[int, int] = {}
        self.hot: set[int] = set()

    def key_length(self, chunks: Sequence[int], n_replicas: int) -> int:
        """How many chunks of this prompt form its ring key (no state change)."""
        if not chunks:
            return 0
        length = min(self.base_chunks, len(chunks))
        limit = min(len(chunks), self.base_chunks + self.max_extra_chunks)
        hot = self.hot
        while length < limit and chunks[length - 1] in hot:
            length += 1
        return length

    def expire(self, now: float, n_replicas: int) -> None:
        """Drop requests older than ``window_s`` (no-op for a count-only window)."""
        if self.window_s is None:
            return
        horizon = now - self.window_s
        while self._recent and self._recent[0][0] < horizon:
            self._forget_oldest(n_replicas)

    def _forget_oldest(self, n_replicas: int) -> None:
        _, keys = self._recent.popleft()
        total = len(self._recent)
        counts = self._counts
        for k in keys:
            c = counts[k] - 1
            if c:
                counts[k] = c
            else:
                del counts[k]
            # a hot key is re-judged whenever its share drops, even if no request under
            # it arrives any more
            if k in self.hot and (total == 0 or c / total < 1.0 / max(1, n_replicas)):
                self.hot.discard(k)

    def observe(self, chunks: Sequence[int], n_replicas: int, now: float = 0.0) -> None:
        """Count one dispatched request and update which keys are hot."""
        self.expire(now, n_replicas)
        if not chunks or n_replicas < 2:
            return
        length = self.key_length(chunks, n_replicas)
        # count the keys along the path up to (and including) the key actually used,
        # plus one deeper so a hot key's children build up their own shares
        depth = min(len(chunks), length + 1)
        keys = tuple(chunks[self.base_chunks - 1 : depth]) if depth >= self.base_chunks else ()
        self._recent.append((now, keys))
        counts = self._counts
        for k in keys:
            counts[k] = counts.get(k, 0) + 1
        while len(self._recent) > self.window:
            self._forget_oldest(n_replicas)
        total = len(self._recent)
        if total < max(8, n_replicas):
            return  # too little traffic to call anything hot
        for k in keys:
            share = counts.get(k, 0) / total
            if k in self.hot:
                if share < 1.0 / n_replicas:
                    self.hot.discard(k)
            elif share > 2.0 / n_replicas:
                self.hot.add(k)

    def stats(self) -> dict[str, int]:
        return {"hot_prefixes": len(self.hot), "window_requests": len(self._recent)}
