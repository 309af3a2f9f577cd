"""The pair rule registry, the only list of pair rules: a name → the rule class and its
options. A new rule is one file in ``pairing/`` plus one line here; the config's
``pairing.rule``, the region core and ``skymesh sim`` ask this registry. ``never`` is no
rule: every request runs whole where the policy puts it (a region without P/D)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from skymesh.routing.pairing.always import AlwaysOptions, AlwaysSplit
from skymesh.routing.pairing.base import PairContext, PairOptions, PairRule
from skymesh.routing.pairing.conductor import Conductor, ConductorOptions
from skymesh.routing.pairing.elastic import ElasticConductor, ElasticOptions
from skymesh.routing.pairing.threshold import ThresholdOptions, ThresholdSplit

# the names of PAIR_RULES, as a type (the config validates against it)
PairRuleName = Literal["never", "always", "threshold", "conductor", "elastic"]


@dataclasses.dataclass(frozen=True)
class PairRuleSpec:
    # builds the rule from its options; None: no rule, every request whole
    factory: Callable[[Any, PairContext], PairRule] | None
    options: type[PairOptions]


PAIR_RULES: dict[PairRuleName, PairRuleSpec] = {
    "never": PairRuleSpec(None, PairOptions),
    "always": PairRuleSpec(AlwaysSplit.build, AlwaysOptions),
    "threshold": PairRuleSpec(ThresholdSplit.build, ThresholdOptions),  # the peers' rule
    "conductor": PairRuleSpec(Conductor.build, ConductorOptions),  # Mooncake's Algorithm 1
    "elastic": PairRuleSpec(ElasticConductor.build, ElasticOptions),  # the conductor, roles following the load
}


class UnknownPairRuleError(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown pair rule {name!r} (known: {', '.join(PAIR_RULES)})")


def make_pair_rule(name: str, options: Mapping[str, Any], ctx: PairContext) -> PairRule | None:
    """Pair rule ``name`` with ``options`` (by field name; unknown ones are errors), built
    from ``ctx``; None for ``never``."""
    spec = PAIR_RULES.get(name)  # type: ignore[call-overload]
    if spec is None:
        raise UnknownPairRuleError(name)
    known = {f.name for f in dataclasses.fields(spec.options)}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} for pair rule {name!r} (known: {sorted(known)})")
    if spec.factory is None:
        return None
    return spec.factory(spec.options(**options), ctx)
