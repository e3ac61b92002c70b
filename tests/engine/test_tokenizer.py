from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prism_serve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from prism_serve.engine.weights import byte_tokenizer, default_gguf_path

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "naïve café, Straße, 東京タワー, ёжик",
    "emoji 😀👍🏽 and ZWJ 👨‍👩‍👧 family",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x**2  # square\n",
    "I'm sure they've done it; we'll see what's what.",
]


@pytest.fixture(scope="module")
def hf_gguf_tokenizer():
    """transformers' own converter of the GGUF tokenizer: an independent reference."""
    import transformers

    path = default_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_transformers_gguf_converter(smollm, hf_gguf_tokenizer, text):
    ours = smollm.tokenizer.encode(text)
    theirs = hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert ours == theirs
    assert smollm.tokenizer.decode(ours, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids_and_eos(smollm):
    tok = smollm.tokenizer
    assert tok.encode("<|im_start|>") == [1]
    assert tok.eos_token_ids == (2,)
    assert tok.decode([1, 28, 2]) == tok.decode([28])  # specials skipped by default


def test_chat_template_renders_chatml_with_default_system_prompt(smollm):
    text = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    own_system = smollm.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False,
    )
    assert own_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def stream(tokenizer, prompt_ids, ids) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detok.push(t) for t in ids] + [detok.flush()]


@pytest.mark.parametrize("text", [*TEXTS[3:5], "€100 — “quoted” ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"])
def test_incremental_detokenization_of_multibyte_characters(smollm, text):
    tok = smollm.tokenizer
    prompt = tok.encode("Say:")
    ids = tok.encode(text)
    pieces = stream(tok, prompt, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # Some character really spans tokens here: a token that yields no text on its own.
    singles = [tok.decode([t]) for t in ids]
    assert any("\ufffd" in s for s in singles)
    assert "" in pieces[:-1]


def test_incremental_detokenization_keeps_leading_space_after_prompt(smollm):
    tok = smollm.tokenizer
    prompt = tok.encode("The capital of France is")
    ids = tok.encode(" Paris, of course.")
    assert "".join(stream(tok, prompt, ids)) == " Paris, of course."


def test_flush_emits_incomplete_tail(smollm):
    tok = smollm.tokenizer
    ids = tok.encode("ok 😀")
    singles = [tok.decode([t]) for t in ids]
    cut = next(i for i, s in enumerate(singles) if "\ufffd" in s)
    pieces = stream(tok, [], ids[: cut + 1])
    assert "\ufffd" not in "".join(pieces[:-1])
    assert pieces[-1].endswith("\ufffd")
    assert "".join(pieces) == tok.decode(ids[: cut + 1])


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode())  # one token per UTF-8 byte, id == byte value
        assert tok.decode(ids) == text
    assert tok.decode([72, 100_000, 105]) == "Hi"  # ids a synthetic model samples past the bytes


# ---- SentencePiece vocabularies in GGUF files (Llama 2, Mistral, Phi-3, Gemma) --------------------

_SPM_TEXTS = [
    "Hello world",
    " leading space",
    "two  spaces and   three",
    "naïve café ☃ 日本語 🚀 (byte fallback for what has no piece)",
    "prism serve --config prism.yaml -> 1.26x, 2026-11-30",
    "\nnew\nlines\n\n",
    "tabs\tand\ttabs",
]


def _train_spm(tmp, prefix: bool):
    """A real SentencePiece BPE model trained on this repository's docs, with Llama's settings
    (identity normalization, whitespace kept, digits split, byte fallback); ``prefix``: the
    dummy space prefix Llama's vocabularies add and Gemma's do not. One user-defined piece, as
    Gemma's turn markers are."""
    import sentencepiece as spm

    root = Path(__file__).resolve().parents[2]
    corpus = tmp / "corpus.txt"
    corpus.write_text((root / "README.md").read_text() + (root / "docs" / "architecture.md").read_text())
    name = tmp / ("with-prefix" if prefix else "no-prefix")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(name), vocab_size=800, model_type="bpe", byte_fallback=True,
        character_coverage=0.9995, normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True, add_dummy_prefix=prefix,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2,
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_file=str(name) + ".model")


