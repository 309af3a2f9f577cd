"""A request's prompt, counted and hashed within bounds, and checked against the model's
context (skymesh/context_window.py) before any replica sees it.

The work a request can cost the balancer is bounded before it is done:

* on the event loop only what is proportional to the body (already bounded by the gate):
  the output budget against the context, each token-id prompt's length, and each text's
  length against ``max_model_len`` times the tokenizer's longest entry, in characters
  (vLLM's own check before it tokenizes) — a text too long for that is refused here,
  never tokenized;
* what is left (tokenizing, the chat template) is at most that many characters per
  prompt, and runs in a small pool of worker threads (the HF tokenizer's batch call
  releases the GIL), never on the loop; a prompt not counted within
  ``tokenizer.count_timeout_s`` of being handed over (a queue of long prompts ahead of it)
  gets 503, not an open-ended wait.

The exact count decides where it is the replica's count: a completion's text or token ids
with the model's tokenizer, a chat through the model's chat template. A chat flattened
without a template is only estimated: its flattened text (its contents, which any template
keeps, and skymesh's role markers) is held to the character bound, and the replica judges
the rest; so is every prompt in the byte fallback, where the bound is known only from
``tokenizer.max_chars_per_token``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from skymesh.balancer.openai_request import ParsedRequest
from skymesh.context_window import ContextWindow
from skymesh.edge.openai_errors import RequestError
from skymesh.prompt_encoder import OFF_LOOP_CHARS, EncodedPrompt, PromptEncoder

# worker threads that tokenize: two keep one long prompt from holding every other
# request's count, and bound what a flood of long prompts can take of the machine
ENCODE_WORKERS = 2


def precheck(parsed: ParsedRequest, window: ContextWindow | None, *, chat_template: bool = False) -> None:
    """vLLM's refusals that need no tokenizer, in vLLM's order: the output budget, then
    each prompt whose length is known without tokenizing (token ids) or proved by its
    characters. ``chat_template``: a chat is rendered by the model's template, whose text
    vLLM checks (the rendered text is checked where it is rendered, off the loop)."""
    if window is None:
        return
    window.check_budget(parsed.budget_param, parsed.max_tokens)
    if parsed.messages is not None and chat_template:
        return
    prompts: list[str | list[int]] = [parsed.prompt_ids if parsed.prompt_ids is not None else parsed.prompt]
    prompts += parsed.extra_prompts or ()
    for prompt in prompts:
        if isinstance(prompt, list):
            window.check_prompt(len(prompt), text=False)
        else:
            window.check_text(len(prompt))


def encode_request(encoder: PromptEncoder, parsed: ParsedRequest, window: ContextWindow | None = None) -> EncodedPrompt:
    """What routing needs of a parsed request (400 when the chat template refuses it, or
    when ``window`` is given and an exactly counted prompt cannot fit the model)."""
    # (tokens, whether vLLM counts it as text) of each prompt counted as the replica counts
    exact: list[tuple[int, bool]] = []
    if parsed.prompt_ids is not None:
        encoded = encoder.encode_ids(parsed.prompt_ids)
        exact.append((encoded.tokens, False))
    elif parsed.messages is not None and encoder.chat_template is not None:
        try:
            text = encoder.chat_template.render(parsed.messages)
        except Exception as e:  # the template's own raise_exception, or content it cannot render
            raise RequestError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        if window is not None:
            window.check_text(len(text))
        encoded = encoder.encode_text(text, chat=True)
        if encoder.tokenizer is not None:
            exact.append((encoded.tokens, True))
    else:
        encoded = encoder.encode_text(parsed.prompt, chat=parsed.messages is not None)
        if encoder.tokenizer is not None and parsed.messages is None:
            exact.append((encoded.tokens, True))
    extra_tokens = 0
    for prompt in parsed.extra_prompts or ():
        if isinstance(prompt, list):
            extra_tokens += len(prompt)
            exact.append((len(prompt), False))
        else:
            tokens = encoder.encode_text(prompt).tokens
            extra_tokens += tokens
            if encoder.tokenizer is not None:
                exact.append((tokens, True))
    if window is not None:
        for tokens, text in exact:
            window.check_prompt(tokens, text=text)
        for tokens, _ in exact:
            window.check_room(tokens, parsed.max_tokens)
    if not extra_tokens:
        return encoded
    return EncodedPrompt(encoded.chunk_hashes, encoded.tokens + extra_tokens)


class PromptCounter:
    """Counts and hashes prompts for the balancer's intake: short ones on the loop (they
    cost less than a thread hop), long ones in its worker threads, with a time bound."""

    def __init__(self, encoder: PromptEncoder, window: Callable[[], ContextWindow | None],
                 timeout_s: Callable[[], float]) -> None:
        self.encoder = encoder
        self._window = window
        self._timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=ENCODE_WORKERS, thread_name_prefix="skymesh-encode")

    async def count(self, parsed: ParsedRequest) -> EncodedPrompt:
        """The request's :class:`EncodedPrompt`, or the :class:`RequestError` that refuses it."""
        window = self._window()
        precheck(parsed, window, chat_template=self.encoder.chat_template is not None)
        size = len(parsed.prompt) + sum(len(x) for x in parsed.extra_prompts or ())
        if parsed.messages is not None and self.encoder.chat_template is not None:
            size += len(parsed.messages)  # rendering costs per message too
        if size <= OFF_LOOP_CHARS:
            return encode_request(self.encoder, parsed, window)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._pool, encode_request, self.encoder, parsed, window)
        try:
            return await asyncio.wait_for(work, self._timeout_s())
        except TimeoutError:
            raise RequestError(503, "the balancer could not count this prompt's tokens in time; retry later",
                               code="count_timeout") from None

    def close(self) -> None:
        """Stop the worker threads (a count under way ends first; queued ones are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
