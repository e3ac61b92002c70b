"""Per-request sampling parameters: one msgspec struct from the HTTP layer to the engine.

The API builds it once from the request body, the controller encodes it inside ``AddRequest``
(runtime/messages.py) and the worker decodes it straight into the struct the engine samples with.
It is validated when it is built and again when it is decoded (msgspec runs ``__post_init__``), so
no layer copies it field by field or keeps its own defaults.
"""

from __future__ import annotations

import json
import math

import msgspec

from prism_serve.errors import InvalidSamplingParamsError

# Integers cross the worker boundary as MessagePack int64 and seed a torch.Generator: both stop at 64 bits.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


MAX_LOGPROBS = 20  # alternatives per token, OpenAI's top_logprobs limit


def _is_int(v: object, lo: int = INT64_MIN, hi: int = INT64_MAX) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_float(v: object, lo: float, hi: float) -> bool:
    """A real number in [lo, hi]; NaN fails every comparison and so is refused too."""
    return isinstance(v, int | float) and not isinstance(v, bool) and lo <= v <= hi


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "grammar")


class StructuredOutput(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Output constrained to a language: at every step the engine masks the tokens that cannot
    continue it (engine/structured.py compiles it with llguidance) and ends the request when the
    language allows nothing more.

    ``kind``: ``json_object`` (any JSON object, ``spec`` unused), ``json_schema`` (``spec`` is the
    schema's JSON text), ``regex`` (``spec`` is the pattern, Rust regex syntax) or ``grammar``
    (``spec`` in Lark or GBNF).
    """

    kind: str
    spec: str = ""

    def validate(self) -> None:
        """What can be checked without a tokenizer; the engine compiles the rest when the request is added."""
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidSamplingParamsError(
                f"structured.kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str):
            raise InvalidSamplingParamsError(f"structured.spec must be a string, got {self.spec!r:.80}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise InvalidSamplingParamsError(f"structured.spec is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise InvalidSamplingParamsError("structured.spec must be a JSON schema object")
        elif self.kind in ("regex", "grammar") and not self.spec:
            raise InvalidSamplingParamsError(
                f"structured.spec must hold the {self.kind} for kind {self.kind}"
            )


POOLINGS = ("last", "mean", "cls")  # SamplingParams.pooling


class SamplingParams(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """How one request samples and when it stops.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` gives the request its own random stream, so its output does not depend on what else
    is in the batch. ``stop`` strings end the output (and are cut from it unless
    ``include_stop_str_in_output``); ``stop_token_ids`` end it like EOS does.

    Not frozen (like vLLM's): a field set after construction is checked again by ``validate()``,
    which the controller calls before it encodes the request.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Appended after the fields above: the struct is array_like, so a field's position is its name.
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = {}
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    # An embedding instead of tokens: the prompt's final hidden states pooled ("last": the last
    # token's; "mean": the average over its tokens; "cls": the first token's), in
    # RequestOutput.embedding once the prompt is computed.
    pooling: str | None = None
    # With pooling "last": the logits of these tokens at the last position instead of the hidden
    # state (a reranker's no and yes), in RequestOutput.embedding.
    score_tokens: tuple[int, ...] = ()
    # An encoder's pair (a cross-encoder's query and document): the position where the second
    # segment starts (token type 1 from there on); None: one segment.
    pair_start: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Normalize ``stop`` (one string -> a list) and raise InvalidSamplingParamsError for a bad value."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not _is_int(self.max_tokens, 1):
            raise InvalidSamplingParamsError(
                f"max_tokens must be a positive integer, got {self.max_tokens!r}"
            )
        if not isinstance(self.temperature, int | float) or not 0.0 <= self.temperature <= 100.0:
            raise InvalidSamplingParamsError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k, -1):
            raise InvalidSamplingParamsError(
                f"top_k must be -1, 0 (both disable it) or positive, got {self.top_k!r}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidSamplingParamsError(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidSamplingParamsError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t, 0):
                raise InvalidSamplingParamsError(
                    f"stop_token_ids must be non-negative 64-bit integers, got {t!r}"
                )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParamsError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        self._validate_processing()
        if self.pooling is not None:
            if self.pooling not in POOLINGS:
                raise InvalidSamplingParamsError(
                    f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}"
                )
            if self.logprobs is not None or self.prompt_logprobs is not None or self.structured is not None:
                raise InvalidSamplingParamsError(
                    "an embedding (pooling) has no logprobs or structured output"
                )
        if self.score_tokens:
            if self.pooling != "last" or not all(_is_int(t, 0) for t in self.score_tokens):
                raise InvalidSamplingParamsError(
                    "score_tokens are token ids read at the last position: they need pooling last"
                )
            self.score_tokens = tuple(self.score_tokens)
        if self.pair_start is not None and (self.pooling is None or not _is_int(self.pair_start, 1)):
            raise InvalidSamplingParamsError(
                f"pair_start is a positive position in a pooled pair, got {self.pair_start!r}"
            )

    def _validate_processing(self) -> None:
        if not _is_int(self.min_tokens, 0, self.max_tokens):
            raise InvalidSamplingParamsError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        rp = self.repetition_penalty
        if not _is_float(rp, 0.0, math.inf) or rp == 0.0 or not math.isfinite(rp):
            raise InvalidSamplingParamsError(f"repetition_penalty must be finite and > 0, got {rp!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_float(getattr(self, name), -2.0, 2.0):
                raise InvalidSamplingParamsError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not _is_float(self.min_p, 0.0, 1.0):
            raise InvalidSamplingParamsError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.logit_bias, dict):
            raise InvalidSamplingParamsError(
                f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}"
            )
        for t, bias in self.logit_bias.items():
            if not _is_int(t, 0):
                raise InvalidSamplingParamsError(
                    f"logit_bias keys must be non-negative integer token ids, got {t!r}"
                )
            if not _is_float(bias, -100.0, 100.0):
                raise InvalidSamplingParamsError(
                    f"logit_bias values must be in [-100, 100], got {bias!r} for token {t}"
                )
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise InvalidSamplingParamsError(
                    f"structured must be a StructuredOutput, got {type(self.structured).__name__}"
                )
            self.structured.validate()
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not _is_int(v, 0, MAX_LOGPROBS):
                raise InvalidSamplingParamsError(
                    f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether the logits change before temperature (bias, penalties, min_tokens): changes that
        can move the argmax. A greedy batch where no request has them is a plain argmax."""
        return bool(
            self.min_tokens
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
        )

    @property
    def stop_holdback(self) -> int:
        """Characters a stream must hold back: they may still turn out to start a stop string."""
        if self.include_stop_str_in_output or not self.stop:
            return 0
        return max(len(s) for s in self.stop) - 1
