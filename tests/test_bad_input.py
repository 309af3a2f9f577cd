"""Bad input never gets a 5xx: a live in-process balancer (two fake replicas) is sent
>= 10,000 generated requests (random JSON of random shapes, valid bodies with one field
mutated, lone surrogates, deep nesting, huge and non-finite numbers, random bytes, odd
content types, methods and paths). Every answer must be < 500, every error an
OpenAI-shaped JSON body, nothing counted in ``skymesh_internal_errors_total``, no
background loop restarted, no request left behind, and the process's RSS must not grow
by more than ``RSS_GROWTH_BOUND_MB``.

The requests are generated up front by hypothesis (``derandomize=True``: the same
10,000 every run, no example database) and then sent 100 at a time over one session.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from skymesh.balancer.openai_request import parse_body
from skymesh.balancer.server import Balancer
from skymesh.config import parse_config
from skymesh.runtime.procs import free_port
from skymesh.runtime.prom_text import parse_samples
from tests.mesh_helpers import admin_auth, one_region_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.fault]

MODEL = "skymesh-sim"
GENERATED_CASES = 10_000
BATCH = 100
RSS_GROWTH_BOUND_MB = 200
IDLE_METRICS = "vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n"


@dataclass(frozen=True, slots=True)
class Case:
    """One request to send; ``label`` says which generator made it (for failure reports)."""

    label: str
    method: str = "POST"
    path: str = "/v1/completions"
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------- generation

LONE_SURROGATES = ("\ud800", "\udbff", "\udc00", "\udfff", "a\ud83d", "\ude00b")
surrogate_text = st.builds(lambda pre, s, post: pre + s + post,
                           st.text(max_size=5), st.sampled_from(LONE_SURROGATES), st.text(max_size=5))
# the literal's digits, not an int: Python cannot even make an int of that many from a string
huge_int_literals = st.integers(min_value=4_301, max_value=6_000).map(lambda n: "9" * n)
scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
           | surrogate_text | st.sampled_from([0, -1, 2**63, 1 << 21, 16.0, 1e308, "16", "", []]))
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)

content_parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}),
        st.fixed_dictionaries({"type": st.just("text"), "text": json_values}),
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.just({"url": "http://x/a.png"})}),
        st.dictionaries(st.sampled_from(["type", "text", "image_url", "refusal"]), json_values, max_size=3),
        json_values,
    ),
    max_size=4,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]) | json_values},
        optional={"content": st.text(max_size=30) | content_parts | json_values},
    ),
    min_size=0, max_size=4,
)


def valid_completion(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4}


def valid_chat(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}


COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "stream", "user")
CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "stream", "user")


def deep(depth: int, opener: str) -> str:
    closer = {"[": "]", "{\"a\":": "}"}[opener]
    return opener * depth + "1" + closer * depth


@st.composite
def mutated_body(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """A valid body with one field the balancer reads set to something else."""
    chat = draw(st.booleans())
    body = valid_chat("hello there") if chat else valid_completion("hello there")
    name = draw(st.sampled_from(CHAT_FIELDS if chat else COMPLETION_FIELDS))
    how = draw(st.sampled_from(["json", "surrogate", "huge", "deep", "nonfinite", "drop", "messages"]))
    placeholder = "__SLOT__"
    if how == "json":
        body[name] = draw(json_values)
    elif how == "surrogate":
        body[name] = draw(surrogate_text)
    elif how == "messages" and chat:
        body["messages"] = draw(messages)
    elif how == "drop":
        body.pop(name, None)
    else:
        body[name] = placeholder
    # ensure_ascii (the default) writes a lone surrogate as a \udXXX escape, as clients do
    text = json.dumps(body, allow_nan=True)
    if how == "huge":
        text = text.replace(f'"{placeholder}"', draw(huge_int_literals))
    elif how == "deep":
        text = text.replace(f'"{placeholder}"', deep(draw(st.integers(500, 3000)), draw(st.sampled_from(["[", "{\"a\":"]))))
    elif how == "nonfinite":
        text = text.replace(f'"{placeholder}"', draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"])))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return f"{name}:{how}", path, text.encode()


@st.composite
def raw_body(draw: st.DrawFn) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["json", "bytes", "truncated", "deep", "huge", "utf8-surrogate", "nonascii"]))
    if kind == "json":
        return kind, json.dumps(draw(json_values)).encode()
    if kind == "bytes":
        return kind, draw(st.binary(max_size=200))
    if kind == "truncated":
        full = json.dumps(valid_chat("a b c d e f"))
        return kind, full[: draw(st.integers(0, len(full) - 1))].encode()
    if kind == "deep":
        return kind, deep(draw(st.integers(500, 5000)), draw(st.sampled_from(["[", "{\"a\":"]))).encode()
    if kind == "huge":
        return kind, b'{"model": "skymesh-sim", "prompt": "x", "max_tokens": ' + b"7" * draw(st.integers(4000, 6000)) + b"}"
    if kind == "utf8-surrogate":  # the surrogate's own (invalid) UTF-8 bytes, not an escape
        text = json.dumps(valid_completion("x" + draw(surrogate_text)), ensure_ascii=False)
        return kind, text.encode("utf-8", "surrogatepass")
    return kind, json.dumps(valid_completion(draw(st.text(max_size=40))), ensure_ascii=False).encode()


header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)
content_types = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                 "application/octet-stream"]) | header_text
paths = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                         "/admin/status", "/", "/v1", "/v1/embeddings", "/v1/completions/x", "//v1/completions"]) | (
    st.text(st.sampled_from("abcxyz019-._~/"), max_size=20).map(lambda p: "/" + p))
content_encodings = st.sampled_from(["gzip", "deflate", "br", "zstd", "identity", "x-gzip", "gzip, br",
                                     "compress", "*"]) | header_text
methods = st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])


def encoded(draw: st.DrawFn, encoding: str, label: str, body: bytes) -> tuple[str, bytes]:
    """The body as sent under ``encoding``: unchanged, or compressed by gzip or zlib whole
    or cut short (a stream that decodes so far and then ends early)."""
    how = draw(st.sampled_from(["plain", "gzip", "zlib", "raw-deflate", "cut-gzip", "cut-zlib"]))
    if how != "plain":
        wbits = {"gzip": 31, "zlib": 15, "raw-deflate": -15}[how.removeprefix("cut-")]
        packer = zlib.compressobj(wbits=wbits)
        body = packer.compress(body) + packer.flush()
        if how.startswith("cut-"):
            body = body[: draw(st.integers(0, max(0, len(body) - 1)))]
    return f"{label}:ce={encoding}:{how}", body


@st.composite
def cases(draw: st.DrawFn) -> Case:
    headers: dict[str, str] = {"Content-Type": draw(content_types)}
    if draw(st.integers(0, 9)) == 0:
        headers["X-Session-ID"] = draw(header_text)
    if draw(st.integers(0, 19)) == 0:  # a "forwarded" request, with or without the token
        headers["X-Skymesh-Hop"] = "1"
        headers["X-Skymesh-Peer-Token"] = draw(header_text)
    if draw(st.integers(0, 9)) == 0:  # one that aiohttp decodes, one it has no decoder for, or nonsense
        headers["Content-Encoding"] = draw(content_encodings)
    kind = draw(st.sampled_from(["mutated", "mutated", "raw", "odd"]))
    if kind == "mutated":
        label, path, body = draw(mutated_body())
        method = "POST"
    elif kind == "raw":
        label, body = draw(raw_body())
        method, path = "POST", draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    else:
        label, body = draw(raw_body())
        method, path = draw(methods), draw(paths)
    if method == "HEAD":
        # a HEAD the parser rejects (an unsupported coding, a body that does not decode)
        # gets its error body: the parser does not say which method it read
        # (docs/reliability.md, "Not covered"); aiohttp's client calls that data after the end
        headers.pop("Content-Encoding", None)
    if "Content-Encoding" in headers:
        label, body = encoded(draw, headers["Content-Encoding"], label, body)
    return Case(f"{kind}:{label}", method, path, body, headers)


def generate_cases(n: int) -> list[Case]:
    made: list[Case] = []

    # generation only: the checks run afterwards, on all of them at once
    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def collect(case: Case) -> None:
        made.append(case)

    collect()
    return made


# ---------------------------------------------------------------------- the live balancer


class EchoReplica:
    """A replica answering every completion at once (its /metrics always idle)."""

    def __init__(self) -> None:
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=IDLE_METRICS)

    async def _complete(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self.runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def balancer() -> AsyncIterator[Balancer]:
    replicas = [EchoReplica(), EchoReplica()]
    for r in replicas:
        await r.start()
    # consistent_hash: the policy that reads X-Session-ID / user
    data = one_region_config({f"r{i}": r.url for i, r in enumerate(replicas)}, free_port(), free_port(),
                             name="consistent_hash", probe_interval_s=0.05, queue_bound=100_000)
    b = Balancer(parse_config(data), "us-east-1")
    await b.start(port=0)
    try:
        for _ in range(200):
            if all(v.healthy for v in b.core.view.replicas.values()):
                break
            await asyncio.sleep(0.05)
        yield b
    finally:
        await b.stop()
        await asyncio.gather(*(r.stop() for r in replicas))


def rss_mb() -> float:
    """This process's resident set size, from /proc/self/status (VmRSS, in kB)."""
    with open("/proc/self/status") as f:
        match = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match is not None
    return int(match.group(1)) / 1024


