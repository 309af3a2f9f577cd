"""Service-level classes: the TTFT / TPOT / end-to-end targets a request is judged by and
its queue priority. A class name travels in X-SLO-Class and becomes a metrics label."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, model_validator

from skymesh.config.base import ConfigError, ConfigModel, Float, Int, Text, matching

# an SLO class name travels in a header and becomes a metrics label: short and plain
SLO_CLASS_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


SloClassName = Annotated[
    Text,
    AfterValidator(matching(SLO_CLASS_RE, "a lowercase name like chat or code-completion (at most 32 characters)")),
    Field(json_schema_extra={"pattern": SLO_CLASS_RE.pattern}),
]


class SloClassConfig(ConfigModel):
    """One service-level class: the targets its requests are judged by, and its priority.
    Any of the three targets; a class names at least one."""

    # time to first token
    ttft_s: Annotated[Float, Field(gt=0, le=3600)] | None = None
    # time per output token after the first
    tpot_s: Annotated[Float, Field(gt=0, le=60)] | None = None
    # arrival to the last byte of the answer
    e2e_s: Annotated[Float, Field(gt=0, le=86_400)] | None = None
    # higher first: a queued request of a higher priority is placed before any of a lower
    priority: Annotated[Int, Field(ge=-1000, le=1000)] = 0

    @model_validator(mode="after")
    def _some_target(self) -> SloClassConfig:
        if self.ttft_s is None and self.tpot_s is None and self.e2e_s is None:
            raise ConfigError("ttft_s", "an SLO class needs at least one target (ttft_s, tpot_s or e2e_s)")
        return self
