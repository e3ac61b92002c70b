"""The deployment config: one YAML file says which devices, which models, which policy and how the
server listens. Validated with pydantic (``extra="forbid"`` everywhere), so a typo is an error that
names the key and its line instead of a setting silently ignored.

::

    devices:                      # or: {count: 2, memory: 3GiB}  (CPU devices splitting the cores)
      - {name: cpu:0, memory: 3GiB, cores: "0", workers: 2}
      - {name: cpu:1, memory: 3GiB, cores: "1"}
    models:
      - {name: smollm2, source: smollm2-135m-instruct, ttft_slo: 2.0, tpot_slo: 0.25, pinned: true}
      - {name: tiny-360m, source: "random:smollm2-360m", max_model_len: 1024, keep_alive: 5m,
         sampling: {temperature: 0.2, top_p: 0.9}}   # defaults for requests that do not say
    policy: {name: prism, knobs: {tau: 0.1}}
    server: {host: 127.0.0.1, port: 8000, api_keys: [sk-local], admin_key: admin-secret,
             cors: {allow_origins: ["https://ui.example"]}}
    ray: {address: auto}          # optional: every node of a Ray cluster runs the devices above

``load_config(path)`` reads a file, ``default_config()`` is what ``prism serve`` runs with no file.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Container
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from prism_serve.control.types import DEFAULT_TPOT_SLO_S, DEFAULT_TTFT_SLO_S, PLACEMENT_COALESCE_S
from prism_serve.engine.config import (
    DEFAULT_MODEL,
    ENGINE_DEFAULTS,
    VLLM_LORA_RANKS,
    EngineConfig,
    PoolingTask,
)
from prism_serve.engine.machine import resolve_dtype
from prism_serve.errors import InvalidRequestError, PrismError
from prism_serve.memory.vmm import parse_size

__all__ = [
    "ConfigError",
    "DeploymentConfig",
    "DeviceConfig",
    "ModelConfig",
    "PolicyConfig",
    "RayConfig",
    "SamplingDefaults",
    "ServerConfig",
    "default_config",
    "load_config",
    "parse_config",
]


class ConfigError(InvalidRequestError):
    """The deployment config is invalid (the message names the key and, for files, the line)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Size = Annotated[int, Field(gt=0)]


def _size(value: Any) -> Any:
    return parse_size(value) if isinstance(value, str) else value


WORKERS = 2  # pre-started engine processes per device (runtime/workers.py), unless a device says

# Sampling settings, as requests (api/protocol.py) and per-model defaults take them
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1, le=2**63 - 1)]  # 0 or -1: off (vLLM's -1, OpenAI's absence)
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # presence, frequency
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=100.0)]


class SamplingDefaults(_Strict):
    """A model's sampling settings for requests that leave them out (a value in the request wins).
    Unset here: the model's ``generation_config.json`` value where its source directory has one
    (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens; ``do_sample:
    false`` as temperature 0), else OpenAI's default (temperature 1, top_p 1, no top_k)."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    max_tokens: int | None = Field(None, ge=1, description="when a request sets no max_tokens")


class DeviceConfig(_Strict):
    name: str = Field(pattern=r"^(cpu|cuda):\d+$", description="cpu:N or cuda:N")
    memory: Size = Field(description="budget shared by every model on the device, e.g. 3GiB")
    cores: str | list[int] | None = Field(None, description="CPU devices: cores, e.g. '0-3' (default: all)")
    workers: int = Field(WORKERS, ge=1, description="pre-started engine processes")

    _memory = field_validator("memory", mode="before")(_size)


class DeviceGroup(_Strict):
    """``count`` CPU devices that split this machine's cores evenly."""

    count: int = Field(ge=1)
    memory: Size
    workers: int = Field(WORKERS, ge=1, description="pre-started engine processes per device")

    _memory = field_validator("memory", mode="before")(_size)


