"""`skymesh replica-sim --port P --profile NAME [--time-scale X]`: run a vLLM stand-in
until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from skymesh.logging_setup import setup_logging
from skymesh.procs import READY_HELP, report_ready, serve_until_signal
from skymesh.replica_sim.profiles import PROFILES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = READY_HELP + ' Key: "http".'
    p.add_argument("--port", type=int, required=True, help="HTTP port (0: any free one, reported)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--profile", default="l4-llama3.1-8b", choices=sorted(PROFILES))
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every step time (0.1 = ten times faster than the profile)")
    p.add_argument("--model", default="skymesh-sim", help="model name served (must match the config's)")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="override the KV cache size in blocks")
    p.add_argument("--block-size", type=int, default=None, help="override the KV block size in tokens")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="override the batch size limit (default: vLLM 0.32's for the profile's GPU)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="override the step token budget (default: vLLM 0.32's for the profile's GPU)")
    p.add_argument("--log-level", default="WARNING")


def _overrides(args: argparse.Namespace) -> dict[str, int]:
    return {k: v for k, v in {
        "num_gpu_blocks": args.num_gpu_blocks, "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
    }.items() if v is not None}


async def _serve(args: argparse.Namespace) -> int:
    from skymesh.replica_sim.server import ReplicaServer, start_replica

    srv: dict[str, ReplicaServer] = {}

    async def start() -> None:
        # started after the signal handlers are in place: a SIGTERM during startup still
        # shuts down cleanly
        srv["s"] = await start_replica(args.host, args.port, args.profile, args.time_scale, args.model,
                                       **_overrides(args))
        report_ready({"http": srv["s"].port})

    async def stop() -> None:
        if "s" in srv:
            await srv["s"].close()

    return await serve_until_signal(start, stop)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    problems: list[str] = []
    if not 0 <= args.port <= 65535:
        problems.append(f"--port must be 0-65535, got {args.port}")
    if args.time_scale <= 0:
        problems.append(f"--time-scale must be > 0, got {args.time_scale}")
    bad: dict[str, Any] = {k: v for k, v in _overrides(args).items() if v < 1}
    problems += [f"--{k.replace('_', '-')} must be >= 1, got {v}" for k, v in bad.items()]
    if problems:
        for msg in problems:
            print(f"skymesh replica-sim: {msg}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(args))
    except OSError as e:  # e.g. the port is taken: one line, not a traceback
        print(f"skymesh replica-sim: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
              file=sys.stderr)
        return 1
