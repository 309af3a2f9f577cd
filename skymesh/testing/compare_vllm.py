"""The vLLM stand-in next to real vLLM on the same requests: what differs on the wire.

``python -m skymesh.testing.compare_vllm [--json OUT]`` starts one real vLLM replica
(:mod:`skymesh.testing.vllm_env`; needs ``make vllm-env``) and one stand-in
(``skymesh replica-sim --profile tiny-test`` sized like it: 128-token blocks, 64 blocks,
4 sequences), sends both the same requests and prints a Markdown report: each error case's
status and body, the metric families only one of them serves, the prefix-cache counters
for a repeated prompt, the first SSE events of a stream, the KV events vLLM published
meanwhile (the stand-in publishes none), and the structure, usage and choice indices of
answers with ``n``, ``logprobs`` and ``echo`` (from a second stand-in with the model's
tokenizer). docs/replica-sim.md, "Real vLLM 0.32 (CPU) side
by side", was written from its output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import zmq

from skymesh.runtime.procs import start_sim_replicas
from skymesh.runtime.prom_text import parse_samples
from skymesh.testing.vllm_env import (
    MODEL_NAME,
    ReplicaOptions,
    VllmReplica,
    make_model_dir,
    unavailable_reason,
)

PREFIX = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
MAX_MODEL_LEN = 4096


def cases() -> list[tuple[str, str, Any]]:
    """(what, path, JSON body or raw bytes): the same request to both servers."""
    # ignore_eos: the dummy weights sample EOS now and then; the stand-in never does
    ok = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 4, "ignore_eos": True}
    mid = " ".join(f"w{i}" for i in range(300))  # ~1,900 tokens for vLLM, 300 for the stand-in
    return [
        ("a plain completion", "/v1/completions", ok),
        # > 4096 tokens for both, < 10 characters per token of the context (40,960)
        ("prompt too long (30,000 characters)", "/v1/completions", {**ok, "prompt": "hello world " * 2500}),
        # > 40,960 characters: vLLM refuses before tokenizing
        ("prompt too long (52,000 characters)", "/v1/completions",
         {**ok, "prompt": " ".join(f"w{i}" for i in range(9000))}),
        ("max_tokens over max_model_len", "/v1/completions", {**ok, "max_tokens": 5000}),
        ("prompt + max_tokens over max_model_len, max_tokens under it", "/v1/completions",
         {**ok, "prompt": mid, "max_tokens": 4000}),
        ("unknown model", "/v1/completions", {**ok, "model": "no-such-model"}),
        ("no model field", "/v1/completions", {k: v for k, v in ok.items() if k != "model"}),
        ("max_tokens 0", "/v1/completions", {**ok, "max_tokens": 0}),
        ("max_tokens -3", "/v1/completions", {**ok, "max_tokens": -3}),
        ("max_tokens a string", "/v1/completions", {**ok, "max_tokens": "x"}),
        ("min_tokens > max_tokens", "/v1/completions", {**ok, "min_tokens": 9}),
        ("batched prompt (2 strings)", "/v1/completions", {**ok, "prompt": ["hello a", "hello b"]}),
        ("batched token ids (2 lists)", "/v1/completions", {**ok, "prompt": [[0, 5, 6], [0, 7, 8]]}),
        ("token-id prompt", "/v1/completions", {**ok, "prompt": [0, 5, 6, 7]}),
        ("empty prompt", "/v1/completions", {**ok, "prompt": ""}),
        ("n = 2", "/v1/completions", {**ok, "n": 2}),
        ("n = 0", "/v1/completions", {**ok, "n": 0}),
        ("n = 2, temperature 0", "/v1/completions", {**ok, "n": 2, "temperature": 0}),
        ("logprobs 21", "/v1/completions", {**ok, "logprobs": 21}),
        ("logprobs -2", "/v1/completions", {**ok, "logprobs": -2}),
        ("chat, top_logprobs without logprobs", "/v1/chat/completions",
         {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
        ("chat, top_logprobs 30", "/v1/chat/completions",
         {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30}),
        ("stream_options without stream", "/v1/completions", {**ok, "stream_options": {"include_usage": True}}),
        ("body not JSON", "/v1/completions", b"{not json"),
        ("chat, messages not a list", "/v1/chat/completions", {"model": MODEL_NAME, "messages": "hi"}),
        ("chat, a plain one", "/v1/chat/completions",
         {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ]


def shape_cases() -> list[tuple[str, str, dict[str, Any]]]:
    """Answers whose structure is compared (n, logprobs, echo), sent to vLLM and to a
    stand-in with the model's tokenizer."""
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 3,
            "ignore_eos": True}
    ok = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 3, "ignore_eos": True}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    return [
        ("completion, n 2, logprobs 2, echo", "/v1/completions", {**ok, "n": 2, "logprobs": 2, "echo": True}),
        ("completion stream, n 2, logprobs 1, echo", "/v1/completions",
         {**ok, "n": 2, "logprobs": 1, "echo": True, **usage}),
        ("completion, echo, max_tokens 0", "/v1/completions", {**ok, "echo": True, "max_tokens": 0}),
        ("chat, n 2, logprobs, top_logprobs 2", "/v1/chat/completions",
         {**chat, "n": 2, "logprobs": True, "top_logprobs": 2}),
        ("chat stream, n 2, logprobs, top_logprobs 1", "/v1/chat/completions",
         {**chat, "n": 2, "logprobs": True, "top_logprobs": 1, **usage}),
        ("chat, echo of an assistant message", "/v1/chat/completions",
         {**chat, "echo": True, "add_generation_prompt": False,
          "messages": [*chat["messages"], {"role": "assistant", "content": "Sure:"}]}),
    ]