class ModelConfig(_Strict):
    name: str = Field(
        min_length=1,
        pattern=r"^[^\s#]([^#]*[^\s#])?$",
        description="what clients ask for (no '#': replica slots are named model#k)",
    )
    source: str = Field(
        DEFAULT_MODEL,
        description="smollm2-135m-instruct (real weights), random:<preset> (synthetic), a .gguf file "
        "or a safetensors (HF layout) directory",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        ENGINE_DEFAULTS.dtype, description="auto: bfloat16 on CPUs with native bf16 matmuls, else float32"
    )
    tp: int = Field(
        1,
        ge=1,
        description="tensor parallel degree: the model over this many devices of one node (built-in "
        "engine; its KV is fixed at activation)",
    )
    ttft_slo: float = Field(DEFAULT_TTFT_SLO_S, gt=0, description="seconds")
    tpot_slo: float = Field(DEFAULT_TPOT_SLO_S, gt=0, description="seconds")
    latency_slo: float | None = Field(
        None,
        gt=0,
        description="embed and score: seconds from a request's arrival until every one of its inputs "
        "is answered (its SLO kind: one latency for the whole batch of inputs, each input's deadline "
        "in admission); unset: ttft_slo",
    )
    pinned: bool = Field(False, description="activated at start-up and never evicted by the policy")
    expected_rate: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="requests/s this model is expected to get (prism plan writes the rate of the traffic "
        "it planned on): until a whole rate window of its arrivals has been seen, the unseen part counts "
        "at this rate, so start-up placement follows the expected load; unset: arrivals alone",
    )
    keep_alive: float | None = Field(
        None,
        description="evict after this long idle, whatever the policy: seconds or 30s / 5m / 1h; "
        "-1: never for being idle; unset: the policy decides",
    )
    # engine knobs: defaults from engine.config.EngineConfig, their one home
    max_model_len: int | None = Field(
        ENGINE_DEFAULTS.max_model_len, ge=2, description="prompt + output; null: the model's context"
    )
    max_num_seqs: int = Field(ENGINE_DEFAULTS.max_num_seqs, ge=1)
    max_num_batched_tokens: int = Field(ENGINE_DEFAULTS.max_num_batched_tokens, ge=16)
    block_size: int = Field(ENGINE_DEFAULTS.block_size, ge=1)
    prefix_caching: bool = Field(
        ENGINE_DEFAULTS.prefix_caching,
        description="keep full KV blocks after their requests and reuse them for prompts that start "
        "the same (cached blocks are the first memory given back)",
    )
    kv_limit: Size | None = None
    seed: int = Field(ENGINE_DEFAULTS.seed, ge=0, description="synthetic weights")
    tool_parser: Literal["hermes", "llama3_json", "mistral", "json"] | None = Field(
        None, description="the format its tool calls are read in; unset: the one its chat template teaches"
    )
    sampling: SamplingDefaults | None = Field(
        None, description="defaults for requests that leave them out, over its generation_config.json"
    )
    engine: Literal["builtin", "vllm"] = Field(
        "builtin",
        description="builtin: prism's engine; vllm: vLLM's engine inside a prism worker (source: a "
        "local directory vLLM loads; needs vllm_python)",
    )
    base: str | None = Field(
        None, description="a LoRA adapter: the model (another entry) it runs over, in the same batches"
    )
    adapter: str | None = Field(
        None, description="a LoRA adapter's PEFT directory (adapter_config.json, adapter_model.safetensors)"
    )
    max_loras: int | None = Field(
        None, ge=0, le=1024,
        description="a base model: adapter slots beside its weights on a device (adapters in use at once); "
        "unset: 8 if it has adapters in the config, else 0 (set it to register adapters at run time)",
    )  # fmt: skip
    max_lora_rank: int = Field(
        16, ge=1, le=512, description="a base model: the largest adapter rank its slots hold"
    )
    task: Literal["generate", "embed", "score"] = Field(
        "generate",
        description="generate: chat, completions and responses; embed: /v1/embeddings (a decoder "
        "embedding model such as Qwen3-Embedding, or a BERT-family encoder such as bge, gte or e5); "
        "score: /v1/rerank and /v1/score (a cross-encoder such as bge-reranker: the sigmoid of its "
        "head's output for the pair; or a decoder reranker such as Qwen3-Reranker: the probability of "
        "yes against no after the pair's prompt); both run on either engine",
    )
    pooling: Literal["last", "mean", "cls"] | None = Field(
        None,
        description="embed: the final hidden state of the last token, their mean, or the first "
        "token's; unset: what its sentence-transformers files say, else last",
    )
    normalize: bool | None = Field(
        None,
        description="embed: L2-normalise the vectors; unset: as its sentence-transformers files say "
        "(a Normalize module), else true",
    )
    score_template: str | None = Field(
        None,
        description="score: a (query, document) pair's prompt, with {query}, {document} and "
        "{instruction} in it; unset: Qwen3-Reranker's",
    )
    score_instruction: str | None = Field(
        None,
        description="score: the {instruction} of a request that names none; unset: Qwen3-Reranker's "
        "(a web search query and the passages that answer it)",
    )
    score_tokens: tuple[str, str] | None = Field(
        None,
        description="score: the answer tokens [no, yes], one token each in the model's vocabulary; the "
        "score is sigmoid(logit(yes) - logit(no)); unset: [no, yes]",
    )

    _kv_limit = field_validator("kv_limit", mode="before")(_size)

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        return parse_duration(v) if isinstance(v, str) else v

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive(cls, v: float | None) -> float | None:
        if v is not None and (math.isnan(v) or (v < 0 and v != -1)):
            raise ValueError("keep_alive must be >= 0 seconds, or -1 for never")
        return v

    @model_validator(mode="after")
    def _adapter_entry(self) -> ModelConfig:
        if (self.base is None) != (self.adapter is None):
            raise ValueError(f"model {self.name}: an adapter entry needs both base and adapter")
        if self.base is not None:
            # (by value: a config dumped and validated again has every field set)
            own = {
                f for f, info in type(self).model_fields.items()
                if f not in ADAPTER_FIELDS and getattr(self, f) != info.default
            }  # fmt: skip
            if own:
                raise ValueError(
                    f"model {self.name}: an adapter runs with its base's engine; {', '.join(sorted(own))} "
                    f"belong on the base ({self.base})"
                )
        return self

    @property
    def is_adapter(self) -> bool:
        return self.base is not None

    @field_validator("score_tokens", mode="before")
    @classmethod
    def _quoted_tokens(cls, v: Any) -> Any:
        if isinstance(v, list | tuple) and any(isinstance(t, bool) for t in v):
            raise ValueError('quote them: YAML reads a bare yes or no as true or false (["no", "yes"])')
        return v

    @model_validator(mode="before")
    @classmethod
    def _latency_slo(cls, data: Any) -> Any:
        """A pooled model's latency SLO is its requests' deadline: the TTFT SLO admission, placement
        and the simulator hold each of its inputs to (they answer with their one output)."""
        if not isinstance(data, dict) or data.get("latency_slo") is None:
            return data
        if data.get("task", "generate") == "generate":
            raise ValueError(
                f"model {data.get('name')}: latency_slo is for task: embed or score (a generating model "
                "has ttft_slo and tpot_slo)"
            )
        if data.get("ttft_slo") not in (None, data["latency_slo"]):
            raise ValueError(f"model {data.get('name')}: give latency_slo or ttft_slo, not both")
        return {**data, "ttft_slo": data["latency_slo"]}

    @model_validator(mode="after")
    def _pooling_task(self) -> ModelConfig:
        if self.task != "embed" and (self.pooling is not None or self.normalize is not None):
            raise ValueError(f"model {self.name}: pooling and normalize are for task: embed")
        scoring = [f for f in ("score_template", "score_instruction", "score_tokens") if getattr(self, f)]
        if self.task != "score" and scoring:
            raise ValueError(f"model {self.name}: {', '.join(scoring)} are for task: score")
        if self.score_tokens is not None and (
            not all(self.score_tokens) or self.score_tokens[0] == self.score_tokens[1]
        ):
            raise ValueError(f"model {self.name}: score_tokens are two different tokens, [no, yes]")
        return self

    def pooling_task(self) -> PoolingTask | None:
        """What a task: embed or score model answers with; None for a generating model. An embedder
        pools as the config says, else as its sentence-transformers files say
        (engine.sources.embedding_defaults), else the last token's state (an encoder's first),
        normalised; a decoder reranker scores the last token's logits, a cross-encoder (a BERT-family
        classifier) its head's one output. A task the weights cannot do is a ConfigError."""
        from prism_serve.engine.sources import embedding_defaults, encoder_head, pooling_shape

        try:
            encoder, head = False, None
            if self.engine == "builtin":
                head = encoder_head(self.source)
                encoder = head is not None
            elif self.task != "generate":
                encoder, head = pooling_shape(self.source)
            found = embedding_defaults(self.source) if self.task == "embed" else {}
        except (ValueError, PrismError) as e:
            raise ConfigError(f"model {self.name}: {e}") from None
        if self.engine == "builtin" and head is not None:
            self._check_encoder_task(head)
        elif self.engine == "vllm" and self.task != "generate":
            self._check_vllm_task(encoder, head)
        if self.task == "score":
            if head:
                return PoolingTask("score", pooling="cls", classifier=True)
            defaults = PoolingTask("score")
            return PoolingTask(
                "score", template=self.score_template or defaults.template,
                instruction=self.score_instruction or defaults.instruction,
                tokens=self.score_tokens or defaults.tokens,
            )  # fmt: skip
        if self.task != "embed":
            return None
        pooling = self.pooling or str(found.get("pooling", "cls" if encoder else "last"))
        normalize = self.normalize if self.normalize is not None else bool(found.get("normalize", True))
        return PoolingTask("embed", pooling, normalize)

    def _check_encoder_task(self, head: int) -> None:
        """An encoder (``head`` outputs of a classification head, 0 for an embedder) embeds or,
        with a one-output head, scores pairs; it never generates."""
        what = f"{self.source} is a BERT-family {'cross-encoder' if head else 'embedding model'}"
        if self.task == "generate":
            raise ConfigError(
                f"model {self.name}: {what}; it cannot generate (task: {'score' if head else 'embed'})"
            )
        if self.task == "embed" and head:
            raise ConfigError(f"model {self.name}: {what}: it scores pairs (task: score)")
        if self.task == "score" and head != 1:
            raise ConfigError(
                f"model {self.name}: {what}" + (" with no classification head (task: embed)" if not head
                else f" with {head} outputs; a score reads one")
            )  # fmt: skip
        used = [f for f in ("score_template", "score_instruction", "score_tokens") if getattr(self, f)]
        if used:
            raise ConfigError(f"model {self.name}: {', '.join(used)} are a decoder reranker's; {what}")

    def _check_vllm_task(self, encoder: bool, head: int | None) -> None:
        """What vLLM's engine pools here: an embedder (no classification head), a cross-encoder (a
        one-output head) or a decoder reranker (a decoder without a head: its yes/no logits)."""
        where = f"model {self.name}: {self.source}"
        if self.task == "embed" and head is not None:
            raise ConfigError(f"{where} has a classification head: it scores pairs (task: score)")
        if self.task == "score" and head is None and encoder:
            raise ConfigError(f"{where} is an encoder with no classification head: it embeds (task: embed)")
        if self.task == "score" and head is not None and head != 1:
            raise ConfigError(f"{where}'s classification head has {head} outputs; a score reads one")

    @model_validator(mode="after")
    def _vllm_source(self) -> ModelConfig:
        if self.engine == "vllm" and not Path(self.source).expanduser().is_dir():
            raise ValueError(f"engine vllm loads a local model directory; {self.source!r} is not one")
        return self

    def sampling_defaults(self) -> dict[str, float | int]:
        """The sampling settings a request that leaves them out gets: ``sampling``'s, over the
        model's generation_config.json (HF directories) where it has one."""
        from prism_serve.engine.sources import generation_defaults

        try:
            found = generation_defaults(self.source)
        except ValueError as e:
            raise ConfigError(f"model {self.name}: {e}") from None
        found.update(self.sampling.model_dump(exclude_none=True) if self.sampling else {})
        try:  # generation_config.json's values are checked as the config's are
            return SamplingDefaults(**found).model_dump(exclude_none=True)
        except ValidationError as e:
            bad = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise ConfigError(f"model {self.name}: sampling defaults from {self.source}: {bad}") from None

    def engine_config(self, device_kind: str = "cpu", max_loras: int = 0) -> EngineConfig:
        """The knobs this model's engine runs with (``dtype: auto`` resolved for ``device_kind``:
        bf16 on GPUs, the CPU's fast type on CPU devices). An embedder whose entry leaves
        ``max_model_len`` unset reads at most its sentence-transformers ``max_seq_length``."""
        max_len = self.max_model_len
        if self.task == "embed" and "max_model_len" not in self.model_fields_set:
            from prism_serve.engine.sources import embedding_defaults

            try:
                found = embedding_defaults(self.source).get("max_length")
            except ValueError as e:
                raise ConfigError(f"model {self.name}: {e}") from None
            if isinstance(found, int) and max_len is not None:
                max_len = min(max_len, found)
        return EngineConfig(
            model=self.name,
            dtype=resolve_dtype(self.dtype, device_kind),
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_len,
            seed=self.seed,
            max_loras=max_loras,
            max_lora_rank=self.max_lora_rank,
            prefix_caching=self.prefix_caching,
            **self._vllm_pooling(),
        )

    def _vllm_pooling(self) -> dict[str, Any]:
        """EngineConfig.pooling and score_tokens: how vLLM's engine is built for this model (none:
        the built-in engine, or a model that generates). A decoder reranker's answer tokens must be
        one token each of its vocabulary."""
        task = self.pooling_task() if self.engine == "vllm" else None
        if task is None:
            return {}
        if task.task == "embed":
            return {"pooling": task.pooling}
        if task.classifier:
            return {"pooling": "classify"}
        from prism_serve.engine.tokenizer import Tokenizer

        no, yes = score_token_ids(self.name, task, Tokenizer.from_hf_dir(Path(self.source).expanduser()))
        return {"pooling": "classify", "score_tokens": (no, yes)}


