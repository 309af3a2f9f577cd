"""Memory of one routing-history trie at its node bound (docs/benchmarks.md, "Routing-history
trie memory").

    PYTHONPATH=. .venv/bin/python -m benchmarks.trie_memory [--nodes 200000] [--replicas 100]

Conversations as the scale day has them: a few shared system prompts (their nodes are held
by every replica), each followed by a tail of chunks of its own sent to one replica, until
the trie has evicted past its bound. Bytes are what tracemalloc counts as allocated while
the trie is built and still held at the end (the trie's dicts, node keys and target sets),
divided by the nodes held. Runs on older trees too (their ``insert`` took a time).
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import tracemalloc

from skymesh.routing.trie import BoundedPrefixTrie


def measure(nodes: int, replicas: int, system_prompts: int, system_chunks: int, tail_chunks: int,
            seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    targets = [f"r{i}" for i in range(replicas)]
    systems = [[rng.getrandbits(63) for _ in range(system_chunks)] for _ in range(system_prompts)]
    timed = "now" in inspect.signature(BoundedPrefixTrie.insert).parameters
    # enough conversations to fill the bound twice over (evictions included)
    conversations = 2 * nodes // tail_chunks
    tracemalloc.start()
    trie = BoundedPrefixTrie(nodes)
    for i in range(conversations):
        chunks = systems[i % system_prompts] + [rng.getrandbits(63) for _ in range(tail_chunks)]
        if timed:
            trie.insert(chunks, targets[i % replicas], float(i))  # type: ignore[call-arg]
        else:
            trie.insert(chunks, targets[i % replicas])
    held, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"nodes": len(trie), "bytes": held, "bytes_per_node": round(held / len(trie), 1),
            "evictions": trie.evictions}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trie_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=200_000, help="the trie's bound (policy.trie_max_nodes)")
    p.add_argument("--replicas", type=int, default=100)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-chunks", type=int, default=8)
    p.add_argument("--tail-chunks", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.nodes, args.replicas, args.system_prompts, args.system_chunks,
                             args.tail_chunks, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
