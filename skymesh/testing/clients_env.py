"""The field's benchmark clients, pinned, for ``tests/test_clients.py``: built by
``make clients-env``, never by a test.

Two venvs at the clone's root (gitignored, removed by ``make clean``), both on Python 3.12
(inference-perf requires it; the others share it):

* ``.venv-clients/``: the openai SDK, LiteLLM, guidellm and aiperf, which install together;
* ``.venv-inference-perf/``: inference-perf alone (it requires ``aiofiles>=25.1.0``,
  aiperf ``aiofiles~=24.1.0``).

``vllm bench serve`` is the one in the project's vLLM venv (``make vllm-env``). Stamps,
bounded builds and the failure record are :mod:`skymesh.testing.tool_venv`'s: without a
package index ``python -m skymesh.testing.clients_env build`` says why and exits 0, and
the client tests skip with that reason. docs/clients.md has each client's recipe.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from skymesh.testing.tool_venv import ROOT, ToolVenv, build_main

PYTHON = os.environ.get("SKYMESH_CLIENTS_PYTHON", "python3.12")
CLIENT_PINS = ("openai==3.57.0", "litellm==1.110.2", "guidellm==0.8.1", "aiperf==0.13.0")
INFERENCE_PERF_PIN = "inference-perf==0.7.0"
# four packages with big trees (about 5-8 minutes from an index); a stalled index gives up
BUILD_TIMEOUT_S = 1200.0

CLIENTS = ToolVenv(
    name="benchmark clients", venv=Path(os.environ.get("SKYMESH_CLIENTS_VENV", ROOT / ".venv-clients")),
    pins=CLIENT_PINS, make_target="clients-env", executable="python",
    check_args=("-c", "import openai, litellm, guidellm, aiperf"), base_python=PYTHON, timeout_s=BUILD_TIMEOUT_S)
INFERENCE_PERF = ToolVenv(
    name="inference-perf", venv=Path(os.environ.get("SKYMESH_INFERENCE_PERF_VENV", ROOT / ".venv-inference-perf")),
    pins=(INFERENCE_PERF_PIN,), make_target="clients-env", executable="inference-perf", check_args=("--help",),
    base_python=PYTHON, timeout_s=BUILD_TIMEOUT_S)
VENVS = (CLIENTS, INFERENCE_PERF)


def main(argv: list[str] | None = None) -> int:
    return build_main("python -m skymesh.testing.clients_env", VENVS, "tests/test_clients.py's tests", argv,
                     description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
