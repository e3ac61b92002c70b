"""Per-request sampling parameters: one msgspec struct from the HTTP layer to the engine.

The API builds it once from the request body, the controller encodes it inside ``AddRequest``
(runtime/messages.py) and the worker decodes it straight into the struct the engine samples with.
It is validated when it is built and again when it is decoded (msgspec runs ``__post_init__``), so
no layer copies it field by field or keeps its own defaults.
"""

from __future__ import annotations

import msgspec

from prism_serve.errors import InvalidSamplingParamsError

# Integers cross the worker boundary as MessagePack int64 and seed a torch.Generator: both stop at 64 bits.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _is_int(v: object, lo: int = INT64_MIN, hi: int = INT64_MAX) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def stop_holdback(self) -> int:
        """Characters a stream must hold back: they may still turn out to start a stop string."""
        if self.include_stop_str_in_output or not self.stop:
            return 0
        return max(len(s) for s in self.stop) - 1