def shape(x: Any) -> Any:
    """A JSON value's structure: dicts by key, a list by its first element, scalars by type."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in sorted(x.items())}
    if isinstance(x, list):
        return [shape(x[0])] if x else []
    return None if x is None else type(x).__name__


def shape_diff(vllm: Any, ours: Any, path: str = "") -> list[str]:
    """Where the stand-in's structure differs from vLLM's (keys only one has; types)."""
    if isinstance(vllm, dict) and isinstance(ours, dict):
        out = [f"vLLM only: {path}.{k}" for k in vllm if k not in ours]
        out += [f"stand-in only: {path}.{k}" for k in ours if k not in vllm]
        for k in vllm:
            if k in ours:
                out += shape_diff(vllm[k], ours[k], f"{path}.{k}")
        return out
    if isinstance(vllm, list) and isinstance(ours, list):
        return shape_diff(vllm[0], ours[0], f"{path}[0]") if vllm and ours else []
    return [] if vllm == ours else [f"type: {path} {vllm} / {ours}"]


async def _answer(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """An answer's structure, its usage and how many tokens each choice got (streams:
    the union of their events' structures, counted per index)."""
    async with s.post(url, json=body) as r:
        text = await r.text()
    if r.status != 200:
        return {"status": r.status, "body": text[:300]}
    if not body.get("stream"):
        data = json.loads(text)
        return {"status": 200, "shape": shape(data), "usage": data.get("usage"),
                "indices": [c["index"] for c in data["choices"]],
                "logprob_tokens": [len((c.get("logprobs") or {}).get("tokens")
                                       or (c.get("logprobs") or {}).get("content") or []) for c in data["choices"]]}
    events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: ") and e != "data: [DONE]"]
    merged: dict[str, Any] = {}
    for e in events:
        for c in e.get("choices", []):
            merged.setdefault("choice", shape(c))
            if c.get("logprobs") is not None:
                merged["choice_with_logprobs"] = shape(c)
    indices = sorted({c["index"] for e in events for c in e.get("choices", [])})
    return {"status": 200, "shape": merged, "usage": events[-1].get("usage"), "indices": indices,
            "events": len(events)}


