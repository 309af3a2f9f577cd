"""The policy registry, the only list of policies: a name → the policy class and its
options model. A new policy is one file in ``policies/`` plus one line here; the config
validation and ``skymesh sim`` ask this registry."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from skymesh.routing.base import Policy, PolicyContext
from skymesh.routing.options import PolicyOptions
from skymesh.routing.policies.cache_aware import CacheAwareOptions, CacheAwarePolicy
from skymesh.routing.policies.consistent_hash import ConsistentHashOptions, ConsistentHashPolicy
from skymesh.routing.policies.dualmap import DualMapOptions, DualMapPolicy
from skymesh.routing.policies.least_load import LeastLoadOptions, LeastLoadPolicy
from skymesh.routing.policies.min_ttft import MinTTFTOptions, MinTTFTPolicy
from skymesh.routing.policies.preble import PrebleOptions, PreblePolicy
from skymesh.routing.policies.prefix_tree import PrefixTreeOptions, PrefixTreePolicy
from skymesh.routing.policies.round_robin import RoundRobinOptions, RoundRobinPolicy
from skymesh.validation import PathError, describe_error


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    factory: Callable[[PolicyContext], Policy]
    options: type[PolicyOptions]


POLICIES: dict[str, PolicySpec] = {
    "dualmap": PolicySpec(DualMapPolicy, DualMapOptions),
    "prefix_tree": PolicySpec(PrefixTreePolicy, PrefixTreeOptions),
    "consistent_hash": PolicySpec(ConsistentHashPolicy, ConsistentHashOptions),
    "round_robin": PolicySpec(RoundRobinPolicy, RoundRobinOptions),
    "least_load": PolicySpec(LeastLoadPolicy, LeastLoadOptions),
    "cache_aware": PolicySpec(CacheAwarePolicy, CacheAwareOptions),
    "min_ttft": PolicySpec(MinTTFTPolicy, MinTTFTOptions),
    "preble": PolicySpec(PreblePolicy, PrebleOptions),
}


class UnknownPolicyError(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")


class PolicyOptionsError(PathError):
    """A policy option is wrong; ``path`` is relative to the options (``"virtual_nodes"``)."""


def policy_spec(name: str) -> PolicySpec:
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(name) from None


def policy_options(name: str, raw: PolicyOptions | Mapping[str, Any]) -> PolicyOptions:
    """``raw`` validated by the options model of policy ``name``."""
    model = policy_spec(name).options
    try:
        return model.parse(raw)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        path, message = describe_error(error)
        if error["type"] == "extra_forbidden":
            message = f"unknown option for policy {name!r} (known: {', '.join(sorted(model.model_fields))})"
        raise PolicyOptionsError(path, message) from None


def make_policy(name: str, ctx: PolicyContext | None = None) -> Policy:
    """Policy ``name`` built from ``ctx``; its options (a validated model or a raw
    mapping) are validated against the policy's options model first."""
    spec = policy_spec(name)
    ctx = ctx or PolicyContext()
    return spec.factory(dataclasses.replace(ctx, options=policy_options(name, ctx.options)))
