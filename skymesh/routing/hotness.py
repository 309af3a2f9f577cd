"""DualMap's adaptive hash-prefix length: a hotness tree over prefix keys.

Every request walks its prefix keys from ``base_chunks`` outward. A key whose share of the
sliding window of recent requests exceeds 2/n (n = replicas) is *hot*: requests under it
are keyed one chunk deeper, so a hot system prompt's traffic splits over the pairs of its
children instead of hammering one pair. A hot key cools when its share falls below 1/n
(hysteresis avoids flapping).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class HotnessTree:
    def __init__(self, base_chunks: int = 1, window: int = 512, max_extra_chunks: int = 16) -> None:
        self.base_chunks = max(1, base_chunks)
        self.window = window
        self.max_extra_chunks = max_extra_chunks
        self._recent: deque[tuple[int, ...]] = deque()
        self._counts: dict[int, int] = {}
        self.hot: set[int] = set()

    def key_length(self, chunks: Sequence[int], n_replicas: int) -> int:
        """How many chunks of this prompt form its ring key (no state change)."""
        if not chunks:
            return 0
        length = min(self.base_chunks, len(chunks))
        limit = min(len(chunks), self.base_chunks + self.max_extra_chunks)
        while length < limit and chunks[length - 1] in self.hot:
            length += 1
        return length

    def observe(self, chunks: Sequence[int], n_replicas: int) -> None:
        """Count one dispatched request and update which keys are hot."""
        if not chunks or n_replicas < 2:
            return
        length = self.key_length(chunks, n_replicas)
        # count the keys along the path up to (and including) the key actually used,
        # plus one deeper so a hot key's children build up their own shares
        depth = min(len(chunks), length + 1)
        keys = tuple(chunks[self.base_chunks - 1 : depth]) if depth >= self.base_chunks else ()
        self._recent.append(keys)
        for k in keys:
            self._counts[k] = self._counts.get(k, 0) + 1
        total = len(self._recent)
        if total > self.window:
            total -= 1
            for k in self._recent.popleft():
                c = self._counts[k] - 1
                if c:
                    self._counts[k] = c
                else:
                    del self._counts[k]
                # a hot key is re-judged whenever its share drops, even if no request
                # under it arrives any more
                if k in self.hot and c / total < 1.0 / n_replicas:
                    self.hot.discard(k)
        if total < max(8, n_replicas):
            return  # too little traffic to call anything hot
        for k in keys:
            share = self._counts.get(k, 0) / total
            if k in self.hot:
                if share < 1.0 / n_replicas:
                    self.hot.discard(k)
            elif share > 2.0 / n_replicas:
                self.hot.add(k)
