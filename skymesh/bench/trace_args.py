"""The ``--trace`` argument of `skymesh sim` and `skymesh bench`.

A trace file that does not exist is an error in argparse's form (``PROG: error: argument
--trace: ...``, exit code 2) when the command line is parsed, not a ``FileNotFoundError``
traceback once the run starts; one line, without the usage (dozens of options that are not
the problem). Argparse converts a string default too, so the default trace (which lives
outside the repository) is checked the same way when no ``--trace`` is given.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

# where the default trace comes from: it is not part of the repository
WHERE_TRACES_COME_FROM = (
    "traces are not in the repository: the default is the Mooncake conversation trace "
    "(kvcache-ai/Mooncake, FAST25-release/traces/conversation_trace.jsonl) saved as "
    "../shared/traces/mooncake_conversation.jsonl beside the clone"
)


def trace_argument(prog: str, workloads: tuple[str, ...] = ()) -> Callable[[str], str]:
    """An argparse ``type`` for ``--trace`` of the command ``prog``: a Mooncake JSONL file
    that exists, or one of the generated ``workloads`` named by their names."""

    def check(value: str) -> str:
        if value in workloads or Path(value).is_file():
            return value
        instead = f"; or a generated workload: {', '.join(workloads)}" if workloads else ""
        # SystemExit, not ArgumentTypeError: argparse would print the whole usage first
        print(f"{prog}: error: argument --trace: no trace file {value} ({WHERE_TRACES_COME_FROM}{instead})",
              file=sys.stderr)
        raise SystemExit(2)

    return check
