"""Named errors shared by every layer.

Each error carries the HTTP status and OpenAI error ``type`` the API layer answers with, so a
bad request is reported the same way whether it came through Python or HTTP.
"""

from __future__ import annotations


class PrismError(Exception):
    """Base class of every error prism-serve raises on purpose; ``param``: the request parameter
    at fault, which the API's error body names."""

    status_code: int = 500
    error_type: str = "internal_error"
    param: str | None = None

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        if param is not None:
            self.param = param


def quoted(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: errors name what the client sent without echoing
    a megabyte of it back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 15]}... ({len(text)} chars)"


class ConflictError(PrismError):
    """The request contradicts the model's current state (e.g. load on one device while it is
    active on another)."""

    status_code = 409
    error_type = "conflict"


class InternalError(PrismError):
    """Something failed inside the server (a bug); the request was released, nothing else is affected."""


class InvalidRequestError(PrismError, ValueError):
    """The request itself is wrong; nothing about the server changed."""

    status_code = 400
    error_type = "invalid_request_error"


class EmptyPromptError(InvalidRequestError):
    """The prompt has no tokens."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the model's context or the engine's KV cache."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range (max_tokens <= 0, temperature < 0, ...)."""


class DuplicateRequestError(InvalidRequestError):
    """A request id that is already in flight was submitted again."""


class WeightsError(PrismError):
    """Model weights or tokenizer could not be loaded."""


class WeightsNotFoundError(WeightsError, FileNotFoundError):
    """The weights file or directory does not exist."""


class CorruptWeightsError(WeightsError):
    """The weights file exists but cannot be parsed or is inconsistent."""


class UnsupportedModelError(WeightsError):
    """The checkpoint is readable but uses an architecture or format we do not implement."""


class EngineDeadError(PrismError):
    """The engine loop stopped; requests in flight were failed with this error."""

    status_code = 503
    error_type = "service_unavailable"


class ModelEvictedError(PrismError):
    """The model was unloaded (forced eviction) while this request was in flight."""

    status_code = 503
    error_type = "service_unavailable"


class WorkerDiedError(PrismError):
    """The worker process serving this request died; the runtime has started a replacement."""

    status_code = 503
    error_type = "service_unavailable"


def error_class(name: str) -> type[PrismError]:
    """The PrismError subclass called ``name`` (errors cross process boundaries by name)."""
    todo: list[type[PrismError]] = [PrismError]
    while todo:
        cls = todo.pop()
        if cls.__name__ == name:
            return cls
        todo.extend(cls.__subclasses__())
    return PrismError