def score_token_ids(model: str, task: PoolingTask, tokenizer: Any) -> tuple[int, ...]:
    """A decoder reranker's answer tokens (no, yes) as ids of ``tokenizer`` (engine/tokenizer.py's
    ``one_token``); a ConfigError names one that is not one token."""
    ids = []
    for text in task.tokens:
        found = tokenizer.one_token(text)
        if found is None:
            raise ConfigError(
                f"model {model}: score token {text!r} is not one token of its vocabulary; set "
                "score_tokens to its no and yes tokens"
            )
        ids.append(found)
    return tuple(ids)


# what an adapter entry may set (the rest is its base's)
ADAPTER_FIELDS = {"name", "base", "adapter", "ttft_slo", "tpot_slo"}


class PolicyConfig(_Strict):
    name: str = "prism"
    knobs: dict[str, Any] = Field(default_factory=dict)
    tick_interval_s: float = Field(0.5, gt=0)
    placement_thread: bool = Field(
        True,
        description="decide each tick's placement on a thread of its own, off the event loop that "
        "serves the token streams (runtime/controller.py); false: on the event loop",
    )
    placement_coalesce_s: float = Field(
        PLACEMENT_COALESCE_S,
        ge=0,
        le=60,
        description="the placement that follows a finished activation waits this long, so that "
        "activations finishing meanwhile share one (control/loop.py); 0: at once",
    )
    activation_timeout_s: float = Field(60.0, gt=0)
    spare_pages: bool = Field(
        True,
        description="keep weight pages mapped between models and make them ahead of time, so an "
        "activation copies instead of creating pages (memory/spare.py); reclaimable, counted as free",
    )
    prepare_workers: bool = Field(
        True,
        description="idle pooled workers map the host cache files and parse the tokenizers ahead of "
        "any activation, so a fresh worker's first activation is only a copy (runtime/workers.py); "
        "an idle vLLM worker also builds vLLM's engine for the most requested (else most shared) shape",
    )
    kept_prefix_bytes: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="host memory for the prefix-cached KV of evicted models, in all, e.g. 2GiB: an "
        "evicted model's hottest cached prefixes are kept there and restored at its next activation "
        "(engine/kept_prefixes.py); default a tenth of the host cache directory (/dev/shm); 0 keeps none",
    )

    _kept_prefix_bytes = field_validator("kept_prefix_bytes", mode="before")(_size)

    @model_validator(mode="after")
    def _known(self) -> PolicyConfig:
        from prism_serve.control.policies import POLICIES, knobs_for

        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}; choose one of {', '.join(sorted(POLICIES))}")
        fields = {f.name for f in dataclasses.fields(knobs_for(self.name))}
        unknown = sorted(set(self.knobs) - fields)
        if unknown:
            raise ValueError(
                f"unknown knob(s) {', '.join(unknown)} for policy {self.name}; "
                f"known: {', '.join(sorted(fields))}"
            )
        return self


