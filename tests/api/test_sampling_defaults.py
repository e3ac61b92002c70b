"""A model's sampling defaults in the request path (api/protocol.py): they fill what a request leaves
out, and never what it says, even where it says OpenAI's own default."""

from __future__ import annotations

from prism_serve.api.protocol import ChatCompletionRequest, CompletionRequest

DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 64}
MESSAGES = [{"role": "user", "content": "hi"}]


def test_defaults_fill_what_the_request_leaves_out():
    p = ChatCompletionRequest(model="m", messages=MESSAGES).sampling_params(16, defaults=DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.2, 0.9, 20, 1.1)
    assert p.max_tokens == 16  # max_tokens is the server's to resolve (capped by the context)


def test_the_request_wins_even_at_openais_default():
    body = ChatCompletionRequest(
        model="m", messages=MESSAGES, temperature=1.0, top_k=0, repetition_penalty=1.0
    )
    p = body.sampling_params(16, defaults=DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 0.9, 0, 1.0)


def test_no_defaults_are_openais():
    p = CompletionRequest(model="m", prompt="x").sampling_params(8)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 1.0, 0, 1.0)
