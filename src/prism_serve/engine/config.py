"""``EngineConfig``: the knobs of one engine, and the one home of their defaults.

Every layer that has an engine knob takes its default from here: the deployment config's model
entries (config.py), the runtime's ``ModelSpec`` (runtime/models.py), the ``ActivateModel`` message
that carries this struct to a worker (runtime/messages.py), and the simulator's ``SimConfig``
(sim/config.py). The struct's defaults are the live server's (a CPU device shared by several
models); ``GPU_ENGINE_DEFAULTS`` is the batch of a GPU engine, which the simulator's GPU profiles use.

No torch here: the deployment config and the simulator import this module without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from prism_serve.engine.models.config import ArchConfig
from prism_serve.errors import InvalidRequestError
from prism_serve.memory.kv_pool import PoolConfig

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_HF_ID",
    "DTYPE_NAMES",
    "ENGINE_DEFAULTS",
    "GPU_ENGINE_DEFAULTS",
    "VLLM_LORA_RANKS",
    "EngineConfig",
    "resolve_max_model_len",
]

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # its weights' home on the Hugging Face hub
DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16")  # engine.machine.resolve_dtype reads them
MAX_DEFAULT_CONTEXT = 8192  # max_model_len=None: the model's context, capped at this


# the ranks vLLM's LoRA slots can be built with (its LoRAConfig.max_lora_rank)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class EngineConfig(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Knobs of one engine (validated when built, and again when a worker decodes it)."""

    model: str = DEFAULT_MODEL  # weights source when the engine loads them itself
    dtype: str = "auto"  # bf16 where the CPU has native bf16 matmuls, else fp32 (engine/machine.py)
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 32  # requests in one batch
    max_num_batched_tokens: int = 512  # tokens per step; longer prompts are prefilled in chunks
    max_model_len: int | None = 2048  # prompt + output; None: the model's context, capped at 8192
    kv_cache_bytes: int = 512 * 2**20  # the fixed pool's size, or the elastic pool's virtual reservation
    num_kv_blocks: int | None = None
    # None: a fixed KV pool, allocated up front. A PoolConfig: KV pages mapped on demand under the
    # device ledger's shared budget (memory/kv_pool.py); kv_cache_bytes is then only address space.
    elastic_kv: PoolConfig | None = None
    seed: int = 0  # for requests without their own seed, and for random weights
    device: str = "cpu"  # where the engine computes: cpu, or cuda / cuda:N (a GPU; bf16 under dtype auto)
    max_loras: int = 0  # LoRA adapter slots beside the weights (engine/lora.py); 0: no adapters
    max_lora_rank: int = 16  # the largest adapter rank the slots hold
    # automatic prefix caching (engine/prefix_cache.py): full KV blocks kept and shared by content
    prefix_caching: bool = True
    # sliding-window layers (Gemma 2/3) keep KV blocks of their own and free those that left the
    # window (engine/kv_cache.py KVGroups); false: every block holds every layer, as for any model
    windowed_kv: bool = True
    # vLLM's engine only (engine/vllm_engine.py), which builds its pooler with the model: a pooling
    # model's engine, pooling "last", "mean" or "cls" (an embedder) or "classify" (a cross-encoder's
    # head); None: it generates. The built-in engine pools as each request says (SamplingParams).
    pooling: str | None = None
    # vLLM's engine, pooling "classify": a decoder reranker's (no, yes) token ids; vLLM builds it as a
    # one-output classifier whose weight is the LM head's yes row less its no row (its score,
    # sigmoid(logit(yes) - logit(no)), is the built-in engine's)
    score_tokens: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise InvalidRequestError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be positive")
        if not re.fullmatch(r"cpu(:\d+)?|cuda(:\d+)?", self.device):
            raise InvalidRequestError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise InvalidRequestError("num_kv_blocks must be positive")
        if self.max_loras < 0 or not 1 <= self.max_lora_rank <= 512:
            raise InvalidRequestError("max_loras must be >= 0 and max_lora_rank in 1..512")
        if self.pooling not in (None, "last", "mean", "cls", "classify"):
            raise InvalidRequestError(f"pooling must be last, mean, cls or classify, got {self.pooling!r}")
        if self.score_tokens is not None and self.pooling != "classify":
            raise InvalidRequestError("score_tokens are a decoder reranker's: they need pooling classify")

    def resolve_max_model_len(self, model: ArchConfig) -> int:
        return resolve_max_model_len(self.max_model_len, model)


def resolve_max_model_len(max_model_len: int | None, model: ArchConfig) -> int:
    """``max_model_len``, or the model's context capped at 8192; never beyond the context."""
    return within_context(max_model_len, model.max_position_embeddings)


def within_context(max_model_len: int | None, context: int) -> int:
    """``resolve_max_model_len`` for a model known by its context (``max_position_embeddings``)
    alone: vLLM's engine reads the rest of config.json itself."""
    return min(max_model_len or min(context, MAX_DEFAULT_CONTEXT), context)


ENGINE_DEFAULTS = EngineConfig()  # read by the layers that mirror a knob (config.py, runtime/models.py)

# A GPU engine's batch (vLLM's defaults): what the simulator's GPU profiles model (sim/config.py).
# With the CPU values above an H100 runs at most 32 requests a step, and that cap, not the policy,
# decides the simulated results under load (paper-8 at rate x16: every policy ~40.5% TTFT attainment).
GPU_ENGINE_DEFAULTS = msgspec.structs.replace(ENGINE_DEFAULTS, max_num_seqs=256, max_num_batched_tokens=8192)


# Qwen3-Reranker's prompt for a (query, document) pair, the default of a task: score model; the
# model answers with "yes" or "no" and the score is the probability of yes
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
QWEN3_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True, slots=True)
class PoolingTask:
    """A model that answers from its prompt's final hidden states rather than with text.

    ``embed``: the hidden states pooled (``pooling``: last, mean or cls) into a vector, L2-normalised
    if ``normalize``. ``score`` (a decoder reranker, /v1/rerank and /v1/score): ``template`` with a
    pair's ``{query}``, ``{document}`` and ``{instruction}`` filled in is the prompt, and the score is
    the probability of the second of ``tokens`` against the first (yes against no) as the next token,
    sigmoid(logit(yes) - logit(no)). A cross-encoder's score (``classifier``: a BERT-family encoder
    with a one-output classification head) is the sigmoid of that output for the pair as its
    tokenizer pairs it ([CLS] query [SEP] document [SEP]); it has no template or answer tokens."""

    task: str  # embed or score
    pooling: str = "last"
    normalize: bool = False
    template: str = QWEN3_RERANK_TEMPLATE
    instruction: str = QWEN3_RERANK_INSTRUCTION  # when the request names none
    tokens: tuple[str, str] = ("no", "yes")
    classifier: bool = False

    def prompt(self, query: str, document: str, instruction: str | None = None) -> str:
        """A score pair's prompt: each placeholder replaced once, so braces in the texts stay."""
        out, fill = [], {"query": query, "document": document, "instruction": instruction or self.instruction}
        for part in re.split(r"(\{query\}|\{document\}|\{instruction\})", self.template):
            out.append(fill.get(part[1:-1], part) if part.startswith("{") else part)
        return "".join(out)
