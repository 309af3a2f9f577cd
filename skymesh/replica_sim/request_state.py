"""One engine request's scheduling state: where it is (waiting, running, done), how much
of it has KV in the cache, which blocks it holds. Its own module so the scheduler and the
block pool share the type without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

WAITING, RUNNING, DONE = 0, 1, 2


# eq=False: requests are compared by identity; a generated field-by-field __eq__ would make
# every deque/list lookup cost a tuple build per element
@dataclass(slots=True, eq=False)
class EngineRequest:
    request_id: str
    prompt_len: int
    block_hashes: list[int]
    max_tokens: int
    arrival: float
    state: int = WAITING
    admitted_seq: int = -1
    num_computed: int = 0  # tokens whose KV is in the cache (prompt + regenerated output)
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    blocks: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    preemptions: int = 0
    first_scheduled_at: float | None = None  # step start of its first admission
    # tokens to compute before the next token can be sampled, set at admission: the
    # prompt, plus the output generated so far when a preempted request is recomputed
    target_tokens: int = 0
    # the token ids behind block_hashes (prompt, then output), for KV events only
    token_ids: list[int] | None = None
    # a split request's decode leg: prompt tokens whose KV another replica computed and
    # moved here (counted computed at its first admission; recomputed after a preemption)
    external_tokens: int = 0
    # a split request's prefill leg: its blocks stay held when it finishes, until the
    # decode side has read them (``Scheduler.release_held``), as vLLM's producer does
    hold_blocks: bool = False

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_len
