"""Tokenizer (``tokenizers`` library) built from GGUF metadata or an HF tokenizer.json, the chat
template rendered with jinja2, and incremental detokenization for streaming."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from prism_serve.errors import CorruptWeightsError, InvalidRequestError, UnsupportedModelError

# Pre-tokenizer split patterns of the byte-level BPE families found in GGUF files
# (``tokenizer.ggml.pre``); "smollm" is GPT-2's pattern with every digit split on its own.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Texts from this many characters on are encoded without holding the GIL, so a server thread
# tokenizing a long prompt leaves the event loop running.
_LONG_TEXT = 8192
_GGUF_NORMAL = 1  # llama.cpp's token types
_GGUF_UNKNOWN = 2
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default", "gpt-2"):
        return byte_level
    pattern = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if pattern is None:
        raise UnsupportedModelError(f"GGUF tokenizer pre-tokenizer {pre!r} is not supported")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _sentencepiece(meta: dict[str, Any], tokens: list[str], types: list[int]) -> HFTokenizer:
    """A GGUF file's SentencePiece vocabulary as a ``tokenizers`` BPE: spaces are U+2581, and a
    space is put before the text unless the file says not (``add_space_prefix``: Gemma's files).
    SentencePiece merges the adjacent pair whose joined piece scores highest; the same as BPE whose
    merges are every split of a normal token into two tokens, ranked by that token's score (by its
    place in the file for Gemma, whose scores do not follow its merge order). A character with no
    token falls back to its UTF-8 bytes' tokens (<0xNN>)."""
    gemma = str(meta.get("general.architecture", "")).startswith("gemma")
    if gemma:  # Gemma's files store a token of several spaces as spaces, not as U+2581s
        tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
    scores = meta.get("tokenizer.ggml.scores")
    if gemma or scores is None or len(scores) != len(tokens):
        scores = [-float(i) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for merged, (kind, score) in zip(tokens, zip(types, scores, strict=True), strict=True):
        if kind != _GGUF_NORMAL:  # control, byte and unknown tokens are never merged into
            continue
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                merges.append((-score, -len(left), -len(right), vocab[left], vocab[right], left, right))
    merges.sort()
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab, merges=[(m[5], m[6]) for m in merges], byte_fallback=True, fuse_unk=True,
            unk_token=tokens[int(unk)] if unk is not None else None,
        )
    )  # fmt: skip
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", not gemma))
    # spaces as U+2581, and the prefix before each stretch of text between special tokens, as
    # llama.cpp puts it (before the text's start, and again after each special token in it)
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    out = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*out, *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    return backend


def _wordpiece(meta: dict[str, Any], tokens: list[str], types: list[int]) -> HFTokenizer:
    """A GGUF file's BERT vocabulary (``tokenizer.ggml.model: bert``) as the WordPiece it was made
    from. llama.cpp's converter writes a word's first piece with a U+2581 in front and a
    continuation piece (``##x``) without its ``##``, control tokens as they are: each is read back
    to its WordPiece spelling. A BERT file does not say whether its vocabulary is cased; it is
    read uncased (lower case, accents stripped), as llama.cpp reads every such file and as the
    BERT embedders it converts (bge, gte, e5, MiniLM) were trained. Single inputs are put between
    [CLS] and [SEP], and pairs as BERT joins them (the second segment's tokens of type 1)."""
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        word = tok if kind == _GGUF_CONTROL else tok[1:] if tok.startswith("\u2581") else "##" + tok
        vocab.setdefault(word, i)

    def special(key: str, fallback: str) -> str:
        value = meta.get(key)
        if value is not None and 0 <= int(value) < len(tokens):
            return tokens[int(value)]
        if fallback not in vocab:
            raise CorruptWeightsError(f"GGUF BERT vocabulary has no {key} and no {fallback} token")
        return fallback

    unk = special("tokenizer.ggml.unknown_token_id", "[UNK]")
    cls_ = special("tokenizer.ggml.bos_token_id", "[CLS]")  # the converter writes [CLS] as BOS
    sep = special("tokenizer.ggml.seperator_token_id", "[SEP]")  # (sic: llama.cpp's key)
    backend = HFTokenizer(models.WordPiece(vocab=vocab, unk_token=unk))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{cls_}:0 $A:0 {sep}:0", pair=f"{cls_}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls_, vocab[cls_]), (sep, vocab[sep])],
    )  # fmt: skip
    return backend