def error_shape_problem(body: bytes) -> str | None:
    """None when ``body`` is ``{"error": {"message": str, "type": str, "param", "code"}}``."""
    try:
        doc = json.loads(body)
    except ValueError:
        return f"not JSON: {body[:120]!r}"
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"not the OpenAI error shape: {body[:200]!r}"
    if not isinstance(err["message"], str) or not isinstance(err["type"], str):
        return f"message/type not strings: {body[:200]!r}"
    if not (err["param"] is None or isinstance(err["param"], str)) or not isinstance(err["code"], str | None):
        return f"param/code of the wrong type: {body[:200]!r}"
    return None


async def send(s: aiohttp.ClientSession, base: str, case: Case) -> str | None:
    """Sends one case; a description of what is wrong with the answer, or None."""
    try:
        async with s.request(case.method, base + case.path, data=case.body, headers=case.headers,
                             skip_auto_headers=("Content-Type",)) as r:
            body = await r.read()
            status, content_type = r.status, r.headers.get("Content-Type", "")
    except (TimeoutError, aiohttp.ClientError) as e:
        return f"{case.label}: no answer ({type(e).__name__}: {e})"
    if status >= 500:
        return f"{case.label}: {status} {body[:200]!r}"
    if status >= 400 and case.method != "HEAD":
        if not content_type.startswith("application/json"):
            return f"{case.label}: {status} with Content-Type {content_type!r}"
        problem = error_shape_problem(body)
        if problem is not None:
            return f"{case.label}: {status} {problem}"
    return None