class CorsConfig(_Strict):
    """Cross-origin access for browser clients (Open WebUI's direct connections, web playgrounds)."""

    allow_origins: list[str] = Field(default_factory=lambda: ["*"], description='e.g. ["https://ui.example"]')
    allow_credentials: bool = False
    allow_methods: list[str] = Field(default_factory=lambda: ["*"])
    allow_headers: list[str] = Field(default_factory=lambda: ["*"])


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_keys: list[str] = Field(default_factory=list, description="empty: no authentication")
    admin_key: str | None = Field(
        None, description="needed by /v1/admin/*; unset: admin only without api_keys or keys_file"
    )
    keys_file: str | None = Field(
        None,
        description="tenants: a YAML file of keys (as sha256 hashes, `prism hash-key`), the models each "
        "may call and its limits (api/tenants.py); read again when it changes or on SIGHUP",
    )
    max_waiting_requests: int = Field(256, ge=1, description="requests not yet streaming; beyond: 429")
    request_timeout_s: float = Field(120.0, gt=0, description="wait for the first token (queue + activation)")
    max_request_bytes: Size = Field(
        8 * 2**20, description="largest request body, e.g. 8MiB; larger ones get 413 before being read"
    )
    namespace: str | None = Field(None, description="ledger / host cache namespace (default per user)")
    cors: CorsConfig | None = Field(None, description="CORS for browser clients; unset: no CORS headers")
    request_log: str | None = Field(
        None,
        description="write one JSON line per finished request here (no prompt or output text; "
        "api/request_log.py): what prism plan reads; unset: no log",
    )
    request_log_max_bytes: Size = Field(64 * 2**20, description="rotate the request log at this size")
    request_log_keep: int = Field(5, ge=0, description="rotated request logs kept (.1 the newest)")
    state_dir: str | None = Field(
        None,
        description="the batch lane's files, batches and results (an SQLite database, api/batch_store.py); "
        "unset: /v1/files and /v1/batches are off",
    )
    batch_concurrency: int = Field(8, ge=1, description="batch lines running at once, over all batches")
    batch_idle_s: float = Field(
        5.0, ge=0, description="a batch line loads a model that is not active only after this long "
        "without an interactive request (or once half its window is gone)"
    )  # fmt: skip
    max_file_bytes: Size = Field(200 * 2**20, description="largest file upload (/v1/files), e.g. 200MiB")

    _max_request_bytes = field_validator("max_request_bytes", mode="before")(_size)
    _request_log_max_bytes = field_validator("request_log_max_bytes", mode="before")(_size)
    _max_file_bytes = field_validator("max_file_bytes", mode="before")(_size)