def _gguf_meta(sp, architecture: str, prefix: bool | None) -> dict:
    """The tokenizer keys llama.cpp's converter writes for a SentencePiece model (token types:
    1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte)."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        kind = 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
        types.append(4 if tokens[-1] in ("<start_of_turn>", "<end_of_turn>") else kind)
    meta = {
        "general.architecture": architecture, "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }  # fmt: skip
    if prefix is not None:
        meta["tokenizer.ggml.add_space_prefix"] = prefix
    return meta


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spm")
    return {prefix: _train_spm(tmp, prefix) for prefix in (True, False)}


@pytest.mark.parametrize(
    ("architecture", "prefix", "written"),
    [("llama", True, None), ("phi3", True, True), ("gemma3", False, False), ("gemma2", False, None)],
)
@pytest.mark.parametrize("text", _SPM_TEXTS)
def test_a_sentencepiece_vocabulary_encodes_as_sentencepiece_does(
    spm_models, architecture, prefix, written, text
):
    """Each text's ids are SentencePiece's own (after the BOS llama.cpp adds to these vocabularies),
    with and without the space prefix (a Llama file that does not say has one, a Gemma file not),
    and decode back to SentencePiece's text."""
    sp = spm_models[prefix]
    tok = Tokenizer.from_gguf_metadata(_gguf_meta(sp, architecture, written))
    want = sp.encode(text)
    assert tok.encode(text) == [1, *want]
    assert tok.encode(text, add_special_tokens=False) == want
    assert tok.decode(want) == sp.decode(want)


@pytest.mark.parametrize("prefix", [True, False])
def test_special_tokens_in_the_text_stay_whole_and_the_text_between_is_prefixed_as_llama_cpp_does(
    spm_models, prefix
):
    """A turn marker in a chat template's output is one token; each stretch of text between markers
    is encoded on its own, with the space prefix before it where the vocabulary has one (llama.cpp
    puts one after each special token)."""
    sp = spm_models[prefix]
    tok = Tokenizer.from_gguf_metadata(_gguf_meta(sp, "gemma3" if not prefix else "llama", None))
    start, end = sp.piece_to_id("<start_of_turn>"), sp.piece_to_id("<end_of_turn>")
    assert tok.one_token("<start_of_turn>") == start
    got = tok.encode("<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n")
    want = [1, start, *sp.encode("user\nhi there"), end, *sp.encode("\n"), start, *sp.encode("model\n")]
    assert got == want


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), max_size=40))
def test_any_text_encodes_as_sentencepiece_does(spm_models, text):
    sp = spm_models[True]
    tok = Tokenizer.from_gguf_metadata(_gguf_meta(sp, "llama", None))
    assert tok.encode(text, add_special_tokens=False) == sp.encode(text)


def test_incremental_detokenization_of_a_sentencepiece_vocabulary_keeps_its_spaces(spm_models):
    sp = spm_models[True]
    tok = Tokenizer.from_gguf_metadata(_gguf_meta(sp, "llama", None))
    prompt = tok.encode("The answer:")
    ids = tok.encode(" naïve café 日本 two  spaces", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert text.startswith(" ") and "two  spaces" in text


def test_a_gemma_gguf_file_with_a_sentencepiece_vocabulary_loads_and_generates(spm_models, tmp_path):
    """A synthetic Gemma 3 (random weights, SYNTHETIC) whose GGUF file carries a SentencePiece
    vocabulary, written with gguf-py: the loader reads the vocabulary, a text prompt encodes as
    SentencePiece encodes it, and the engine generates from it."""
    import dataclasses

    from prism_serve.engine.config import EngineConfig
    from prism_serve.engine.llm_engine import LLMEngine
    from prism_serve.engine.models.config import PRESETS
    from prism_serve.engine.sampling_params import SamplingParams
    from prism_serve.engine.weights import load_weights, random_weights
    from tests.engine.gguf_export import write_gguf

    sp = spm_models[False]
    config = dataclasses.replace(
        PRESETS["gemma-3-1b"], vocab_size=sp.get_piece_size(), hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, global_layers=(1,), sliding_window=16,
    )  # fmt: skip
    path = write_gguf(
        random_weights(config, seed=1), tmp_path / "gemma.gguf", _gguf_meta(sp, "gemma3", False)
    )
    loaded = load_weights(str(path))
    text = "The capital of France is"
    assert loaded.tokenizer.encode(text) == [1, *sp.encode(text)]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32"), weights=loaded)
    engine.add_request(text, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), "r")
    out = []
    while engine.has_unfinished_requests():
        out += [o for o in engine.step() if o.finished]
    assert len(out[0].token_ids) == 6 and isinstance(out[0].text, str)
