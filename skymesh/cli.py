"""The `skymesh` command. Each subcommand lives in its own module, imported lazily so
that `skymesh status` does not pay for importing the simulator or matplotlib."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_arguments(parser) and run(args) -> int, help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("skymesh.operations.up", "start the whole mesh from a config (the embedded local default)"),
    "status": ("skymesh.operations.status", "show the mesh: regions, balancers, replicas, queues"),
    "balancer": ("skymesh.balancer.main", "run one regional balancer"),
    "controller": ("controller.main", "run the central controller"),
    "replica-sim": ("skymesh.replica_sim.main", "run a vLLM stand-in replica"),
    "dns": ("skymesh.dns.main", "run the embedded authoritative DNS server alone"),
    "bench": ("skymesh.bench.main", "benchmarks: live trace replay, routing micro-benchmark"),
    "sim": ("skymesh.bench.sim_main", "discrete-event simulation of the routing core"),
    "config": ("skymesh.operations.config_cli", "validate a config file and print it"),
    "pki": ("skymesh.security.pki_cli", "issue a mesh's credentials offline (CA, certificates, peer and admin tokens)"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="skymesh", description="geo-distributed LLM load-balancer mesh")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    args_list = list(sys.argv[1:] if argv is None else argv)
    wanted = args_list[0] if args_list else None
    if wanted == "bench" and (len(args_list) == 1 or args_list[1].startswith("--")) and "-h" not in args_list[1:2]:
        args_list.insert(1, "trace")  # `skymesh bench --trace FILE ...` is the live replay
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        # only the chosen subcommand's module is imported
        if name == wanted:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    args = parser.parse_args(args_list)
    sys.exit(args._run(args) or 0)


if __name__ == "__main__":
    main()