class RayConfig(_Strict):
    """Serve on the devices of every node of a Ray cluster (runtime/cluster.py): each node runs the
    ``devices`` section on its own machine, as ``<node>/cpu:0`` and so on."""

    address: str = Field(
        "auto", description="Ray cluster address: auto (this machine's running cluster) or host:port"
    )
    poll_interval_s: float = Field(0.5, gt=0, description="how often each node agent is polled")


class DeploymentConfig(_Strict):
    devices: list[DeviceConfig] | DeviceGroup
    models: list[ModelConfig] = Field(min_length=1)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    ray: RayConfig | None = Field(None, description="unset: this machine's devices only")
    vllm_python: str | None = Field(
        None,
        description="Python of an environment with vLLM, for models with engine: vllm (default: "
        "$PRISM_VLLM_PYTHON, else .venv-vllm-server/bin/python as scripts/vllm-server-env.sh makes it)",
    )
    vllm_compile: bool = Field(
        True,
        description="the engine an idle vLLM worker builds ahead of activations (policy.prepare_workers) "
        "is compiled with torch.compile: faster steps, for a longer build (about 55 s for a 135M model "
        "on 2 CPU cores, 20 s once vLLM's compile cache holds the shape); an activation that comes "
        "meanwhile waits for it. An engine built inside an activation is always eager",
    )

    @model_validator(mode="after")
    def _unique(self) -> DeploymentConfig:
        for what, names in (
            ("model", [m.name for m in self.models]),
            ("device", [d.name for d in self.devices] if isinstance(self.devices, list) else []),
        ):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"duplicate {what} name(s): {', '.join(dup)}")
        if isinstance(self.devices, list) and not self.devices:
            raise ValueError("devices: need at least one")
        return self

    @model_validator(mode="after")
    def _adapter_bases(self) -> DeploymentConfig:
        by_name = {m.name: m for m in self.models}
        for m in self.models:
            if m.base is None:
                continue
            base = by_name.get(m.base)
            if base is None:
                raise ValueError(f"model {m.name}: base {m.base!r} is not a model of this config")
            if base.is_adapter:
                raise ValueError(f"model {m.name}: base {m.base!r} is itself an adapter")
            if base.max_loras == 0:
                raise ValueError(f"model {m.name}: base {m.base!r} has max_loras: 0 (no adapter slots)")
        for m in self.models:
            if m.engine == "vllm" and self.max_loras(m) and m.max_lora_rank not in VLLM_LORA_RANKS:
                raise ValueError(
                    f"model {m.name}: max_lora_rank {m.max_lora_rank}; vLLM builds adapter slots of rank "
                    f"{', '.join(map(str, VLLM_LORA_RANKS))}"
                )
        return self

    @model_validator(mode="before")
    @classmethod
    def _adapter_slos(cls, data: Any) -> Any:
        """An adapter entry's SLOs it leaves out are its base entry's (read before validation, so
        that each entry is validated once, with its values)."""
        if not isinstance(data, dict) or not isinstance(data.get("models"), list):
            return data
        entries = {
            m.get("name"): m for m in data["models"] if isinstance(m, dict) and isinstance(m.get("name"), str)
        }
        models = []
        for m in data["models"]:
            base = (
                entries.get(m.get("base")) if isinstance(m, dict) and isinstance(m.get("base"), str) else None
            )
            if base is not None:
                m = {**{k: base[k] for k in ("ttft_slo", "tpot_slo") if k in base}, **m}
            models.append(m)
        return {**data, "models": models}

    def served_models(self) -> list[ModelConfig]:
        """The models with engines of their own (adapters run on their bases')."""
        return [m for m in self.models if not m.is_adapter]

    def adapters(self) -> list[ModelConfig]:
        return [m for m in self.models if m.is_adapter]

    def adapters_by_base(self) -> dict[str, list[ModelConfig]]:
        """The config's adapters under the model each runs over, in config order."""
        out: dict[str, list[ModelConfig]] = {}
        for a in self.adapters():
            out.setdefault(a.base or "", []).append(a)
        return out

    def max_loras(self, model: ModelConfig, bases: Container[str] | None = None) -> int:
        """Adapter slots of a base: its max_loras, else 8 if the config gives it adapters, else 0.
        ``bases``: ``adapters_by_base()``, for a caller asking of every model."""
        if model.max_loras is not None:
            return model.max_loras
        return 8 if model.name in (self.adapters_by_base() if bases is None else bases) else 0

    def with_overrides(
        self,
        host: str | None = None,
        port: int | None = None,
        policy: str | None = None,
        ray_address: str | None = None,
        request_log: str | None = None,
    ) -> DeploymentConfig:
        """This config with command-line overrides (a new policy name starts from its default knobs),
        validated again."""
        data = self.model_dump()
        if ray_address is not None:
            data["ray"] = {**(data.get("ray") or {}), "address": ray_address}
        overrides = (("host", host), ("port", port), ("request_log", request_log))
        data["server"].update({k: v for k, v in overrides if v is not None})
        if policy is not None:
            data["policy"].update(name=policy, knobs={})
        try:
            return DeploymentConfig.model_validate(data)
        except ValidationError as e:
            raise ConfigError(_describe(e, None, "command line")) from None


