"""Whether a prompt may be run: the one definition of the prompt checks.

Every edge that takes a prompt (the HTTP layer, ``Controller.generate``, each engine's
``add_request``) calls ``check_prompt``, so a prompt is refused for the same reasons with the same
words wherever it comes in: no tokens (EmptyPromptError), a token id outside the vocabulary
(InvalidRequestError), more tokens than the context leaves for the output (PromptTooLongError). The
HTTP layer checks first, with the request's ``max_tokens`` and its parameter name, so that a client
sees a 400 before any work; the inner edges run the same check for their direct callers.
"""

from __future__ import annotations

from collections.abc import Sequence

from prism_serve.errors import EmptyPromptError, InvalidRequestError, PromptTooLongError

__all__ = ["check_prompt", "check_token_ids", "prompt_too_long"]


def prompt_too_long(
    max_len: int, num_tokens: int | str, max_tokens: int | None = None, param: str | None = None,
    limit: str = "",
) -> PromptTooLongError:  # fmt: skip
    """The error for a prompt of ``num_tokens`` (a number, or words such as "at least 900") that
    leaves no room for ``max_tokens`` (None: one token; 0: a pooled input, which generates none) in
    ``max_len``; ``limit`` says what sets ``max_len`` when it is not the context alone."""
    wanted = f" and max_tokens is {max_tokens}" if max_tokens else ""
    room = 1 if max_tokens is None else max_tokens
    return PromptTooLongError(
        f"this model's maximum context length is {max_len} tokens{limit}; the prompt has {num_tokens} "
        f"tokens{wanted}: at most {max_len - room} prompt tokens fit",
        param=param,
    )


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str | None = None) -> None:
    """Refuse any id that is not an int in ``[0, vocab_size)`` (an engine's kernels would index
    outside the embedding); ``param`` names the request field in the error."""
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token ids must be integers from 0 to below the vocabulary size {vocab_size}, got {bad[:5]}",
            param=param,
        )


def check_prompt(
    ids: Sequence[int], vocab_size: int | None, max_len: int, max_tokens: int | None = None,
    param: str | None = None, limit: str = "",
) -> None:  # fmt: skip
    """Refuse ``ids`` (a prompt's token ids) unless it has a token, every id is an int in the
    vocabulary, and ``max_tokens`` (None: at least one; 0 for a pooled input, which generates
    none) still fit in ``max_len`` after it.
    ``vocab_size`` None skips the scan of the ids (a caller on the serving loop, where the edge
    before it scanned them off the loop and the engine scans them again in its worker). ``param``
    names the request field in the error; ``limit`` as in ``prompt_too_long``."""
    if not ids:
        raise EmptyPromptError("prompt has no tokens", param=param)
    if vocab_size is not None:
        check_token_ids(ids, vocab_size, param)
    if len(ids) + (1 if max_tokens is None else max_tokens) > max_len:
        raise prompt_too_long(max_len, len(ids), max_tokens, param, limit)
