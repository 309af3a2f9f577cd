"""A small load through the openai SDK (run it with .venv-clients/bin/python): half text
completions, half chats, every other one streamed with ``include_usage``; one JSON line per
request (what was sent, ``usage``, the answer, the streamed deltas) for tests/test_clients.py
and docs/clients.md.

    .venv-clients/bin/python tests/clients/openai_load.py --base-url http://127.0.0.1:8101/v1 \\
        --requests 12 --max-tokens 16 --out openai.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

from openai import OpenAI

WORDS = ("the quick brown fox jumps over the lazy dog while a mesh of balancers sends each "
         "request to the replica that already holds its prefix").split()


def prompt(i: int) -> str:
    return f"Request {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(12 + i % 7))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True, help="the balancer's URL ending in /v1")
    ap.add_argument("--model", default="skymesh-sim")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=60)
    errors = 0
    with open(args.out, "w") as out:
        for i in range(args.requests):
            chat, stream = i % 2 == 1, i % 4 >= 2
            row: dict = {"chat": chat, "stream": stream, "max_tokens": args.max_tokens}
            sent = {"messages": [{"role": "user", "content": prompt(i)}]} if chat else {"prompt": prompt(i)}
            row.update(sent)
            try:
                if chat:
                    create = client.chat.completions.create
                else:
                    create = client.completions.create
                if stream:
                    text, deltas, usage = "", 0, None
                    for chunk in create(model=args.model, max_tokens=args.max_tokens, stream=True,
                                        stream_options={"include_usage": True}, **sent):
                        if chunk.usage is not None:
                            usage = chunk.usage
                        for c in chunk.choices:
                            piece = c.delta.content if chat else c.text
                            if piece:
                                text, deltas = text + piece, deltas + 1
                    row.update(text=text, deltas=deltas, usage=usage.model_dump() if usage else None)
                else:
                    r = create(model=args.model, max_tokens=args.max_tokens, **sent)
                    text = r.choices[0].message.content if chat else r.choices[0].text
                    row.update(text=text, usage=r.usage.model_dump())
            except Exception as e:  # counted and reported: the test asserts there are none
                errors += 1
                row["error"] = f"{type(e).__name__}: {e}"
            out.write(json.dumps(row) + "\n")
    totals = [json.loads(line) for line in open(args.out)]
    ok = [r for r in totals if "error" not in r]
    print(json.dumps({"requests": len(totals), "errors": errors,
                      "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in ok if r.get("usage")),
                      "completion_tokens": sum(r["usage"]["completion_tokens"] for r in ok if r.get("usage"))}))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
