"""Memory of the KV-event block index (skymesh/routing/kv_index.py) per replica: bytes per
block held, and that the bound holds when more blocks are stored than it allows (missed
removals). vLLM-style 32-byte block hashes, 16-token blocks, chains of 64 blocks.

    .venv/bin/python -m benchmarks.kv_index_memory [--blocks 200000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skymesh.routing.kv_index import BlockStored, ReplicaBlockIndex  # noqa: E402

BLOCK, CHAIN = 16, 64


def store_chains(idx: ReplicaBlockIndex, blocks: int, rnd: random.Random) -> None:
    for _ in range(blocks // CHAIN):
        hashes = [os.urandom(32) for _ in range(CHAIN)]
        ids = [rnd.randrange(128_000) for _ in range(CHAIN * BLOCK)]
        idx.apply([BlockStored(hashes, None, ids, BLOCK)], 0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=200_000)
    args = ap.parse_args()
    rnd = random.Random(0)
    tracemalloc.start()
    idx = ReplicaBlockIndex(BLOCK, max_blocks=args.blocks)
    base = tracemalloc.get_traced_memory()[0]
    store_chains(idx, args.blocks, rnd)
    full = tracemalloc.get_traced_memory()[0] - base
    store_chains(idx, args.blocks // 2, rnd)  # 1.5x the bound: the oldest must go
    over = tracemalloc.get_traced_memory()[0] - base
    print(json.dumps({"blocks_held": len(idx), "bytes_per_block": round(full / len(idx), 1),
                      "mb_at_bound": round(full / 1e6, 1), "mb_after_1_5x_the_bound": round(over / 1e6, 1),
                      "evicted_by_bound": idx.evicted_by_bound}))


if __name__ == "__main__":
    main()