def _unigram(meta: dict[str, Any], tokens: list[str], types: list[int]) -> HFTokenizer:
    """A GGUF file's SentencePiece unigram vocabulary (``tokenizer.ggml.model: t5``, as llama.cpp's
    converter writes XLM-RoBERTa's: bge-m3, bge-reranker-v2-m3): each piece with its score, the
    file's precompiled normalisation map (SentencePiece's NFKC rules), spaces as U+2581 with one
    before each word unless the file says not (``add_space_prefix``), runs of spaces as one where
    it says so (``remove_extra_whitespaces``). Single inputs are put between its BOS and EOS
    (``<s> A </s>``), pairs as RoBERTa joins them (``<s> A </s></s> B </s>``, all of type 0)."""
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise CorruptWeightsError("GGUF unigram vocabulary has no score for every token")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    if unk is None:
        unk = next((i for i, kind in enumerate(types) if kind == _GGUF_UNKNOWN), None)
    backend = HFTokenizer(
        models.Unigram([(t, float(x)) for t, x in zip(tokens, scores, strict=True)], unk_id=unk)
    )
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        backend.normalizer = normalizers.Precompiled(list(bytes(charsmap)))
    prefix = "always" if meta.get("tokenizer.ggml.add_space_prefix", True) else "never"
    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prefix)
    squeeze = meta.get("tokenizer.ggml.remove_extra_whitespaces", True)
    split = [pre_tokenizers.WhitespaceSplit()] if squeeze else []
    backend.pre_tokenizer = pre_tokenizers.Sequence([*split, metaspace])
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=prefix)
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    if bos is None or eos is None:
        raise CorruptWeightsError("GGUF unigram vocabulary of an encoder has no BOS or EOS token")
    first, last = tokens[int(bos)], tokens[int(eos)]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}", pair=f"{first} $A {last} {last} $B {last}",
        special_tokens=[(first, int(bos)), (last, int(eos))],
    )  # fmt: skip
    return backend


