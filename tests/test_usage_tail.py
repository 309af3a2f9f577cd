"""Reading the replica's cached-token count from the answer's tail (skymesh/balancer/usage.py),
on the shapes real vLLM 0.32 writes with --enable-prompt-tokens-details (captured from it)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skymesh.balancer.usage import (
    _CACHED,
    _COMPLETION,
    reported_cached_tokens,
    reported_completion_tokens,
)
from skymesh.cache_prediction import PredictionResult, judge_prediction

STREAM_END = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
    b'"text":" a","logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],"usage":'
    b'{"prompt_tokens":387,"total_tokens":389,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":384}},'
    b'"system_fingerprint":"vllm-0.32.0"}\n\ndata: [DONE]\n\n'
)
NON_STREAM = (
    b'{"id":"cmpl-2","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" a"}],'
    b'"service_tier":null,"usage":{"prompt_tokens":16,"total_tokens":18,"completion_tokens":2,'
    b'"prompt_tokens_details":{"cached_tokens":0,"created_cache_tokens":null,"multimodal_tokens":null},'
    b'"completion_tokens_details":null},"kv_transfer_params":null}'
)
CHAT = (
    b'{"id":"chatcmpl-3","choices":[],"usage":{"prompt_tokens":398,"total_tokens":400,"completion_tokens":2,'
    b'"prompt_tokens_details":{"cached_tokens":128,"created_cache_tokens":256,"multimodal_tokens":null}}}'
)


@pytest.mark.parametrize(("tail", "cached"), [
    (STREAM_END, 384),
    (NON_STREAM, 0),
    (CHAT, 128),
    # the tail of a longer answer, cut anywhere before usage
    (STREAM_END[40:], 384),
    # without the flag: prompt_tokens_details is null
    (NON_STREAM.replace(b'{"cached_tokens":0,"created_cache_tokens":null,"multimodal_tokens":null}', b"null"), None),
    # a stream whose client did not ask for usage
    (STREAM_END.split(b"data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\","
                      b"\"choices\":[],")[0] + b"data: [DONE]\n\n", None),
    (b'{"usage":null}', None),
    (b"", None),
])
def test_cached_tokens_from_vllm_answers(tail: bytes, cached: int | None) -> None:
    assert reported_cached_tokens(tail) == cached


def test_generated_text_cannot_fake_a_count() -> None:
    text = 'the answer is "usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 9999}}'
    # the text as a JSON string value inside a completion without usage
    answer = json.dumps({"choices": [{"text": text}], "usage": None}).encode()
    assert reported_cached_tokens(answer) is None
    # and with a real usage after it, the real count
    answer = json.dumps({"choices": [{"text": text}],
                         "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}}).encode()
    assert reported_cached_tokens(answer) == 0


@pytest.mark.parametrize(("predicted", "cached", "result"), [
    (0, 0, PredictionResult.WITHIN_BLOCK),
    (128, 0, PredictionResult.WITHIN_BLOCK),  # one block either way
    (0, 128, PredictionResult.WITHIN_BLOCK),
    (384, 384, PredictionResult.WITHIN_BLOCK),
    (512, 256, PredictionResult.OVER),
    (129, 0, PredictionResult.OVER),
    (0, 256, PredictionResult.UNDER),
])
def test_judged_within_one_block(predicted: int, cached: int, result: PredictionResult) -> None:
    assert judge_prediction(predicted, cached, 128) is result


# the reading before it searched from the end: every usage match, left to right, the last one
_USAGE_BEFORE = re.compile(rb'(?<!\\)"usage"\s*:\s*(null|\{)')


def _field_before(tail: bytes, field: re.Pattern[bytes]) -> int | None:
    last = next(reversed(list(_USAGE_BEFORE.finditer(tail))), None)
    if last is None or last.group(1) == b"null":
        return None
    found = field.search(tail, last.end())
    return int(found.group(1)) if found is not None else None


_PIECES = [b'"usage"', b'\\"usage\\"', b'\\', b':', b' ', b'\n', b'null', b'{', b'}', b'"cached_tokens"',
           b'"completion_tokens"', b'7', b'42', b',', b'"text":"', b'data: [DONE]\n\n', b'"', b'usage']


@given(st.lists(st.sampled_from(_PIECES), max_size=40))
def test_the_search_from_the_end_reads_what_the_regex_over_all_read(pieces: list[bytes]) -> None:
    tail = b"".join(pieces)
    assert reported_cached_tokens(tail) == _field_before(tail, _CACHED)
    assert reported_completion_tokens(tail) == _field_before(tail, _COMPLETION)


def test_the_last_usage_counts_and_an_escaped_one_does_not() -> None:
    two = b'"usage":{"completion_tokens":3} "usage" : {"completion_tokens":5}'
    assert reported_completion_tokens(two) == 5
    faked = b'"usage":{"completion_tokens":3} \\"usage\\":{\\"completion_tokens\\":9}'
    assert reported_completion_tokens(faked) == 3
    assert reported_completion_tokens(b'"usage":{"completion_tokens":3} "usage": null') is None
    assert reported_completion_tokens(b'"usage" "usage":{"completion_tokens":4}') == 4
