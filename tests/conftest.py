"""Fixtures shared by several test modules."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from moto.server import ThreadedMotoServer

from tests.mesh_helpers import free_port


@pytest.fixture
def moto_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A Route53 emulator (moto) server on loopback, empty, with test credentials."""
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    # moto keeps its backends per process: start from an empty Route53 every time
    urllib.request.urlopen(urllib.request.Request(url + "/moto-api/reset", method="POST"), timeout=10).read()
    try:
        yield url
    finally:
        server.stop()
