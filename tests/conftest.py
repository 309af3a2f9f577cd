"""Fixtures shared by several test modules."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator

import pytest
from moto.server import ThreadedMotoServer

# The admin surfaces (/admin/*, the controller's API, the DNS control GET) need a token:
# every daemon a test starts, in process or as a child, reads this one from the env, and
# the tests send it (tests.mesh_helpers.ADMIN_HEADERS).
os.environ.setdefault("SKYMESH_ADMIN_TOKEN", "skymesh-test-admin-token")
# likewise the mesh's peer token (no default ships), so no test writes a local token file
os.environ.setdefault("SKYMESH_PEER_TOKEN", "skymesh-test-peer-token")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The soak runs only when asked for by marker (``-m soak``): it takes ten minutes."""
    if "soak" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="the soak runs only with -m soak")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)


@pytest.fixture
def moto_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A Route53 emulator (moto) server on loopback, empty, with test credentials."""
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    # port 0: the kernel picks, the server says which (no pick-then-bind race)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    # moto keeps its backends per process: start from an empty Route53 every time
    urllib.request.urlopen(urllib.request.Request(url + "/moto-api/reset", method="POST"), timeout=10).read()
    try:
        yield url
    finally:
        server.stop()
