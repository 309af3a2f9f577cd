"""Which request to blame when a replica fails under it: the query-of-death rule.

Retries serve availability when a replica fails for its own reasons; a request that
*makes* its replica fail (a prompt that stalls the tokenizer, a body that crashes the
server) would be carried by the same retries from replica to replica, taking each one
down. So a failure of the kinds a request can cause is judged against the request the
replica held that could have caused it; that one request is answered (not placed again)
and the others keep their retries:

* :attr:`Harm.STALL` — the replica went silent: its probes timed out until it was
  ejected. Work stalls a server; the suspect is the request it had not started answering
  whose prompt is the largest by a clear margin (at least :data:`STALL_MARGIN` times the
  next one), or the only one. Requests of similar size (a replica that froze on its own,
  not a poisonous request) blame none. An attempt with no first byte in time is not a
  stall of the replica (it may be slow with that request alone, and its probes say
  whether it went silent): it keeps its retries.
* :attr:`Harm.DISCONNECT` — the connection dropped after the request was sent (the
  server died or reset it). Blamed only where it held this one request: a replica killed
  under ordinary load holds several, and every one of them is retried elsewhere.

A connection refused, an overload answer (429/503) or a 5xx status is never judged
against a request: the request did not get there, or the replica answered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

# the code of the 502 that answers a request judged to have made its replica fail
HARMFUL_REQUEST_CODE = "request_failed_replica"
# failures of one replica this close together (seconds) are one failure under several
# requests: their attempts end one after another, and the last one to be told must not
# look as if the replica had held it alone
SHARED_FAILURE_S = 1.0
# how much larger the largest unstarted prompt must be than the next for a stall to be
# judged its doing
STALL_MARGIN = 2.0


class Harm(StrEnum):
    STALL = "stall"
    DISCONNECT = "disconnect"


@dataclass(frozen=True, slots=True)
class HeldRequest:
    """A request a replica held (from this balancer) when it failed."""

    request_id: str
    prompt_tokens: int
    started: bool  # its first byte had reached the balancer


def suspect(held: Sequence[HeldRequest], harm: Harm, *, shared: bool = False) -> str | None:
    """The request the failure is judged against, or None (an ordinary failure);
    ``shared``: the replica failed under another request a moment ago (within
    :data:`SHARED_FAILURE_S`), which was not blamed."""
    if shared:
        return None
    if harm is Harm.DISCONNECT:
        return held[0].request_id if len(held) == 1 else None
    unstarted = sorted((h for h in held if not h.started), key=lambda h: h.prompt_tokens, reverse=True)
    if not unstarted:
        return None
    if len(unstarted) == 1 or unstarted[0].prompt_tokens >= STALL_MARGIN * max(1, unstarted[1].prompt_tokens):
        return unstarted[0].request_id
    return None
