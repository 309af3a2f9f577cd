"""The `skymesh` command. Each subcommand lives in its own module, imported lazily so
that `skymesh status` does not pay for importing the simulator or matplotlib."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> (module with add_arguments(parser) and run(args) -> int, help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("skymesh.operations.up", "start the whole mesh from a config (the embedded local default)"),
    "status": ("skymesh.operations.status", "show the mesh: regions, balancers, replicas, queues"),
    "resolve": ("skymesh.operations.resolve", "ask the mesh's embedded DNS server for a name, as a client of a region"),
    "balancer": ("skymesh.balancer.main", "run one regional balancer"),
    "controller": ("controller.main", "run the central controller"),
    "replica-sim": ("skymesh.replica_sim.main", "run a vLLM stand-in replica"),
    "dns": ("skymesh.dns.main", "run the embedded authoritative DNS server alone"),
    "bench": ("skymesh.bench.main", "benchmarks: live trace replay, routing and proxy micro-benchmarks, "
                                    "live-vs-simulated agreement"),
    "sim": ("skymesh.bench.sim_main", "discrete-event simulation of the routing core"),
    "plan": ("skymesh.bench.plan_main", "the fewest replicas per region meeting the SLO over a day, "
                                        "mesh vs region-local, by simulating the routing code"),
    "config": ("skymesh.operations.config_cli", "validate a config file and print it"),
    "pki": ("skymesh.security.pki_cli", "issue a mesh's credentials offline (CA, certificates, peer and admin tokens)"),
}

# the exit code of a command whose reader went away (`skymesh status --json | head -1`)
CLOSED_PIPE_EXIT = 1


def _dispatch(argv: list[str] | None) -> int | str | None:
    parser = argparse.ArgumentParser(prog="skymesh", description="geo-distributed LLM load-balancer mesh")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    args_list = list(sys.argv[1:] if argv is None else argv)
    wanted = args_list[0] if args_list else None
    if wanted == "bench":
        # lazy: light CLI start-up, only `skymesh bench` needs its mode list
        from skymesh.bench.main import with_default_mode

        args_list[1:] = with_default_mode(args_list[1:])  # `skymesh bench --trace FILE ...` is the live replay
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        # only the chosen subcommand's module is imported
        if name == wanted:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    try:
        args = parser.parse_args(args_list)
        return args._run(args) or 0
    except SystemExit as e:  # argparse (--help, a usage error) and commands that exit early
        return e.code


def _quiet_after_closed_pipe() -> None:
    """The Python docs' way out after a BrokenPipeError: point stdout at /dev/null so the
    interpreter's final flush of what is still buffered cannot fail again (and print
    'Exception ignored ... BrokenPipeError')."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> None:
    try:
        code = _dispatch(argv)
        sys.stdout.flush()  # inside the try: the reader may be gone before the last bytes
    except BrokenPipeError:
        # the reader closed the pipe (`| head -1`): not an error worth a traceback
        _quiet_after_closed_pipe()
        code = CLOSED_PIPE_EXIT
    sys.exit(code)


if __name__ == "__main__":
    main()
