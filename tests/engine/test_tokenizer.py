from __future__ import annotations

import pytest

from prism_serve.engine.tokenizer import IncrementalDetokenizer
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
