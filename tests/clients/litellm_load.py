"""A small load through LiteLLM's SDK (run it with .venv-clients/bin/python and
``LITELLM_LOCAL_MODEL_COST_MAP=True``, so it does not fetch its price list): chats through
the ``hosted_vllm/`` provider, text completions through ``openai/``, every other one
streamed; one JSON line per request (what was sent, ``usage``, the answer) for
tests/test_clients.py and docs/clients.md.

    LITELLM_LOCAL_MODEL_COST_MAP=True .venv-clients/bin/python tests/clients/litellm_load.py \\
        --api-base http://127.0.0.1:8101/v1 --requests 12 --max-tokens 16 --out litellm.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

import litellm

# the streamed answers are rebuilt by stream_chunk_builder, whose cost lookup of the bare
# model name prints LiteLLM's provider list banner: nothing is wrong, so keep it quiet
litellm.suppress_debug_info = True

WORDS = ("litellm sends the request through its provider adapter to an openai compatible "
         "server where the balancer picks a replica by the prompt's cached prefix").split()


def prompt(i: int) -> str:
    return f"Question {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(10 + i % 9))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--api-base", required=True, help="the balancer's URL ending in /v1")
    ap.add_argument("--model", default="skymesh-sim")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    common = {"api_base": args.api_base, "api_key": "unused", "max_tokens": args.max_tokens, "timeout": 60,
              "num_retries": 0}
    errors = 0
    with open(args.out, "w") as out:
        for i in range(args.requests):
            chat, stream = i % 2 == 0, i % 4 >= 2
            row: dict = {"chat": chat, "stream": stream, "max_tokens": args.max_tokens}
            try:
                if chat:
                    row["messages"] = [{"role": "user", "content": prompt(i)}]
                    kw = {"model": f"hosted_vllm/{args.model}", "messages": row["messages"], **common}
                    call = litellm.completion
                else:
                    row["prompt"] = prompt(i)
                    kw = {"model": f"openai/{args.model}", "prompt": row["prompt"], **common}
                    call = litellm.text_completion
                if stream:
                    chunks = list(call(stream=True, stream_options={"include_usage": True}, **kw))
                    r = litellm.stream_chunk_builder(chunks, messages=row.get("messages"))
                else:
                    r = call(**kw)
                choice = r.choices[0]
                text = choice.message.content if hasattr(choice, "message") and choice.message else choice.text
                row.update(text=text, usage={"prompt_tokens": r.usage.prompt_tokens,
                                             "completion_tokens": r.usage.completion_tokens})
            except Exception as e:  # counted and reported: the test asserts there are none
                errors += 1
                row["error"] = f"{type(e).__name__}: {e}"
            out.write(json.dumps(row) + "\n")
    totals = [json.loads(line) for line in open(args.out)]
    ok = [r for r in totals if "error" not in r]
    print(json.dumps({"requests": len(totals), "errors": errors,
                      "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in ok),
                      "completion_tokens": sum(r["usage"]["completion_tokens"] for r in ok)}))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
