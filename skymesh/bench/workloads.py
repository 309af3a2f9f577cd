"""Synthetic workloads in the trace format (512-token blocks of hash ids).

- :func:`hot_prefix_workload`: tool/agent traffic, a few very popular system prompts.
- :func:`tree_of_thoughts`: Tree-of-Thoughts trees (every node extends its parent).
- :func:`synthetic_conversations`: a lazy, arbitrarily long multi-region stream of
  multi-turn conversations for the large-scale discrete-event run (1M requests).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from skymesh.bench.traces import TraceRequest, diurnal_factor, region_weights
from skymesh.word_tokenizer import TRACE_BLOCK_TOKENS

if TYPE_CHECKING:
    from skymesh.bench.day_shape import DayShape

HOT_BASE = 1_000_000
UNIQUE_BASE = 10_000_000
TOT_BASE = 50_000_000
CONV_BASE = 100_000_000
# a region's own system prompts: region k's prompt j starts at
# PROMPT_BASE + (k + 1) * PROMPT_STRIDE + j * PROMPT_BLOCKS_MAX; the prompts shared across
# regions live at PROMPT_BASE (k = -1)
PROMPT_BASE = 90_000_000
PROMPT_STRIDE = 100_000
PROMPT_BLOCKS_MAX = 1_000


@dataclass(frozen=True)
class ConversationMix:
    """How :func:`synthetic_conversations` builds its conversations (the defaults: the
    stream as it always was).

    - ``turns_mean``: turns per conversation on average (exponential, at least 1);
    - ``max_turns``: no conversation has more turns (None: no cap);
    - ``region_system_prompts``: 0: every conversation opens with one of the stream's
      ``n_system_prompts`` one-block prompts, whatever its region; N > 0: with one of its
      region's own N prompts, each ``system_prompt_blocks`` long (drawn once per prompt);
    - ``shared_prefix_share``: with region prompts, the share of conversations that open
      instead with one of ``n_system_prompts`` prompts shared by every region (as long).
    """

    turns_mean: float = 3.0
    max_turns: int | None = None
    region_system_prompts: int = 0
    system_prompt_blocks: tuple[int, int] = (1, 1)
    shared_prefix_share: float = 0.0

    def __post_init__(self) -> None:
        lo, hi = self.system_prompt_blocks
        if self.turns_mean < 1.0:
            raise ValueError("turns_mean: at least 1")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError("max_turns: at least 1 (None: no cap)")
        if self.region_system_prompts < 0:
            raise ValueError("region_system_prompts: 0 (off) or more")
        if not 1 <= lo <= hi < PROMPT_BLOCKS_MAX:
            raise ValueError(f"system_prompt_blocks: 1 <= low <= high < {PROMPT_BLOCKS_MAX}")
        if not 0.0 <= self.shared_prefix_share <= 1.0:
            raise ValueError("shared_prefix_share: in [0, 1]")
        if self.shared_prefix_share > 0 and not self.region_system_prompts:
            raise ValueError("shared_prefix_share: needs region_system_prompts (without them every "
                             "prompt is shared across regions already)")

    def prompts(self, n_regions: int, n_shared: int, seed: int) -> tuple[list[list[tuple[int, ...]]],
                                                                          list[tuple[int, ...]]]:
        """Each region's own prompts and the shared ones, as block-id tuples (lengths drawn
        from a stream of their own, so the conversations' draws do not move)."""
        rng = random.Random(f"prompts:{seed}")
        lo, hi = self.system_prompt_blocks

        def prompt(k: int, j: int) -> tuple[int, ...]:
            start = PROMPT_BASE + (k + 1) * PROMPT_STRIDE + j * PROMPT_BLOCKS_MAX
            return tuple(range(start, start + rng.randint(lo, hi)))

        own = [[prompt(k, j) for j in range(self.region_system_prompts)] for k in range(n_regions)]
        return own, [prompt(-1, j) for j in range(n_shared)]


