"""No request of death, in units: the context window refuses what cannot fit the model
with vLLM 0.32's own 400 (the stand-in's refusal, word for word), a prompt whose bytes
prove it too long is never tokenized, counting off the loop has a time bound, and a
replica failure a request can cause is judged against that request alone."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from tokenizers import Tokenizer

from skymesh.assets import SIM_TOKENIZER
from skymesh.balancer.openai_request import parse_body
from skymesh.balancer.prompt_count import PromptCounter, encode_request, precheck
from skymesh.context_window import ContextRefusal, ContextWindow, max_chars_per_token
from skymesh.edge.openai_errors import RequestError
from skymesh.prompt_encoder import PromptEncoder
from skymesh.replica_sim.request_parsing import ApiError, RequestParser
from skymesh.replica_sim.tokenization import StandInTokenizer
from skymesh.routing.harm import HARMFUL_REQUEST_CODE, STALL_MARGIN, Harm, HeldRequest, suspect
from skymesh.routing.health import HealthSettings
from skymesh.routing.region_actions import AbandonAttempt, Reject
from skymesh.routing.request_state import RequestState
from tests.test_region_core import OK, probe_all, region, req, sends

MAX_LEN = 4096
TOKENIZER = SIM_TOKENIZER


class CountingTokenizer:
    """The shipped tokenizer, counting how often it is asked to encode."""

    def __init__(self) -> None:
        self.inner = Tokenizer.from_file(str(TOKENIZER))
        self.calls = 0

    def encode_batch(self, texts: list[str], **kw: Any) -> Any:
        self.calls += 1
        return self.inner.encode_batch(texts, **kw)


def encoder(tok: Any = None) -> PromptEncoder:
    return PromptEncoder(64, tok if tok is not None else Tokenizer.from_file(str(TOKENIZER)))


def window() -> ContextWindow:
    return ContextWindow(MAX_LEN, max_chars_per_token(Tokenizer.from_file(str(TOKENIZER))))


def standin_refusal(body: dict[str, Any], chat: bool = False) -> tuple[str, str | None]:
    parser = RequestParser("skymesh-sim", MAX_LEN, StandInTokenizer(TOKENIZER))
    with pytest.raises(ApiError) as e:
        parser.parse(body, chat)
    assert e.value.status == 400
    return e.value.message, e.value.param


def balancer_refusal(body: dict[str, Any], chat: bool = False, enc: PromptEncoder | None = None) -> ContextRefusal:
    import json

    parsed = parse_body(json.dumps(body).encode(), "chat" if chat else "completions", "skymesh-sim")
    with pytest.raises(ContextRefusal) as e:
        precheck(parsed, window())
        encode_request(enc or encoder(), parsed, window())
    return e.value


@pytest.mark.parametrize("body", [
    {"prompt": "w " * 5000},                          # counted: over the context
    {"prompt": "w " * 2_000_000},                     # 4 MB: refused by its characters
    {"prompt": [7] * (MAX_LEN + 3)},                  # token ids: their own count
    {"prompt": [7] * MAX_LEN},                        # fills the context: no room for output
    {"prompt": "hello", "max_tokens": MAX_LEN + 1},   # the budget alone
    {"prompt": ["short", "w " * 5000]},               # a batch: the long one
])
def test_the_balancer_refuses_with_the_standins_own_message(body: dict[str, Any]) -> None:
    body = {"model": "skymesh-sim", **body}
    refusal = balancer_refusal(body)
    assert (refusal.message, refusal.param) == standin_refusal(body)
    assert refusal.status == 400


def test_a_chat_of_fifty_thousand_messages_is_refused_by_its_characters_untokenized() -> None:
    body = {"model": "skymesh-sim", "messages": [{"role": "user", "content": "hi"}] * 50_000}
    refusal = balancer_refusal(body, chat=True, enc=encoder(CountingTokenizer()))
    assert refusal.proved_by == "chars" and refusal.param == "input_text"
    # the stand-in refuses it by the same check; its text is the rendered chat (with the
    # generation prompt), which the balancer, without that template, does not render: the
    # count in the two messages differs by that suffix alone
    message, param = standin_refusal(body, chat=True)
    assert param == "input_text"
    assert message.split(" characters")[1] == refusal.message.split(" characters")[1]


def test_a_prompt_its_characters_prove_too_long_is_never_tokenized() -> None:
    tok = CountingTokenizer()
    import json

    limit = window().max_prompt_chars
    assert limit is not None
    raw = json.dumps({"model": "skymesh-sim", "prompt": "w" * (limit + 1)}).encode()
    with pytest.raises(ContextRefusal) as e:
        precheck(parse_body(raw, "completions", "skymesh-sim"), window())
    assert e.value.proved_by == "chars" and e.value.param == "input_text"
    assert tok.calls == 0
    # at the bound, the characters prove nothing: it is counted, and its count refuses it
    parsed = parse_body(json.dumps({"model": "skymesh-sim", "prompt": "w " * (limit // 2)}).encode(), "completions",
                        "skymesh-sim")
    precheck(parsed, window())
    with pytest.raises(ContextRefusal) as e:
        encode_request(encoder(tok), parsed, window())
    assert e.value.proved_by == "tokens"
    assert tok.calls == 1


def test_what_fits_is_not_refused_and_a_clamped_budget_is_vllms_not_a_refusal() -> None:
    import json

    # prompt + max_tokens over the context: vLLM clamps the budget, it does not refuse
    body = {"model": "skymesh-sim", "prompt": "w " * 100, "max_tokens": MAX_LEN}
    parsed = parse_body(json.dumps(body).encode(), "completions", "skymesh-sim")
    precheck(parsed, window())
    assert encode_request(encoder(), parsed, window()).tokens > 100


def test_a_chat_without_its_template_is_only_estimated_so_only_its_bytes_refuse_it() -> None:
    import json

    # ~6000 tokens flattened, under the character bound: over the context by skymesh's
    # flattening, which is not the replica's template; the replica judges it
    body = {"model": "skymesh-sim", "messages": [{"role": "user", "content": "w " * 6000}]}
    parsed = parse_body(json.dumps(body).encode(), "chat", "skymesh-sim")
    precheck(parsed, window())
    assert encode_request(encoder(), parsed, window()).tokens > MAX_LEN


def test_the_character_bound_is_vllms_longest_vocabulary_entry() -> None:
    tok = Tokenizer.from_file(str(TOKENIZER))
    vocab = tok.get_vocab(with_added_tokens=True)
    assert max_chars_per_token(tok) == max(len(piece) for piece in vocab)
    # sound for this (byte-level) tokenizer: no piece decodes to more characters
    assert max(len(tok.decode([i])) for i in range(tok.get_vocab_size())) <= max_chars_per_token(tok)


async def test_a_count_not_done_in_time_is_a_503_and_the_loop_is_never_held() -> None:
    release = threading.Event()

    class Stuck:
        def encode_batch(self, texts: list[str], **kw: Any) -> Any:
            release.wait()
            return Tokenizer.from_file(str(TOKENIZER)).encode_batch(texts, **kw)

    counter = PromptCounter(encoder(Stuck()), lambda: None, lambda: 0.2)
    import json

    parsed = parse_body(json.dumps({"model": "skymesh-sim", "prompt": "w " * 5000}).encode(), "completions",
                        "skymesh-sim")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    t = asyncio.create_task(ticker())
    try:
        with pytest.raises(RequestError) as e:
            await counter.count(parsed)
        assert e.value.status == 503
        assert ticks > 1  # the loop ran while the worker was stuck
    finally:
        t.cancel()
        release.set()
        counter.close()


# ------------------------------------------------------------------ the harm rule


def held(rid: str, tokens: int, started: bool = False) -> HeldRequest:
    return HeldRequest(rid, tokens, started)


def test_a_stall_blames_the_only_or_the_clearly_largest_unstarted_request() -> None:
    assert suspect([held("a", 100)], Harm.STALL) == "a"
    assert suspect([held("a", 100), held("big", int(100 * STALL_MARGIN))], Harm.STALL) == "big"
    assert suspect([held("a", 100), held("b", 150)], Harm.STALL) is None  # similar: no blame
    assert suspect([held("s", 10_000, started=True), held("a", 100)], Harm.STALL) == "a"
    assert suspect([held("s", 100, started=True)], Harm.STALL) is None


def test_a_disconnect_blames_only_a_request_held_alone() -> None:
    assert suspect([held("a", 100)], Harm.DISCONNECT) == "a"
    assert suspect([held("a", 100), held("big", 100_000)], Harm.DISCONNECT) is None


def test_a_disconnect_under_one_request_answers_it_instead_of_placing_it_again() -> None:
    core = region(n=3, policy="round_robin")
    probe_all(core)
    core.submit(req(0), 0.0)
    (target,) = sends(core.tick(0.0)).values()
    actions = core.fail("q0", 1.0, reason="ServerDisconnectedError", harm=Harm.DISCONNECT)
    (rej,) = actions
    assert isinstance(rej, Reject) and rej.status == 502 and rej.code == HARMFUL_REQUEST_CODE
    assert target in rej.message
    assert core.view.state_of("q0") is None and core.view.active_requests == 0
    assert sends(core.tick(1.0)) == {}  # placed nowhere else


def test_a_disconnect_under_ordinary_load_retries_every_request() -> None:
    core = region(n=1, policy="round_robin", max_retries=2)
    probe_all(core)
    for i in range(2):
        core.submit(req(i), 0.0)
    assert len(sends(core.tick(0.0))) == 2
    for i in range(2):
        assert core.fail(f"q{i}", 1.0, reason="ServerDisconnectedError", harm=Harm.DISCONNECT) == []
        assert core.view.state_of(f"q{i}") is RequestState.QUEUED


def test_a_disconnect_told_after_the_replica_failed_under_another_request_blames_none() -> None:
    """A killed replica's connections end one after another: a stream it had started
    (or a refused attempt) told first leaves the unstarted request looking alone. The
    replica failed under the other one a moment before, so this one is retried."""
    for first_failure in ("midstream", "refused"):
        core = region(n=2, policy="round_robin", max_retries=2, health=HealthSettings(unhealthy_threshold=10))
        probe_all(core)
        for i in range(3):
            core.submit(req(i), 0.0)
        placed = sends(core.tick(0.0))
        assert placed["q0"] == placed["q2"] != placed["q1"]
        if first_failure == "midstream":
            core.first_token("q0", 0.5)
            assert core.fail("q0", 1.0, reason="ServerDisconnectedError") == []
        else:
            core.fail("q0", 1.0, reason="ClientConnectorError")
        actions = core.fail("q2", 1.2, reason="ServerDisconnectedError", harm=Harm.DISCONNECT)
        assert not any(isinstance(a, Reject) for a in actions), (first_failure, actions)
        assert core.view.state_of("q2") is RequestState.QUEUED, first_failure
        # the other replica has no such failure: q2's disconnect there, held alone, is judged
        assert sends(core.tick(5.0)) == {"q2": placed["q1"]}
        core.complete("q1", 5.5)
        (rej,) = [a for a in core.fail("q2", 9.0, reason="ServerDisconnectedError", harm=Harm.DISCONNECT)
                  if isinstance(a, Reject)]
        assert rej.code == HARMFUL_REQUEST_CODE


def test_a_replica_that_stalls_under_a_huge_prompt_is_blamed_on_it_and_comes_back_on_one_probe() -> None:
    core = region(n=2, policy="round_robin", health=HealthSettings(unhealthy_threshold=2, healthy_threshold=3))
    probe_all(core)
    core.submit(req(0, tokens=4000), 0.0)  # the poison
    placed = sends(core.tick(0.0))
    stalled = placed["q0"]
    core.submit(req(1, tokens=64), 0.01)  # an ordinary request lands there too
    core.tick(0.01)
    core.submit(req(2, tokens=64), 0.02)
    placed.update(sends(core.tick(0.02)))
    ordinary_there = [rid for rid, r in placed.items() if r == stalled and rid != "q0"]
    assert ordinary_there  # round robin put one ordinary request on the stalled replica
    assert core.probe(stalled, None, 0.1, stalled=True) == []
    actions = core.probe(stalled, None, 0.2, stalled=True)  # ejected
    rejects = [a for a in actions if isinstance(a, Reject)]
    assert [(r.request_id, r.code) for r in rejects] == [("q0", HARMFUL_REQUEST_CODE)]
    abandoned = {a.request_id for a in actions if isinstance(a, AbandonAttempt)}
    assert abandoned == {"q0", *ordinary_there}
    for rid in ordinary_there:
        assert core.view.state_of(rid) is RequestState.QUEUED  # retried elsewhere
    assert core.view.health_of(stalled)["ejected"]
    core.probe(stalled, OK, 0.3)  # one good probe, not healthy_threshold (3)
    assert not core.view.health_of(stalled)["ejected"]


def test_an_ejection_by_refused_probes_blames_no_request() -> None:
    core = region(n=2, policy="round_robin", health=HealthSettings(unhealthy_threshold=1))
    probe_all(core)
    core.submit(req(0, tokens=4000), 0.0)
    target = sends(core.tick(0.0))["q0"]
    actions = core.probe(target, None, 0.1)  # connection refused: the replica went away
    assert not any(isinstance(a, Reject) for a in actions)
    assert core.view.state_of("q0") is RequestState.QUEUED
