"""How a balancer routes: the policy and its options, offloading to peer regions, the
queue discipline, replica health, upstream timeouts and the tokenizer prompts are hashed
with. Defaults of the queue disciplines come from their modules in skymesh/routing/."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, SerializeAsAny, ValidationInfo, field_validator, model_validator

from skymesh.config.base import Bool, ConfigError, ConfigModel, FilePath, Float, Int, Text
from skymesh.routing.disciplines.base import DEFAULT_MAX_AGE_S
from skymesh.routing.disciplines.prefix_match import DEFAULT_PREFIX_TTFT_SHARE
from skymesh.routing.disciplines.slo_deadline import DEFAULT_ITERATIONS, DEFAULT_WINDOW
from skymesh.routing.options import PolicyOptions
from skymesh.routing.queue_registry import DisciplineName
from skymesh.routing.registry import POLICIES, policy_options
from skymesh.validation import kind


class OffloadRule(ConfigModel):
    source: Text = Field(alias="from", description="glob over region names, e.g. eu-*")
    allowed_targets: tuple[Text, ...] = Field(alias="to", description="globs")

    def matches_source(self, region: str) -> bool:
        return fnmatch.fnmatchcase(region, self.source)

    def allows(self, target: str) -> bool:
        return any(fnmatch.fnmatchcase(target, g) for g in self.allowed_targets)


class OffloadConfig(ConfigModel):
    enabled: Bool = True
    # tau: a remote region with more requests queued at its balancer is not a target.
    max_remote_queue: Annotated[Int, Field(ge=0)] = 4
    heartbeat_interval_s: Annotated[Float, Field(ge=0.01, le=60)] = 0.1
    # a peer missing this many heartbeat intervals is unavailable
    heartbeat_miss_limit: Annotated[Int, Field(ge=1, le=100)] = 3
    # when to forward a queued request: "predicted_ttft" when a peer is expected to answer
    # it sooner (link RTT + its queue + uncached prefill vs the wait here), "saturated"
    # only when no local replica is available (SkyWalker's rule); see routing/offload.py
    trigger: Literal["predicted_ttft", "saturated"] = "predicted_ttft"
    # predicted_ttft: how much sooner a peer must be expected to answer before we forward
    min_gain_s: Annotated[Float, Field(ge=0, le=60)] = 0.0
    rules: tuple[OffloadRule, ...] = ()

    def allowed(self, source: str, target: str) -> bool:
        """First rule whose source glob matches decides; no matching rule allows all."""
        for rule in self.rules:
            if rule.matches_source(source):
                return rule.allows(target)
        return True


class PolicyConfig(ConfigModel):
    name: str = Field(default="dualmap", json_schema_extra={"enum": list(POLICIES)})
    ttft_slo_s: Annotated[Float, Field(ge=0.001)] = 2.0
    probe_interval_s: Annotated[Float, Field(ge=0.005, le=60)] = 0.1
    queue_bound: Annotated[Int, Field(ge=1)] = 1024
    # prompt chunking for prefix hashing, in tokens of the documented tokenizer contract
    chunk_tokens: Annotated[Int, Field(ge=1, le=1 << 20)] = 64
    # bound on prefix-trie nodes per balancer (memory stays bounded)
    trie_max_nodes: Annotated[Int, Field(ge=16)] = 200_000
    max_body_bytes: Annotated[Int, Field(ge=1024)] = 4 * 1024 * 1024
    # the one retry budget: a request is placed at most max_retries + 1 times, replicas and
    # peer regions alike (RegionSettings.max_retries, docs/routing.md "One retry budget")
    max_retries: Annotated[Int, Field(ge=0, le=16)] = 2
    # the named policy's knobs, validated by its options model in the policy registry
    # SerializeAsAny: dumped as the policy's own options model, not the shared base
    options: SerializeAsAny[PolicyOptions] = Field(
        default_factory=dict,
        validate_default=True,
        description="options of the named policy (see skymesh/routing/policies/)",
    )

    @field_validator("name", mode="before")
    @classmethod
    def _registered(cls, name: Any) -> Any:
        if isinstance(name, str) and name not in POLICIES:
            raise ConfigError("", f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
        return name

    @field_validator("options", mode="plain", json_schema_input_type=dict[str, Any])
    @classmethod
    def _typed_options(cls, raw: Any, info: ValidationInfo) -> PolicyOptions:
        name = info.data.get("name")
        if name is None:  # the name is wrong; that error is the one reported
            return PolicyOptions()
        if not isinstance(raw, (Mapping, PolicyOptions)):
            raise ConfigError("", f"expected a mapping, got {kind(raw)}")
        # a PolicyOptionsError carries the option's path; it is prefixed with policy.options
        return policy_options(name, raw)


class QueueConfig(ConfigModel):
    """The order of the balancer's queue within a priority (skymesh/routing/queue_registry.py
    names the disciplines; each reads its options of these keys)."""

    # "fcfs": arrival order; "slo": each head window ordered for SLO attainment; "prefix"
    # (FEATHER): a replica that frees up gets the queued request it holds the most of first
    discipline: DisciplineName = "fcfs"
    # slo: how many requests at the head of each priority are ordered
    window: Annotated[Int, Field(ge=2, le=64)] = DEFAULT_WINDOW
    # slo: the search's budget per decision, in schedule evaluations (annealing, then as many
    # again at most for the polish; see skymesh/routing/disciplines/slo_deadline.py)
    iterations: Annotated[Int, Field(ge=0, le=100_000)] = DEFAULT_ITERATIONS
    # slo and prefix: the starvation bound: a request queued this long goes first, in arrival order
    max_age_s: Annotated[Float, Field(gt=0, le=3600)] = DEFAULT_MAX_AGE_S
    # prefix: a request that has waited this share of its TTFT target (its class's, else
    # policy.ttft_slo_s) also goes first, in arrival order: ordering by cache match alone
    # lowers the median TTFT but lets the unmatched requests' tail run past their targets
    prefix_ttft_share: Annotated[Float, Field(gt=0, le=1)] = DEFAULT_PREFIX_TTFT_SHARE


class HealthConfig(ConfigModel):
    """Replica health with hysteresis (Envoy's thresholds): failed probes and connection
    failures both count; one bad probe only pauses dispatch until the next good one."""

    unhealthy_threshold: Annotated[Int, Field(ge=1, le=100)] = 3
    healthy_threshold: Annotated[Int, Field(ge=1, le=100)] = 2


class UpstreamConfig(ConfigModel):
    """Timeouts of one attempt on a replica or a peer balancer."""

    connect_timeout_s: Annotated[Float, Field(gt=0, le=60)] = 2.0
    # streaming: until the first chunk; non-streaming: plus per_output_token_s * max_tokens
    first_byte_timeout_s: Annotated[Float, Field(gt=0, le=3600)] = 60.0
    # upper bound of the replicas' decode time per token (None: from the stand-in
    # profile when the replicas name one, else 0.2 s)
    per_output_token_s: Annotated[Float, Field(gt=0, le=60)] | None = None
    # once streaming, the longest silence between two chunks
    stream_idle_timeout_s: Annotated[Float, Field(gt=0, le=3600)] = 60.0
    # a split request's legs (pairing:) are bounded by what they are expected to take, not
    # only by first_byte_timeout_s: the prefill leg by this multiple of its predicted TTFT
    # or its class's TTFT target, whichever is longer; the decode leg's first token by this
    # multiple of the KV move's estimate; neither below leg_deadline_floor_s nor above
    # first_byte_timeout_s. A leg cut so is retried (a decode leg on another decode replica,
    # which reads the KV still held under its lease)
    leg_deadline_multiple: Annotated[Float, Field(ge=1, le=100)] = 4.0
    leg_deadline_floor_s: Annotated[Float, Field(gt=0, le=3600)] = 10.0
    # a request still queued at the balancer this long after arrival gets 504
    # (None: max(60 s, 30 x policy.ttft_slo_s))
    max_queue_wait_s: Annotated[Float, Field(gt=0, le=3600)] | None = None
    # output tokens assumed for a chat request without max_tokens / max_completion_tokens:
    # vLLM then generates up to the end of the context (max_model_len - prompt), which the
    # balancer does not know; this bounds its non-streaming deadline and load estimate
    unbounded_chat_max_tokens: Annotated[Int, Field(ge=1, le=1 << 20)] = 8192
    # the model's context (tokens): a request that cannot fit it is answered with vLLM's own
    # 400 at the edge, never forwarded (skymesh/context_window.py); None: the largest
    # max_model_len the region's replicas report in /v1/models (no check until one has)
    max_model_len: Annotated[Int, Field(ge=1, le=1 << 24)] | None = None


class TokenizerConfig(ConfigModel):
    """How the balancer counts and hashes prompts (skymesh/prompt_encoder.py). Local files
    only, read when the balancer starts; never fetched."""

    # the model's HF tokenizer.json (pkg:skymesh/assets/tokenizer/tokenizer.json: the
    # stand-ins' shipped one); without it, prompts are hashed as UTF-8 bytes
    path: FilePath | None = None
    # the model's chat template (jinja2) for chat requests; needs ``path``
    chat_template: FilePath | None = None
    # the fallback's estimate of UTF-8 bytes per token (and chunk size in bytes per token)
    bytes_per_token: Annotated[Float, Field(gt=0, le=16)] = 4.0
    # the model's longest vocabulary entry in characters (vLLM's max_chars_per_token): a text
    # prompt longer than max_model_len times this is refused untokenized, as vLLM refuses it
    # (None: read off tokenizer.path; without one, no such check at the balancer)
    max_chars_per_token: Annotated[Int, Field(ge=1, le=4096)] | None = None
    # a prompt's token count (and chat template) runs in a worker thread; one not counted
    # this long after it was handed over (a queue of long prompts ahead) gets 503
    count_timeout_s: Annotated[Float, Field(gt=0, le=600)] = 10.0

    @model_validator(mode="after")
    def _template_needs_tokenizer(self) -> TokenizerConfig:
        if self.chat_template is not None and self.path is None:
            raise ConfigError("chat_template", "a chat template needs the tokenizer (tokenizer.path) too")
        return self
