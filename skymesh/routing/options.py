"""Policy options: ``policy.options`` in the config, ``--policy-option`` in ``skymesh sim``.

Each policy file declares its options model next to the policy class, extending
:class:`PolicyOptions` (the knobs the region core reads whatever the policy). Unknown
options are errors: a typo must never silently fall back to a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field


class PolicyOptions(BaseModel):
    """Options every policy has. Lax mode on purpose: ``--policy-option KEY=VALUE`` and
    quoted YAML values arrive as strings ("3", "true") and are coerced to the field type."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # selective pushing: requests the balancer may push to a replica between two probes
    # that said it had no waiting request
    dispatch_budget: int = Field(2, ge=1)

    @classmethod
    def parse(cls, raw: PolicyOptions | Mapping[str, Any]) -> Self:
        """``raw`` as this model: a raw mapping is validated (unknown keys are errors)."""
        if isinstance(raw, cls):
            return raw
        if isinstance(raw, PolicyOptions):
            # options validated for another policy (the balancer's ``--policy`` override):
            # the knobs this policy shares carry over, the other policy's own ones do not apply
            raw = {k: v for k, v in raw.model_dump(exclude_unset=True).items() if k in cls.model_fields}
        return cls.model_validate(raw)
