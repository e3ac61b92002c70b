"""Pooled answers: /v1/embeddings (``EmbeddingServing``), /v1/rerank and /v1/score (``ScoreServing``).

Each input (an embedding's text, a reranker's query and document) is one request to the model's
engine, batched there with the model's others, answered by its one delta: the pooled vector, the
score tokens' logits (a decoder reranker), or a cross-encoder's head output (float32 bytes).
``PooledServing.pooled`` is the part they share.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from prism_serve.api.choices import Choice, ClientDisconnected
from prism_serve.api.protocol import EmbeddingRequest, RerankRequest, ScoreRequest, new_id, usage
from prism_serve.api.request_log import LogEntry
from prism_serve.api.serving import Served, Serving, tenant_of
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.validation import check_prompt, prompt_too_long
from prism_serve.errors import InternalError, InvalidRequestError, PrismError

__all__ = ["EmbeddingServing", "PooledServing", "ScoreServing"]


class PooledServing(Serving):
    """What embeddings and scores share: each input one request, answered by one pooled delta."""

    async def pooled(
        self, http: Request, model: str, task: str, inputs: Callable[[], list[list[int]]],
        params: Callable[[Served, int], SamplingParams], arrival: float, entry: LogEntry | None,
    ) -> tuple[list[list[int]], list[bytes]] | None:  # fmt: skip
        """An embed or score request (``task``): ``inputs`` tokenized in a thread, then each one
        request to the model's engine (``params(served, i)`` its settings), answered by its one
        delta. None: the client went away."""
        try:
            self.runtime.tokenizer(model)  # 404 before any work
            served = self.state.served[model]
            served.refuse(model, task)
            prompts = await asyncio.to_thread(inputs)
            num_prompt = sum(len(ids) for ids in prompts)
            if entry is not None:
                entry.prompt_tokens = num_prompt
            self.check_waiting(http, len(prompts))
            rid = new_id("embd" if task == "embed" else task)
            runs, slos = [], self.slos(http, served)
            quotas = self.reserve(http, [len(ids) for ids in prompts])
            for i, (ids, quota) in enumerate(zip(prompts, quotas, strict=True)):
                req_id = rid if len(prompts) == 1 else f"{rid}-{i}"
                stream = self.generate(http, model, ids, params(served, i), req_id, slos)
                # each input shares the request's deadline; the request is judged once, below
                runs.append(Choice(rid, model, arrival, stream, index=i, prompt=i, max_tokens=1,
                                   num_prompt=len(ids), slos=None, quota=quota))  # fmt: skip
            try:
                await self.first_deltas(http, runs)
            finally:
                for run in runs:
                    await run.stream.aclose()
                if entry is not None:
                    entry.served(runs, num_prompt, arrival)
            self.metrics.on_request(model, 1, len(prompts))
            if slos is not None:  # its SLO kind: the latency of the whole request, all inputs answered
                met = self.metrics.on_latency(model, max(r.first_at for r in runs) - arrival, slos[0])
                tenant = tenant_of(http)
                if tenant is not None:
                    tenant.judge((met, met))
            out = []
            for run in runs:
                if run.last is None or run.last.embedding is None:  # an engine that does not pool
                    raise InternalError(f"model {model!r} answered without its pooled output")
                out.append(run.last.embedding)
        except ClientDisconnected:
            return None
        except PrismError as e:
            self.count_error(model, e, http)
            raise
        return prompts, out


class EmbeddingServing(PooledServing):
    """``POST /v1/embeddings``: each input's vector pooled by the engine, cut to ``dimensions`` and
    normalised here."""

    async def embed(self, http: Request, body: EmbeddingRequest) -> Response:
        self.admit(http, body.model)
        self.note_ignored(body)
        # max_tokens 1: prism plan reads it as a prompt-only request
        entry = self.log_entry(http, body.model, False, len(body.inputs), 1, task="embed")
        return await self.logged(entry, self._embed(http, body, time.perf_counter(), entry))

    async def _embed(
        self, http: Request, body: EmbeddingRequest, arrival: float, entry: LogEntry | None
    ) -> Response:
        model = body.model
        done = await self.pooled(
            http, model, "embed", lambda: self._inputs(body),
            lambda served, _: SamplingParams(max_tokens=1, temperature=0.0, pooling=served.pooled.pooling),
            arrival, entry,
        )  # fmt: skip
        if done is None:
            return Response(status_code=499)
        prompts, pooled = done
        served = self.state.served[model]
        assert served.pooled is not None
        data = []
        for i, raw in enumerate(pooled):
            vector = np.frombuffer(raw, dtype="<f4")[: body.dimensions]
            if served.pooled.normalize:
                vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
            vector = vector.astype("<f4")
            shown = (
                base64.b64encode(vector.tobytes()).decode()
                if body.encoding_format == "base64"
                else vector.tolist()
            )
            data.append({"object": "embedding", "index": i, "embedding": shown})
        num_prompt = sum(len(ids) for ids in prompts)
        return JSONResponse(
            {"object": "list", "data": data, "model": model,
             "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt}}
        )  # fmt: skip

    def _inputs(self, body: EmbeddingRequest) -> list[list[int]]:
        """Each input's token ids, checked against the model's vocabulary and context (400s)."""
        tok = self.runtime.tokenizer(body.model)
        served = self.state.served[body.model]
        if body.dimensions is not None and body.dimensions > served.hidden_size:
            raise InvalidRequestError(
                f"dimensions must be at most the model's {served.hidden_size}", param="dimensions"
            )
        out = []
        for text in body.inputs:
            ids = tok.encode(text) if isinstance(text, str) else text
            if not ids:
                raise InvalidRequestError("an input encodes to no tokens", param="input")
            check_prompt(ids, served.vocab_size, served.max_model_len, 0, param="input")
            out.append(ids)
        return out


class ScoreServing(PooledServing):
    """``POST /v1/rerank`` and ``/v1/score``: each (query, document) pair one request. A decoder
    reranker reads the pair's prompt (the model's template) and its score is the probability of the
    yes token against the no token as the next one; a cross-encoder reads the pair as its tokenizer
    joins it, and its score is the sigmoid of its head's output."""

    async def score(self, http: Request, body: RerankRequest | ScoreRequest) -> Response:
        self.admit(http, body.model)
        self.note_ignored(body)
        entry = self.log_entry(http, body.model, False, len(body.pairs()), 1, task="score")
        return await self.logged(entry, self._score(http, body, time.perf_counter(), entry))

    async def _score(
        self, http: Request, body: RerankRequest | ScoreRequest, arrival: float, entry: LogEntry | None
    ) -> Response:
        model = body.model
        starts: list[int | None] = []  # a cross-encoder's pairs: where each one's second segment starts

        def params(served: Served, i: int) -> SamplingParams:
            if served.pooled is not None and served.pooled.classifier:
                return SamplingParams(max_tokens=1, temperature=0.0, pooling="cls", pair_start=starts[i])
            return SamplingParams(
                max_tokens=1, temperature=0.0, pooling="last", score_tokens=served.score_ids
            )

        done = await self.pooled(
            http, model, "score", lambda: self._inputs(body, starts), params, arrival, entry
        )
        if done is None:
            return Response(status_code=499)
        prompts, pooled = done
        scores = []
        for raw in pooled:
            logits = np.frombuffer(raw, dtype="<f4").astype(np.float64)
            # a decoder reranker's (no, yes): sigmoid(yes - no); a cross-encoder's one output: sigmoid
            margin = logits[1] - logits[0] if len(logits) == 2 else logits[0]
            scores.append(1.0 / (1.0 + math.exp(min(-margin, 700.0))))
        num_prompt = sum(len(ids) for ids in prompts)
        if isinstance(body, ScoreRequest):
            return JSONResponse(
                {"id": new_id("score"), "object": "list", "created": int(time.time()), "model": model,
                 "data": [{"index": i, "object": "score", "score": v} for i, v in enumerate(scores)],
                 "usage": usage(num_prompt, 0)}
            )  # fmt: skip
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
        texts = body.texts
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": texts[i]}
            results.append(result)
        return JSONResponse(
            {"id": new_id("rerank"), "model": model, "results": results,
             "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt}}
        )  # fmt: skip

    def _inputs(self, body: RerankRequest | ScoreRequest, starts: list[int | None]) -> list[list[int]]:
        """Each pair's prompt as token ids (a document cut to ``max_tokens_per_doc`` first), checked
        against the model's context (400s); a cross-encoder's pair as its tokenizer joins it, with
        where its second segment starts appended to ``starts``."""
        tok = self.runtime.tokenizer(body.model)
        served = self.state.served[body.model]
        task = served.pooled
        assert task is not None
        out = []
        for query, document in body.pairs():
            if body.max_tokens_per_doc:
                kept = tok.encode(document, add_special_tokens=False)[: body.max_tokens_per_doc]
                document = tok.decode(kept)
            if task.classifier:
                ids, start = tok.encode_pair(query, document)
                starts.append(start)
            else:
                ids = tok.encode(task.prompt(query, document, body.instruction))
            if len(ids) > served.max_model_len:
                raise prompt_too_long(
                    served.max_model_len, f"{len(ids)} (a query and document; max_tokens_per_doc cuts "
                    "documents)", param="documents",
                )  # fmt: skip
            out.append(ids)
        return out