def parse_duration(text: str) -> float:
    """'90', '30s', '5m', '1.5h' (or '-1') as seconds."""
    t = text.strip().lower()
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(t[-1:]) if t else None
    try:
        return float(t[:-1]) * scale if scale else float(t)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (seconds, or a number with s, m or h)") from None


def default_config() -> DeploymentConfig:
    """What ``prism serve`` runs with no file: two CPU devices splitting this machine's cores, the
    real SmolLM2-135M-Instruct under three names (with different SLOs; they share one host copy of
    the weights) and two synthetic-weight models of real shapes (labelled synthetic in /v1/models).

    The real model decodes greedily unless a request says otherwise: measured on six short factual
    questions, 16 answers each (benchmarks/sampling_defaults.py), greedy answered 100% right,
    its authors' temperature 0.2 / top_p 0.9 85%, OpenAI's temperature 1 46%."""
    greedy = SamplingDefaults(temperature=0.0)
    return DeploymentConfig(
        devices=DeviceGroup(count=2, memory=parse_size("2GiB")),
        models=[
            ModelConfig(name="smollm2-135m-instruct", ttft_slo=2.0, tpot_slo=0.25, sampling=greedy),
            ModelConfig(name="smollm2-chat", ttft_slo=2.0, tpot_slo=0.25, sampling=greedy),
            ModelConfig(name="smollm2-batch", ttft_slo=10.0, tpot_slo=1.0, sampling=greedy),
            ModelConfig(name="synthetic-smollm2-360m", source="random:smollm2-360m",
                        ttft_slo=4.0, tpot_slo=0.5, max_model_len=1024),
            ModelConfig(name="synthetic-smollm2-135m", source="random:smollm2-135m", seed=1,
                        ttft_slo=4.0, tpot_slo=0.5, max_model_len=1024),
        ],
    )  # fmt: skip


