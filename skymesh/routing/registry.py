"""The policy registry: a name → a factory taking a PolicyContext. A new policy is one
file in ``policies/`` plus one line here."""

from __future__ import annotations

from collections.abc import Callable

from skymesh.routing.base import Policy, PolicyContext
from skymesh.routing.policies.cache_aware import CacheAwarePolicy
from skymesh.routing.policies.consistent_hash import ConsistentHashPolicy
from skymesh.routing.policies.dualmap import DualMapPolicy
from skymesh.routing.policies.least_load import LeastLoadPolicy
from skymesh.routing.policies.min_ttft import MinTTFTPolicy
from skymesh.routing.policies.preble import PreblePolicy
from skymesh.routing.policies.prefix_tree import PrefixTreePolicy
from skymesh.routing.policies.round_robin import RoundRobinPolicy

POLICIES: dict[str, Callable[[PolicyContext], Policy]] = {
    "dualmap": DualMapPolicy,
    "prefix_tree": PrefixTreePolicy,
    "consistent_hash": ConsistentHashPolicy,
    "round_robin": RoundRobinPolicy,
    "least_load": LeastLoadPolicy,
    "cache_aware": CacheAwarePolicy,
    "min_ttft": MinTTFTPolicy,
    "preble": PreblePolicy,
}


def make_policy(name: str, ctx: PolicyContext | None = None) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})") from None
    return factory(ctx or PolicyContext())
