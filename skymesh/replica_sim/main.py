"""`skymesh replica-sim --port P --profile NAME [--time-scale X] [--tokenizer PATH]
[--kv-events-config JSON] [--kv-transfer-port PORT ...]`: run a vLLM stand-in until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from skymesh.assets import resolve_file_ref
from skymesh.hardware import PROFILES
from skymesh.replica_sim.kv_events import KVEventsConfig
from skymesh.replica_sim.kv_publisher import tcp_port
from skymesh.replica_sim.kv_transfer import LOAD_FAILURE_POLICIES, KVTransferSettings
from skymesh.replica_sim.server import ReplicaServer, start_replica
from skymesh.runtime.event_loop import run_loop
from skymesh.runtime.logging_setup import setup_logging
from skymesh.runtime.procs import READY_HELP, report_ready, serve_until_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = READY_HELP + (' Keys: "http"; with KV events on, "kv_events" and "kv_replay" for the '
                             'TCP ports the PUB and replay sockets bound.')
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
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the model's local HF tokenizer.json (or its folder; pkg:<package>/<path> for one "
                        "shipped in a package, e.g. pkg:skymesh/assets/tokenizer): token ids (and so prefix "
                        "caching, KV events and the generated text) are the tokenizer's (default: whitespace words)")
    p.add_argument("--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
                   help="vLLM 0.32's KV events config, e.g. '{\"enable_kv_cache_events\": true, "
                        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                        "\"replay_endpoint\": \"tcp://*:5558\"}' (off by default)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="as vLLM's: usage.prompt_tokens_details.cached_tokens reports the prompt "
                        "tokens found in the prefix cache")
    p.add_argument("--kv-transfer-port", type=int, default=None, metavar="PORT",
                   help="play vLLM's NIXL pull connector (P/D disaggregation) with its side channel on this "
                        "port (0: any free one, reported as \"kv_transfer\"); off by default")
    p.add_argument("--kv-engine-id", default=None, help="the connector's engine id (default: derived from host:port)")
    p.add_argument("--kv-lease-s", type=float, default=30.0,
                   help="vLLM's kv_lease_duration: how long a prefill leg's blocks wait for the decode side")
    p.add_argument("--kv-bandwidth-gbps", type=float, default=100.0, help="the modelled KV pull's bandwidth")
    p.add_argument("--kv-latency-ms", type=float, default=0.5, help="the modelled KV pull's latency")
    p.add_argument("--kv-load-failure-policy", choices=LOAD_FAILURE_POLICIES, default="fail",
                   help="vLLM's kv_load_failure_policy: a failed KV read errors the request, or recomputes it")
    p.add_argument("--kv-peer", action="append", default=[], metavar="HOST",
                   help="a host a decode leg may read from besides loopback IP literals (repeatable)")
    p.add_argument("--log-level", default="WARNING")


def tokenizer_file(ref: str) -> str:
    """``--tokenizer``'s tokenizer.json: a file, a folder holding one (as vLLM's
    ``--tokenizer`` names a folder), either as ``pkg:<package>/<path>``; ValueError when
    there is none."""
    path = Path(resolve_file_ref(ref))
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no such file {path}")
    return str(path)


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad --kv-events-config: {e}") from None


def _overrides(args: argparse.Namespace) -> dict[str, int]:
    return {k: v for k, v in {
        "num_gpu_blocks": args.num_gpu_blocks, "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
    }.items() if v is not None}


async def _serve(args: argparse.Namespace) -> int:
    srv: dict[str, ReplicaServer] = {}

    async def start() -> None:
        # started after the signal handlers are in place: a SIGTERM during startup still
        # shuts down cleanly
        s = srv["s"] = await start_replica(args.host, args.port, args.profile, args.time_scale, args.model,
                                           tokenizer=args.tokenizer, kv_events=args.kv_events_config,
                                           enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                                           kv_transfer=args.kv_transfer, **_overrides(args))
        ready = {"http": s.port}
        if s.kv is not None:
            ready["kv_transfer"] = s.kv.port
        pub = s.engine_loop.kv_publisher
        # the TCP ports the event sockets listen on (the replay socket always listens)
        for key, endpoint in (("kv_events", pub.endpoint if pub.pub_bound else None),
                              ("kv_replay", pub.replay_endpoint)):
            port = tcp_port(endpoint)
            if port is not None:
                ready[key] = port
        report_ready(ready)

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
    if args.tokenizer is not None:
        try:
            args.tokenizer = tokenizer_file(args.tokenizer)
        except ValueError as e:
            problems.append(f"--tokenizer: {e}")
    args.kv_transfer = None
    if args.kv_transfer_port is not None:
        try:
            args.kv_transfer = KVTransferSettings(
                side_channel_port=args.kv_transfer_port, engine_id=args.kv_engine_id, lease_s=args.kv_lease_s,
                bandwidth_gbps=args.kv_bandwidth_gbps, latency_ms=args.kv_latency_ms,
                load_failure_policy=args.kv_load_failure_policy, peers=tuple(args.kv_peer))
        except ValueError as e:
            problems.append(f"--kv-transfer: {e}")
    if problems:
        for msg in problems:
            print(f"skymesh replica-sim: {msg}", file=sys.stderr)
        return 2
    import zmq

    try:
        return run_loop(_serve(args))
    except OSError as e:  # e.g. the port is taken: one line, not a traceback
        print(f"skymesh replica-sim: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    except zmq.ZMQError as e:  # a KV events endpoint that cannot be bound or connected
        print(f"skymesh replica-sim: KV events: {e}", file=sys.stderr)
        return 1