def _raise_template_error(message: str) -> None:
    raise InvalidRequestError(f"chat template: {message}")


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and stop tokens."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None
        self._max_token_chars: int | None = None

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF header describes: byte-level BPE (``tokenizer.ggml.model`` gpt2:
        Llama 3, Qwen, SmolLM2), a SentencePiece vocabulary (llama: Llama 2, Mistral, Phi-3,
        Gemma), BERT's WordPiece (bert: the BERT embedders) or a SentencePiece unigram (t5:
        XLM-RoBERTa's), with the file's control and user-defined tokens kept whole."""
        kind = meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama", "bert", "t5"):
            raise UnsupportedModelError(
                f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2', SentencePiece "
                "'llama' and unigram 't5', BERT's WordPiece 'bert'; serve the model's HF directory instead)"
            )
        tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if not tokens or len(types) != len(tokens):
            raise CorruptWeightsError("GGUF tokenizer vocabulary is missing or inconsistent")
        if kind == "llama":
            backend = _sentencepiece(meta, tokens, types)
            add_bos = meta.get("tokenizer.ggml.add_bos_token", True)  # llama.cpp's default for these
        elif kind in ("bert", "t5"):  # its post-processor adds [CLS] and [SEP], or <s> and </s>
            backend, add_bos = (_wordpiece if kind == "bert" else _unigram)(meta, tokens, types), False
        else:
            vocab = {tok: i for i, tok in enumerate(tokens)}
            merges_raw: list[str] = meta.get("tokenizer.ggml.merges") or []
            merges = [tuple(m.split(" ", 1)) for m in merges_raw]
            backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
            backend.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
            backend.decoder = decoders.ByteLevel()
            add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
        specials = [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind_ in zip(tokens, types, strict=True)
            # a BERT file's user-defined tokens carry the converter's U+2581: read as WordPiece;
            # a unigram encoder's <unk> is one of its special tokens, as its HF tokenizer has it
            if kind_ == _GGUF_CONTROL
            or (kind_ == _GGUF_USER_DEFINED and kind != "bert")
            or (kind_ == _GGUF_UNKNOWN and kind == "t5")
        ]
        backend.add_special_tokens(specials)
        if kind in ("bert", "t5"):  # an encoder never generates, so it has no stop tokens
            return cls(backend, bos_token_id=None, eos_token_ids=[], add_bos=False, chat_template=None)
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        return cls(
            backend,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(e) for e in eos],
            add_bos=bool(add_bos),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    def to_state(self) -> dict[str, Any]:
        """Everything needed to rebuild this tokenizer in another process (plain JSON types)."""
        return {
            "backend": self.backend.to_str(),
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "add_bos": self.add_bos,
            "chat_template": self.chat_template,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Tokenizer:
        return cls(
            HFTokenizer.from_str(state["backend"]),
            bos_token_id=state["bos_token_id"],
            eos_token_ids=state["eos_token_ids"],
            add_bos=state["add_bos"],
            chat_template=state["chat_template"],
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise CorruptWeightsError(f"{path} has no tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:
            raise CorruptWeightsError(f"cannot parse {tok_file}: {e}") from e
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        eos = gen.get("eos_token_id")
        eos_ids = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
        if not eos_ids and token_id(cfg.get("eos_token")) is not None:
            eos_ids = [token_id(cfg.get("eos_token"))]
        bos = gen.get("bos_token_id", token_id(cfg.get("bos_token")))
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        # tokenizer.json's own post-processor decides about BOS; we add none ourselves.
        return cls(backend, bos_token_id=bos, eos_token_ids=eos_ids, add_bos=False, chat_template=template)

    # ---- use ------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < _LONG_TEXT:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        else:  # encode() holds the GIL throughout (0.5 s for 650 KB); encode_batch releases it
            ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], int | None]:
        """A pair as the tokenizer's post-processor joins it (BERT: [CLS] first [SEP] second [SEP]),
        and where its second segment starts (token type 1 from there; None where the tokenizer gives
        every token type 0, as RoBERTa's does)."""
        enc = self.backend.encode(first, second)
        return enc.ids, enc.type_ids.index(1) if 1 in enc.type_ids else None

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` that costs no tokenization, so an oversized prompt
        is refused at once. Each token stands for at most as many characters as its vocabulary
        string has (byte-level BPE: one character per byte); with a normalizer (which may drop
        characters) no bound is claimed (0)."""
        if self.backend.normalizer is not None:
            return 0
        if self._max_token_chars is None:
            self._max_token_chars = max(1, *map(len, self.backend.get_vocab(with_added_tokens=True)))
        return len(text) // self._max_token_chars

    def one_token(self, text: str) -> int | None:
        """The id of ``text`` as one token: a vocabulary entry of that name, else the one token it
        encodes to; None when it is several."""
        found = self.backend.token_to_id(text)
        if found is not None:
            return found
        ids = self.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def special_ids(self, texts: Iterable[str]) -> dict[str, int]:
        """The id of each of ``texts`` that is one special token of this vocabulary (a token the
        detokenizer drops unless told to keep special tokens)."""
        special = {t.content: i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        return {t: special[t] for t in texts if t in special}

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:  # fmt: skip
        """The prompt text of ``messages`` (and ``tools``, for a template that reads them), rendered
        as transformers renders chat templates: its ``tojson`` (plain JSON, not HTML-escaped),
        ``strftime_now`` and ``raise_exception``."""
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template)
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError("each chat message needs a 'role' and a 'content'")
        bos = self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        extra = {"tools": tools} if tools else {}
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos,
            **extra,
        )  # fmt: skip


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CorruptWeightsError(f"cannot parse {path}: {e}") from e


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks characters whose UTF-8 bytes span several tokens, and decoding
    the whole list each time is quadratic. We decode a short window: the text of
    ``ids[prefix:read]`` is already emitted, the text of ``ids[prefix:]`` minus it is new, and a new
    piece ending in U+FFFD (an incomplete byte sequence) is held back until the next token
    completes it.
    """

    __slots__ = ("_ids", "_prefix", "_read", "_skip_special", "_tokenizer")

    _CONTEXT = 6  # prompt tokens kept as left context, so the first output token decodes as in context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-self._CONTEXT :])
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], self._skip_special)
        full_text = decode(self._ids[self._prefix :], self._skip_special)
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd")):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        return delta
