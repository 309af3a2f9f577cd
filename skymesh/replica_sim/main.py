"""`skymesh replica-sim --port P --profile NAME [--time-scale X]`: run a vLLM stand-in."""

from __future__ import annotations

import argparse
import asyncio
import sys

from skymesh.logging_setup import setup_logging
from skymesh.procs import serve_until_signal
from skymesh.replica_sim.profiles import PROFILES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--profile", default="l4-llama3.1-8b", choices=sorted(PROFILES))
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every step time (0.1 = ten times faster than the profile)")
    p.add_argument("--model", default="skymesh-sim", help="model name served (must match the config's)")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="override the KV cache size")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--log-level", default="WARNING")


async def _serve(args: argparse.Namespace) -> int:
    from skymesh.replica_sim.server import start_replica

    overrides = {k: v for k, v in {
        "num_gpu_blocks": args.num_gpu_blocks, "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
    }.items() if v is not None}
    srv = await start_replica(args.host, args.port, args.profile, args.time_scale, args.model, **overrides)

    async def started() -> None:
        return None

    return await serve_until_signal(started, srv.close)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if args.time_scale <= 0:
        print("--time-scale must be > 0", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args))
