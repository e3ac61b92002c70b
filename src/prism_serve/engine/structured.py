"""Structured output: a request's JSON schema, regex or grammar compiled by llguidance into a
matcher that says, at every step, which tokens can continue the output.

llguidance works on the tokenizer's byte-level vocabulary (it reads the same ``tokenizers`` JSON
the engine tokenizes with), computes a token bitmask in Rust in about a millisecond, and keeps no
state beyond the matcher: so one compiler per engine, one matcher per request, and the engine
advances the matcher with each token it appends.
"""

from __future__ import annotations

import threading

import llguidance
import torch

from prism_serve.engine.sampling_params import StructuredOutput
from prism_serve.engine.tokenizer import Tokenizer
from prism_serve.errors import InvalidSamplingParamsError

_ANY_OBJECT = '{"type": "object"}'


class GrammarCompiler:
    """Builds matchers for one tokenizer. The llguidance tokenizer (a fraction of a second to
    build) is made on the first structured request, so engines that never see one never pay."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width, which the bitmask must cover
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # make_sequence may run on any thread

    def _ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(),
                    n_vocab=self._vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids),
                )
            return self._ll_tokenizer

    def matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher; InvalidSamplingParamsError naming the problem if the spec does not compile."""
        try:
            if structured.kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT)
            else:
                fmt = "json_schema" if structured.kind == "json_schema" else structured.kind
                grammar = llguidance.grammar_from(fmt, structured.spec)  # type: ignore[arg-type]
        except ValueError as e:
            raise InvalidSamplingParamsError(f"structured.spec does not compile: {e}") from None
        m = llguidance.LLMatcher(self._ll(), grammar, log_level=0)
        if m.is_error():
            raise InvalidSamplingParamsError(f"structured.spec does not compile: {m.get_error()}")
        return m


def allowed_tokens(matchers: list[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """[len(matchers), vocab_size] bool: the tokens each matcher accepts next (bit i of the
    bitmask's word i // 32 is token i)."""
    words = torch.stack(
        [torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32) for m in matchers]
    )
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(len(matchers), -1)[:, :vocab_size].bool()
