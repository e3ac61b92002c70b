"""The OpenAI-compatible routes (and vLLM's extras), each a thin call into its family's serving class.

A route authorizes the caller (``ServingState.authorize``) and hands the parsed body to one serving
class (``Endpoints``); the work is there. The batch lane's, admin and dashboard routes are added by
their own modules (batches.py, admin.py, dashboard.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prism_serve import __version__
from prism_serve.api import schema as api_schema
from prism_serve.api.metrics import CONTENT_TYPE
from prism_serve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)
from prism_serve.api.serving import ServingState
from prism_serve.api.serving_chat import ChatServing, ResponsesServing
from prism_serve.api.serving_models import ModelServing
from prism_serve.api.serving_pooled import EmbeddingServing, ScoreServing
from prism_serve.api.serving_text import CompletionServing
from prism_serve.api.serving_tokens import TokenServing

__all__ = ["Endpoints", "add_openai_routes"]


@dataclass(frozen=True)
class Endpoints:
    """One serving class per route family, over one shared state."""

    chat: ChatServing
    completions: CompletionServing
    responses: ResponsesServing
    embeddings: EmbeddingServing
    scores: ScoreServing
    tokens: TokenServing
    models: ModelServing

    @classmethod
    def over(cls, state: ServingState, sources: dict[str, str]) -> Endpoints:
        """Every family over ``state``; ``sources``: each model's weights source (/v1/models)."""
        chat = ChatServing(state)
        return cls(
            chat, CompletionServing(state), ResponsesServing(state, chat), EmbeddingServing(state),
            ScoreServing(state), TokenServing(state, chat), ModelServing(state, sources),
        )  # fmt: skip


def add_openai_routes(
    app: FastAPI, state: ServingState, e: Endpoints, metrics_text: Callable[[], bytes]
) -> None:
    """The routes on ``app``; ``metrics_text``: /metrics' body (Prometheus text)."""

    @app.post("/v1/chat/completions", responses=api_schema.CHAT)
    async def chat(body: ChatCompletionRequest, http: Request) -> Response:
        state.authorize(http)
        return await e.chat.complete(http, body)

    @app.post("/v1/responses", responses=api_schema.RESPONSES)
    async def responses(http: Request) -> Response:
        state.authorize(http)
        return await e.responses.respond(http)

    @app.post("/v1/completions", responses=api_schema.COMPLETION)
    async def completions(body: CompletionRequest, http: Request) -> Response:
        state.authorize(http)
        return await e.completions.complete(http, body)

    @app.post("/v1/embeddings", responses=api_schema.EMBEDDINGS)
    async def embeddings(body: EmbeddingRequest, http: Request) -> Response:
        state.authorize(http)
        return await e.embeddings.embed(http, body)

    async def rerank(body: RerankRequest, http: Request) -> Response:
        state.authorize(http)
        return await e.scores.score(http, body)

    async def score(body: ScoreRequest, http: Request) -> Response:
        state.authorize(http)
        return await e.scores.score(http, body)

    # vLLM's paths for both (/v2/rerank: Cohere's client); the schema shows the /v1 ones
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.post(path, responses=api_schema.RERANK, include_in_schema=path == "/v1/rerank")(rerank)
    for path in ("/v1/score", "/score"):
        app.post(path, responses=api_schema.SCORE, include_in_schema=path == "/v1/score")(score)

    @app.get("/v1/models", responses=api_schema.MODELS)
    async def models(http: Request) -> dict:
        state.authorize(http)
        return {"object": "list", "data": e.models.cards(http)}

    @app.get("/v1/models/{model:path}", responses=api_schema.MODEL)
    async def model(model: str, http: Request) -> dict:
        state.authorize(http)
        return e.models.card(http, model)

    @app.post("/tokenize", responses=api_schema.TOKENIZE)
    async def tokenize(body: TokenizeRequest, http: Request) -> dict:
        state.authorize(http)
        return await e.tokens.tokenize(http, body)

    @app.post("/detokenize", responses=api_schema.DETOKENIZE)
    async def detokenize(body: DetokenizeRequest, http: Request) -> dict:
        state.authorize(http)
        return await e.tokens.detokenize(http, body)

    @app.get("/version", responses=api_schema.VERSION)
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/health", responses=api_schema.HEALTH)
    async def health() -> Response:
        ok = state.runtime.running
        return JSONResponse({"status": "ok" if ok else "starting"}, status_code=200 if ok else 503)

    @app.get("/metrics", responses=api_schema.METRICS)
    async def metrics() -> Response:
        return Response(metrics_text(), media_type=CONTENT_TYPE)