async def _post(s: aiohttp.ClientSession, url: str, body: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(
        body, bytes) else {"json": body}
    async with s.post(url, **kw) as r:
        text = await r.text()
    try:
        data = json.loads(text)
    except ValueError:
        return {"status": r.status, "body": text[:300]}
    if r.status == 200:
        return {"status": 200, "choices": len(data.get("choices", [])), "keys": sorted(data),
                "usage": data.get("usage"),
                "finish_reason": [c.get("finish_reason") for c in data.get("choices", [])]}
    return {"status": r.status, "error": data.get("error", data)}


async def _families(s: aiohttp.ClientSession, url: str) -> tuple[str, dict[str, str]]:
    async with s.get(url + "/metrics") as r:
        ctype = r.headers.get("Content-Type", "")
        page = await r.text()
    fams = {}
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            fams[name] = kind
    return ctype, fams


async def _stream_head(s: aiohttp.ClientSession, url: str) -> list[Any]:
    body = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    async with s.post(url + "/v1/completions", json=body) as r:
        text = await r.text()
    out: list[Any] = []
    for ev in text.split("\n\n"):
        if ev.startswith("data: "):
            payload = ev[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def _prefix_runs(s: aiohttp.ClientSession, url: str, text: str, n: int) -> list[dict[str, float]]:
    runs = []
    for _ in range(n):
        async with s.get(url + "/metrics") as r:
            before = parse_samples(await r.text(), PREFIX)
        async with s.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": text, "max_tokens": 2}) as r:
            data = await r.json()
        if "usage" not in data:
            raise RuntimeError(f"{url}: {data}")
        async with s.get(url + "/metrics") as r:
            after = parse_samples(await r.text(), PREFIX)
        runs.append({"prompt_tokens": data["usage"]["prompt_tokens"],
                     "queried": after[PREFIX[0]] - before[PREFIX[0]], "hit": after[PREFIX[1]] - before[PREFIX[1]]})
    return runs


def _kv_sub(endpoint: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _drain(sock: zmq.Socket[bytes], within_s: float) -> list[list[bytes]]:
    out = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            out.append(sock.recv_multipart())
    return out


async def compare(log_dir: Path) -> dict[str, Any]:
    # the stand-in's tiny-test profile serves a 4096-token context: vLLM too, here
    rep = VllmReplica("compare-vllm", make_model_dir(), ReplicaOptions(max_model_len=MAX_MODEL_LEN))
    children, urls = await start_sim_replicas(
        1, "tiny-test", 1.0, log_dir, "compare-sim",
        extra=["--model", MODEL_NAME, "--block-size", "128", "--num-gpu-blocks", "64", "--max-num-seqs", "4"])
    sim = urls[0]
    # one more stand-in with the model's tokenizer: the answers' structures
    tok_children, tok_urls = await start_sim_replicas(
        1, "tiny-test", 1.0, log_dir, "compare-sim-tok",
        extra=["--model", MODEL_NAME, "--block-size", "128", "--num-gpu-blocks", "64", "--max-num-seqs", "4",
               "--tokenizer", str(make_model_dir() / "tokenizer.json")])
    children += tok_children
    sock: zmq.Socket[bytes] | None = None
    try:
        await rep.start()
        sock = _kv_sub(rep.kv_endpoint)
        servers = {"vllm": rep.url, "stand-in": sim}
        out: dict[str, Any] = {"cases": {}, "metrics": {}, "stream": {}, "prefix": {}, "health": {}, "shapes": {}}
        async with aiohttp.ClientSession() as s:
            for what, path, body in shape_cases():
                out["shapes"][what] = {"vllm": await _answer(s, rep.url + path, body),
                                       "stand-in": await _answer(s, tok_urls[0] + path, body)}
            for what, path, body in cases():
                out["cases"][what] = {name: await _post(s, url + path, body) for name, url in servers.items()}
            for name, url in servers.items():
                out["stream"][name] = await _stream_head(s, url)
                async with s.get(url + "/health") as r:
                    out["health"][name] = {"status": r.status, "body": await r.text()}
                async with s.get(url + "/v1/models") as r:
                    out["health"][name]["models_keys"] = sorted((await r.json())["data"][0])
            repeated = " ".join(f"shared{i}" for i in range(280))
            for name, url in servers.items():
                out["prefix"][name] = await _prefix_runs(s, url, repeated, 3)
            for name, url in servers.items():
                out["metrics"][name] = await _families(s, url)
        frames = await asyncio.to_thread(_drain, sock, 1.0)
        events: dict[str, int] = {}
        for f in frames:
            for e in msgspec.msgpack.decode(f[2])[1]:
                events[e["type"]] = events.get(e["type"], 0) + 1
        out["kv_events"] = {"messages": len(frames), "events": events}
        return out
    finally:
        if sock is not None:
            sock.close()
        await rep.stop()
        await asyncio.gather(*(c.stop() for c in children))


def report(r: dict[str, Any]) -> str:
    lines = ["| request | real vLLM 0.32 | stand-in |", "|---|---|---|"]

    def cell(x: dict[str, Any]) -> str:
        if x["status"] == 200:
            usage = x.get("usage") or {}
            return (f"200, {x.get('choices')} choice(s), prompt {usage.get('prompt_tokens')} + "
                    f"{usage.get('completion_tokens')} tokens, finish {x.get('finish_reason')}")
        e = x.get("error", x.get("body"))
        if isinstance(e, dict):
            return f"{x['status']} `{e.get('type')}` param=`{e.get('param')}`: {str(e.get('message'))[:160]}"
        return f"{x['status']} {str(e)[:160]}"

    for what, by in r["cases"].items():
        lines.append(f"| {what} | {cell(by['vllm'])} | {cell(by['stand-in'])} |")
    (vt, vf_all), (st, sf_all) = r["metrics"]["vllm"], r["metrics"]["stand-in"]

    def families(fams: dict[str, str]) -> dict[str, str]:
        # one entry per family: counters and histograms also expose NAME_created
        return {n: k for n, k in fams.items() if not (n.endswith("_created") and n[:-8] + "_total" in fams
                                                       or n.endswith("_created") and n[:-8] in fams)}

    vf, sf = families(vf_all), families(sf_all)
    lines += ["", f"/metrics Content-Type: vLLM `{vt}`, stand-in `{st}`", "",
              "vllm: families only in real vLLM: " + ", ".join(f"`{n}`" for n in sorted(set(vf) - set(sf))
                                                              if n.startswith("vllm:")),
              "", "vllm: families only in the stand-in: " + ", ".join(
                  f"`{n}`" for n in sorted(set(sf) - set(vf)) if n.startswith("vllm:")),
              "", "other families only in real vLLM: " + ", ".join(
                  f"`{n}`" for n in sorted(set(vf) - set(sf)) if not n.startswith("vllm:")),
              "", "other families only in the stand-in: " + ", ".join(
                  f"`{n}`" for n in sorted(set(sf) - set(vf)) if not n.startswith("vllm:")),
              "", "families in both whose type differs: " + ", ".join(
                  f"`{n}` ({vf[n]} / {sf[n]})" for n in sorted(set(vf) & set(sf)) if vf[n] != sf[n]), ""]
    for name in ("vllm", "stand-in"):
        lines.append(f"prefix cache, the same 280-word prompt 3 times, {name}: {r['prefix'][name]}")
    lines.append("")
    for name in ("vllm", "stand-in"):
        head = r["stream"][name]
        lines.append(f"stream of 3 tokens, {name}: {len(head)} events; first: `{json.dumps(head[0])[:300]}`")
    lines += ["", f"health: {r['health']}", "", f"KV events from vLLM during all of the above: {r['kv_events']}"]
    lines += ["", "Answers' structures (the stand-in with the model's tokenizer):"]
    for what, by in r.get("shapes", {}).items():
        v, o = by["vllm"], by["stand-in"]
        if v["status"] != 200 or o["status"] != 200:
            lines.append(f"- {what}: status {v['status']} / {o['status']}: {v.get('body')} / {o.get('body')}")
            continue
        diff = shape_diff(v["shape"], o["shape"])
        same = {k: v.get(k) == o.get(k) for k in ("usage", "indices", "logprob_tokens", "events") if k in v}
        lines.append(f"- {what}: equal {same}; vLLM usage {v['usage']}, stand-in {o['usage']}; "
                     f"structure differences: {diff or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh.testing.compare_vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="also write the raw findings here")
    args = ap.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"compare_vllm: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="skymesh-compare-") as d:
        r = asyncio.run(compare(Path(d)))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    print(report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
