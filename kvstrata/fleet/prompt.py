"""What a router must tokenize of an OpenAI request, and how it asks a server to (pure).

A router hashes a prompt's tokens as the servers do (:mod:`kvstrata.fleet.hashes`), so it must
have the very tokens a server would compute: the same tokenizer, special tokens and, for a
chat, the same chat template. The one way that cannot drift is to ask a server: vLLM's
``POST /tokenize`` takes a completion's ``prompt`` or a chat's ``messages`` (with the template
options a chat request may carry) and answers ``{"tokens": [...]}``, as its own completions
would tokenize them. A completion given as token ids needs no asking.

:func:`tokenize_ask` reads a request body and says what to do: the tokens at once
(:class:`Tokens`) or the body of a ``/tokenize`` call (:class:`AskServer`). A body a server
would refuse for its prompt raises :class:`BadRequest`, one line, the front's 400. A batch of
prompts (a list of strings, or of token lists) is routed on its first: the batch goes to one
server.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Endpoint(enum.Enum):
    """The OpenAI endpoints the router fronts, by their path."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


class BadRequest(ValueError):
    """A request body that cannot be routed (the front's 400), one line."""


# A chat request's fields that change its tokens, passed on to /tokenize (vLLM's TokenizeChatRequest).
CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                        "chat_template_kwargs", "tools")


@dataclass(frozen=True)
class Tokens:
    """The prompt's tokens, known from the body itself."""

    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class AskServer:
    """The body of a server's ``POST /tokenize`` that gives the prompt's tokens."""

    body: dict[str, Any]


def tokenize_ask(endpoint: Endpoint, body: Any) -> Tokens | AskServer:
    """What gives ``body``'s prompt tokens (see the module text).

    Raises:
        BadRequest: not a JSON object, or no prompt / messages of a usable shape.
    """
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("a chat completion needs 'messages', a non-empty list")
        ask = {"messages": messages, **{k: body[k] for k in CHAT_TEMPLATE_FIELDS if k in body}}
        return AskServer({"model": model, **ask} if model is not None else ask)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not _token_ids(prompt):
        prompt = prompt[0]  # a batch: routed on its first prompt
    if isinstance(prompt, str):
        ask = {"prompt": prompt}
        if "add_special_tokens" in body:
            ask["add_special_tokens"] = body["add_special_tokens"]
        return AskServer({"model": model, **ask} if model is not None else ask)
    if isinstance(prompt, list) and prompt and _token_ids(prompt):
        return Tokens(tuple(prompt))
    raise BadRequest("a completion needs 'prompt': a string, a list of token ids, or a list of those")


def _token_ids(values: list) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def streams(body: dict[str, Any]) -> bool:
    """Whether the client asked for a streamed (SSE) answer."""
    return body.get("stream") is True
