"""The region a client's address comes from (RequestIntake.origin_of): remembered per
address, and the remembered answers dropped on a reload that moves the networks."""

from __future__ import annotations

import ipaddress
from types import SimpleNamespace
from typing import Any

from skymesh.balancer import request_intake
from skymesh.balancer.request_intake import RequestIntake
from skymesh.config import MeshConfig, load_config


def _intake(cfg: MeshConfig) -> RequestIntake:
    unused: Any = None  # origin_of reads none of the collaborators
    return RequestIntake(cfg, "us-east-1", core=unused, flow=unused, gate=unused, metrics=unused, wake=unused,
                         counter=unused, peers=lambda: (), on_request_end=lambda: None)


def _client(remote: str) -> Any:
    return SimpleNamespace(remote=remote, headers={})


def _moved(cfg: MeshConfig) -> MeshConfig:
    """eu-west-1's loopback network handed to ap-northeast-1."""
    regions = []
    for r in cfg.regions:
        nets = [n for n in r.source_networks if n != ipaddress.ip_network("127.2.0.0/16")]
        if r.name == "ap-northeast-1":
            nets.append(ipaddress.ip_network("127.2.0.0/16"))
        regions.append(r.model_copy(update={"source_networks": tuple(nets)}))
    return cfg.model_copy(update={"regions": regions})


def test_the_region_of_an_address_is_the_same_every_time_and_follows_a_reload() -> None:
    cfg = load_config(None)
    intake = _intake(cfg)
    for _ in range(3):  # remembered after the first
        assert intake.origin_of(_client("127.2.0.5"), forwarded=False) == "eu-west-1"
        assert intake.origin_of(_client("127.1.0.9"), forwarded=False) is None  # this region's own
        assert intake.origin_of(_client("192.0.2.1"), forwarded=False) is None  # in no network
        assert intake.origin_of(_client("not an address"), forwarded=False) is None
    intake.reconfigure(_moved(cfg))
    assert intake.origin_of(_client("127.2.0.5"), forwarded=False) == "ap-northeast-1"


def test_a_full_table_is_dropped_and_answers_stay_right(monkeypatch: Any) -> None:
    monkeypatch.setattr(request_intake, "REMOTE_REGIONS_KEPT", 4)
    intake = _intake(load_config(None))
    for i in range(10):
        assert intake.origin_of(_client(f"127.2.0.{i}"), forwarded=False) == "eu-west-1"
        assert intake.origin_of(_client(f"127.3.0.{i}"), forwarded=False) == "ap-northeast-1"
    assert len(intake._remote_regions) <= 4
