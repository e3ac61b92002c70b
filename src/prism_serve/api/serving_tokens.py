"""vLLM's /tokenize and /detokenize (``TokenServing``): the ids a completion would see for a prompt
or for chat messages (rendered as the chat route renders them), and the text of ids."""

from __future__ import annotations

import asyncio

from fastapi import Request

from prism_serve.api.protocol import DetokenizeRequest, TokenizeRequest
from prism_serve.api.serving import Serving, ServingState
from prism_serve.api.serving_chat import ChatServing
from prism_serve.engine.validation import check_token_ids

__all__ = ["TokenServing"]


class TokenServing(Serving):
    """``POST /tokenize`` and ``/detokenize``; messages are read by ``chat``'s ``render``."""

    def __init__(self, state: ServingState, chat: ChatServing) -> None:
        super().__init__(state)
        self.chat = chat

    async def tokenize(self, http: Request, body: TokenizeRequest) -> dict:
        self.state.visible(http, body.model)
        ids = await asyncio.to_thread(self._ids, body)
        return {
            "count": len(ids),
            "max_model_len": self.state.served[body.model].max_model_len,
            "tokens": ids,
        }

    def _ids(self, body: TokenizeRequest) -> list[int]:
        tok = self.runtime.tokenizer(body.model)  # 404 for a model not served
        if body.messages is not None:
            # encoded as the chat route encodes it, so the count is what a completion will see
            return tok.encode(self.chat.render(body.model, body.messages, body.add_generation_prompt))
        return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)

    async def detokenize(self, http: Request, body: DetokenizeRequest) -> dict:
        self.state.visible(http, body.model)
        tok = self.runtime.tokenizer(body.model)  # 404 for a model not served
        check_token_ids(body.tokens, self.state.served[body.model].vocab_size, "tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens, False)}