def hot_prefix_workload(n: int, rate_per_s: float, n_prompts: int = 4, prompt_blocks: int = 4,
                        hot_share: float = 0.8, user_blocks: int = 2, output_len: int = 128,
                        zipf_s: float = 1.0, seed: int = 0) -> list[TraceRequest]:
    """``n`` Poisson arrivals at ``rate_per_s``: ``hot_share`` of them start with one of
    ``n_prompts`` popular system prompts (Zipf(``zipf_s``) popularity) of ``prompt_blocks``
    blocks; the rest have their own unique prompt; every request adds ``user_blocks`` of its
    own. Sessions: one per request (tool calls are independent)."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** zipf_s for i in range(n_prompts)]
    t = 0.0
    out = []
    next_id = UNIQUE_BASE
    for i in range(n):
        t += rng.expovariate(rate_per_s)
        if rng.random() < hot_share:
            p = rng.choices(range(n_prompts), weights)[0]
            sys_ids = tuple(HOT_BASE + p * 1000 + b for b in range(prompt_blocks))
        else:
            sys_ids = tuple(range(next_id, next_id + prompt_blocks))
            next_id += prompt_blocks
        user = tuple(range(next_id, next_id + user_blocks))
        next_id += user_blocks
        ids = sys_ids + user
        out.append(TraceRequest(t, len(ids) * TRACE_BLOCK_TOKENS, output_len, ids, session=i))
    return out


def tree_of_thoughts(n_trees: int, branching: int, depth: int, rate_per_s: float, root_blocks: int = 4,
                     step_blocks: int = 1, output_len: int = 64, level_gap_s: float = 2.0,
                     seed: int = 0) -> list[TraceRequest]:
    """Tree-of-Thoughts: trees start as Poisson arrivals; a level's ``branching**level``
    nodes all arrive together ``level_gap_s`` after the previous level (it waits for the
    parents' answers). Each node's prompt = its parent's prompt + ``step_blocks``; all nodes
    of a tree share the root prefix, siblings their parent's. One session per tree."""
    if branching < 1 or depth < 1:
        raise ValueError("branching and depth must be >= 1")
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    next_id = TOT_BASE
    t = 0.0
    for tree in range(n_trees):
        t += rng.expovariate(rate_per_s)
        root = tuple(range(next_id, next_id + root_blocks))
        next_id += root_blocks
        frontier = [root]
        level_t = t
        for _level in range(depth):
            nxt = []
            for node in frontier:
                for _b in range(branching):
                    ids = node + tuple(range(next_id, next_id + step_blocks))
                    next_id += step_blocks
                    out.append(TraceRequest(level_t, len(ids) * TRACE_BLOCK_TOKENS, output_len, ids,
                                            session=tree))
                    nxt.append(ids)
            frontier = nxt
            level_t += level_gap_s
    out.sort(key=lambda r: r.arrival_s)
    return out


def synthetic_conversations(n: int, regions: Sequence[str], rate_per_s: float, skew: float = 0.0,
                            diurnal_period_s: float = 0.0, amplitude: float = 0.8, turns_mean: float = 3.0,
                            think_s: float = 20.0, first_blocks: tuple[int, int] = (2, 6),
                            turn_blocks: tuple[int, int] = (1, 2), output_len: tuple[int, int] = (64, 256),
                            n_system_prompts: int = 8, seed: int = 0,
                            shape: DayShape | None = None, mix: ConversationMix | None = None
                            ) -> Iterator[TraceRequest]:
    """A lazy stream of ``n`` requests in arrival order: conversations start as a Poisson
    process of total rate ``rate_per_s / turns_mean`` (requests then average ``rate_per_s``),
    each in a region drawn with :func:`region_weights` (thinned by that region's diurnal curve
    when ``diurnal_period_s`` > 0) and with one of ``n_system_prompts`` shared system
    prompts (1 block); a turn's prompt = the previous prompt + its answer + the new user
    message (``turn_blocks``), so turns form a prefix chain; turns are ``think_s`` apart
    on average (exponential). ``mix`` (:class:`ConversationMix`) caps the turns, gives each
    region system prompts of its own and a share of conversations a prefix shared across
    regions (it overrides ``turns_mean``). Memory is O(open conversations), not O(n)."""
    rng = random.Random(seed)
    if mix is not None:
        turns_mean = mix.turns_mean
        max_turns = mix.max_turns
        own_prompts, shared_prompts = mix.prompts(len(regions), n_system_prompts, seed)
    else:
        max_turns, own_prompts, shared_prompts = None, [], []
    # the day's shape (skymesh/bench/day_shape.py), or skew / period / amplitude alone
    if shape is not None:
        weights, diurnal_period_s = list(shape.weights), shape.period_s
        phases, amplitudes = list(shape.phases), list(shape.amplitudes)
    else:
        weights = region_weights(len(regions), skew)
        phases = [k / len(regions) for k in range(len(regions))]
        amplitudes = [amplitude] * len(regions)
    next_id = CONV_BASE
    session = 0
    t_conv = 0.0
    conv_rate = rate_per_s / turns_mean
    pending: list[tuple[float, int, str, tuple[int, ...], int]] = []  # (t, session, region, ids, turns_left)
    emitted = 0
    while emitted < n:
        # open conversations until the next start is later than the earliest pending turn
        while not pending or t_conv <= pending[0][0]:
            t_conv += rng.expovariate(conv_rate)
            k = rng.choices(range(len(regions)), weights)[0]
            if diurnal_period_s > 0 and rng.random() >= diurnal_factor(t_conv, diurnal_period_s, phases[k],
                                                                          amplitudes[k]):
                continue
            nb = rng.randint(*first_blocks)
            if mix is not None and mix.region_system_prompts:
                shared = mix.shared_prefix_share > 0 and rng.random() < mix.shared_prefix_share
                pool = shared_prompts if shared else own_prompts[k]
                system: tuple[int, ...] = pool[rng.randrange(len(pool))]
            else:
                system = (rng.randrange(n_system_prompts),)
            ids = system + tuple(range(next_id, next_id + nb - 1))
            next_id += nb - 1
            turns = max(1, round(rng.expovariate(1.0 / turns_mean)))
            if max_turns is not None:
                turns = min(turns, max_turns)
            heapq.heappush(pending, (t_conv, session, regions[k], ids, turns))
            session += 1
        t, s, region, ids, turns = heapq.heappop(pending)
        out_len = rng.randint(*output_len)
        yield TraceRequest(t, len(ids) * TRACE_BLOCK_TOKENS, out_len, ids, region=region, session=s)
        emitted += 1
        if turns > 1:
            nb = rng.randint(*turn_blocks) + max(1, out_len // TRACE_BLOCK_TOKENS)
            nxt = ids + tuple(range(next_id, next_id + nb))
            next_id += nb
            heapq.heappush(pending, (t + rng.expovariate(1.0 / think_s), s, region, nxt, turns - 1))