def load_config(path: str | os.PathLike) -> DeploymentConfig:
    """Read and validate a YAML deployment config; ConfigError names the file, key and line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror or e}") from None
    return parse_config(text, str(path))


def parse_config(text: str, where: str = "<config>") -> DeploymentConfig:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the config must be a mapping with devices, models, policy, server")
    try:
        return DeploymentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, root, where)) from None


def _describe(error: ValidationError, root: yaml.Node | None, where: str) -> str:
    lines = [f"{where}: invalid config"]
    errors = error.errors()
    # Of a union (a list of devices or a device group) report only the shape that was meant,
    # unless no shape fits at all.
    wrong = [_wrong_shape(e) for e in errors]
    fits = {_union_base(e["loc"]) for e, w in zip(errors, wrong, strict=True) if not w}
    shown: set[tuple] = set()
    for err, w in zip(errors, wrong, strict=True):
        base = _union_base(err["loc"])
        if w and (base in fits or base in shown):
            continue
        shown.add(base)
        loc = [p for p in err["loc"] if not _is_union_tag(p)]
        key = ".".join(str(p) for p in loc) or "(top level)"
        line = _line_of(root, loc)
        at = f" (line {line})" if line else ""
        message = (
            "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        )
        if w:
            message = f"wrong type ({type(err['input']).__name__}); see the example in prism_serve/config.py"
        lines.append(f"  {key}{at}: {message}")
    return "\n".join(lines)


_WRONG_SHAPE = {"dict_type", "model_type", "list_type", "model_attributes_type"}


def _wrong_shape(err: Any) -> bool:
    return bool(err["loc"]) and _is_union_tag(err["loc"][-1]) and err["type"] in _WRONG_SHAPE


def _union_base(loc: tuple) -> tuple:
    for i, part in enumerate(loc):
        if _is_union_tag(part):
            return tuple(loc[:i])
    return tuple(loc)


def _is_union_tag(part: Any) -> bool:
    # pydantic names the union member it tried ("list[DeviceConfig]", "DeviceGroup"): not a YAML key.
    return isinstance(part, str) and (part[:1].isupper() or "[" in part)


def _line_of(node: yaml.Node | None, loc: list[Any]) -> int | None:
    """1-based line of the YAML node at ``loc`` (a key's own line for mapping entries)."""
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(part):
                    line, node = k.start_mark.line + 1, v
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line
