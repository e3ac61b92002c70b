"""Offline Python API: ``LLM(...).generate(prompts, SamplingParams)``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prism_serve.engine.llm_engine import EngineConfig, LLMEngine, Prompt
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.sequence import RequestOutput
from prism_serve.engine.weights import LoadedWeights


class LLM:
    """Runs a batch of prompts to completion on one engine.

    >>> llm = LLM()  # the default model: real SmolLM2-135M-Instruct
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(
        self,
        model: str | None = None,
        weights: LoadedWeights | None = None,
        engine: LLMEngine | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """``model`` and ``engine_kwargs`` fill an EngineConfig; ``weights`` reuses loaded weights;
        ``engine`` wraps an engine that already exists."""
        if engine is None:
            config = (
                EngineConfig(**engine_kwargs) if model is None else EngineConfig(model=model, **engine_kwargs)
            )
            engine = LLMEngine(config, weights=weights)
        self.engine = engine
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A prompt is text or a list of token ids.

        All prompts are validated before any is added, so a bad one raises and leaves the engine
        as it was."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        for seq in seqs:
            self.engine.add_sequence(seq)
        final: dict[str, RequestOutput] = {}
        while any(s.req_id not in final for s in seqs):
            for out in self.engine.step():
                if out.finished:
                    final[out.req_id] = out
            if self.engine.stalled:  # a shared device budget refuses blocks: wait for memory, don't spin
                time.sleep(0.005)
        return [final[s.req_id] for s in seqs]

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Like generate, for chat messages rendered with the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params)
