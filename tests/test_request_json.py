"""The balancer's JSON reading of a request body (skymesh/balancer/openai_request.py
load_json_body): one decoder made once reads every body as json.loads with the same hooks
did, answers and errors alike."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skymesh.balancer import openai_request
from skymesh.balancer.openai_request import load_json_body
from skymesh.edge.openai_errors import RequestError


def _before(raw: bytes) -> tuple[str, Any]:
    """The reading before the decoder was kept (its code, json.loads with the hooks per body)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return "error", f"request body is not valid UTF-8: {e}"
    try:
        body = json.loads(text, parse_constant=openai_request._reject_constant,
                          parse_float=openai_request._finite_float)
    except json.JSONDecodeError as e:
        return "error", f"request body is not valid JSON: {e}"
    except openai_request._NonFiniteNumber as e:
        return "error", f"request body holds a number that is not finite ({e}): JSON numbers are finite"
    except RecursionError:
        return "error", "request body is nested too deeply"
    except ValueError as e:
        return "error", f"request body holds a number with too many digits: {e}"
    if openai_request._SURROGATE_ESCAPE.search(raw) is not None:
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return "error", "request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair)"
    return "ok", body


def _now(raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", load_json_body(raw)
    except RequestError as e:
        return "error", str(e)


CASES = [b'{"model": "m", "prompt": "hi"}', b"\xef\xbb\xbf{}", b"{", b"", b"[1, 2.5, -0.0]", b'{"a": NaN}',
         b'{"a": Infinity}', b'{"a": 1e999}', b'"\\ud800"', b"[" * 100_000, b"\xff", b'{"a": 1} x',
         b"1" * 5000, b'{"a": "\\u00e9"}', b"  {} "]


@pytest.mark.parametrize("raw", CASES, ids=range(len(CASES)))
def test_each_body_reads_as_before(raw: bytes) -> None:
    assert _now(raw) == _before(raw)


def test_a_bom_is_refused_with_json_loads_message() -> None:
    with pytest.raises(RequestError, match="Unexpected UTF-8 BOM"):
        load_json_body("\ufeff{}".encode())


@given(st.text(max_size=60))
def test_any_text_reads_as_before(text: str) -> None:
    raw = text.encode("utf-8", "surrogatepass")
    before, now = _before(raw), _now(raw)
    assert now[0] == before[0]
    assert json.dumps(now[1]) == json.dumps(before[1])