class ErrorRecords(logging.Handler):
    """Collects the messages of the error records it is given (with or without pytest's
    logging plugin)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def internal_errors(s: aiohttp.ClientSession, base: str) -> float:
    async with s.get(base + "/metrics") as r:
        page = await r.text()
    return parse_samples(page, ["skymesh_internal_errors_total"])["skymesh_internal_errors_total"]


# ---------------------------------------------------------------------- tests


def chat_bytes(content: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}).encode()


@pytest.mark.parametrize("raw, param", [
    (chat_bytes("hi \ud800 there"), None),  # a 500 before this work
    (chat_bytes([{"type": "text", "text": "\udfff"}]), None),
    (json.dumps({"model": MODEL, "messages": [{"role": "\ud800", "content": "x"}]}).encode(), None),
    (chat_bytes([{"type": "text", "text": 7}]), "messages"),
    (chat_bytes([{"type": "text", "text": None}]), "messages"),
    (chat_bytes([{"type": "hologram", "hologram": "x"}]), "messages"),
    (chat_bytes([{"text": "no type"}]), "messages"),
    (chat_bytes({"type": "text", "text": "not a list"}), "messages"),
    (b'{"model": "skymesh-sim", "prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}", None),
    (b'{"model": "skymesh-sim", "prompt": "x", "max_tokens": NaN}', None),
    (b'{"model": "skymesh-sim", "prompt": "x", "temperature": 1e999}', None),
    (b"[" * 5000 + b"]" * 5000, None),
    (b'{"model": "skymesh-sim", "prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}", None),
    (b'{"model": "skymesh-sim", "messages": [{"role": "user"}], "max_completion_tokens": "4"}',
     "max_completion_tokens"),
    (b'{"model": "skymesh-sim", "messages": [{"role": "user"}], "max_tokens": 1.5}', "max_tokens"),
    (b'{"model": "skymesh-sim", "prompt": "x", "stream": "yes"}', "stream"),
    (b'{"model": "skymesh-sim", "prompt": "x", "user": 5}', "user"),
    (b"\xff\xfe{}", None),
])
def test_parse_body_answers_bad_input_with_a_400(raw: bytes, param: str | None) -> None:
    from skymesh.edge.openai_errors import RequestError

    kind = "chat" if b"messages" in raw else "completions"
    with pytest.raises(RequestError) as e:
        parse_body(raw, kind, MODEL)
    assert e.value.status == 400
    if param is not None:
        assert e.value.param == param


def test_valid_content_parts_are_accepted_and_only_text_reaches_the_prompt() -> None:
    parsed = parse_body(chat_bytes([{"type": "text", "text": "a b"}, "c",
                                    {"type": "image_url", "image_url": {"url": "http://x/i.png"}}]),
                        "chat", MODEL)
    assert parsed.prompt == "<|user|> a b c"
    surrogate_pair = json.dumps({"model": MODEL, "prompt": "\U0001f600", "stream": None}).encode()
    assert parse_body(surrogate_pair, "completions", MODEL).prompt == "\U0001f600"


async def test_a_lone_surrogate_in_chat_content_gets_a_json_400(balancer: Balancer) -> None:
    base = f"http://127.0.0.1:{balancer.bound_port}"
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/chat/completions", data=chat_bytes("hi \ud800"),
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            assert error_shape_problem(await r.read()) is None
        # the router's own answers are JSON too
        for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/completions", 405)):
            async with s.request(method, base + path) as r:
                assert r.status == status
                assert r.content_type == "application/json"
                assert error_shape_problem(await r.read()) is None


async def test_an_unexpected_exception_is_a_counted_json_500(balancer: Balancer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(balancer, "admin_status", broken)
    base = f"http://127.0.0.1:{balancer.bound_port}"
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/admin/status", headers=admin_auth()) as r:
            assert r.status == 500
            body = await r.read()
            assert error_shape_problem(body) is None
            assert r.headers["X-Request-Id"] in json.loads(body)["error"]["message"]
        assert await internal_errors(s, base) == 1.0


async def test_generated_bad_input_never_gets_a_5xx(balancer: Balancer) -> None:
    t0 = time.perf_counter()
    generated = generate_cases(GENERATED_CASES)
    generation_s = time.perf_counter() - t0
    base = f"http://127.0.0.1:{balancer.bound_port}"
    problems: list[str] = []
    timeout = aiohttp.ClientTimeout(total=30)
    aiohttp_errors = ErrorRecords()  # aiohttp's own error log ("Unhandled exception"): none
    logging.getLogger("aiohttp").addHandler(aiohttp_errors)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as s:
            await asyncio.gather(*(send(s, base, c) for c in generated[:BATCH]))  # warm-up
            rss_before = rss_mb()
            t1 = time.perf_counter()
            for i in range(0, len(generated), BATCH):
                answers = await asyncio.gather(*(send(s, base, c) for c in generated[i:i + BATCH]))
                problems += [a for a in answers if a is not None]
            sending_s = time.perf_counter() - t1
            rss_after = rss_mb()
            counted = await internal_errors(s, base)
    finally:
        logging.getLogger("aiohttp").removeHandler(aiohttp_errors)
    labels = {c.label.split(":")[0] for c in generated}
    print(f"\nbad input: {len(generated)} generated ({generation_s:.1f} s), sent in {sending_s:.1f} s, "
          f"{len(problems)} problems, internal errors {counted:.0f}, "
          f"RSS {rss_before:.1f} -> {rss_after:.1f} MB ({rss_after - rss_before:+.1f} MB)")
    assert len(generated) >= GENERATED_CASES
    assert labels == {"mutated", "raw", "odd"}
    assert problems == [], f"{len(problems)} bad answers, first ones: {problems[:10]}"
    assert counted == 0
    assert aiohttp_errors.messages == []
    assert balancer.loop_restart_counts() == {}
    assert balancer.core.view.active_requests == 0
    assert rss_after - rss_before < RSS_GROWTH_BOUND_MB
