"""Tokenizer, shards (reader + integrity), data/local/prepare.py and data/fineweb_edu/prepare.py (against a local
fake Hub). Tiny tokenizers (vocab a few hundred) so the whole file runs in seconds on CPU."""

import os
import random
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tokenizer as tokmod  # noqa: E402

SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def f(x):\n    return x * 2  # double\n\n",
    "Unicode: 日本語のテキスト, 中文, 한국어, emoji 🎉🐍👩‍👩‍👧, accents é à ü ñ.",
    "numbers 1234567890 3.14159 and symbols <|bos|> <|user|> {}[]()",
    "control \x00 NUL \x01\x02\x7f tabs\t\tand\r\nnewlines\n",
] * 20


@pytest.fixture(scope="module")
def tok():
    return tokmod.train_tokenizer(SAMPLE_TEXTS, 400)


def random_text(rng, n):
    # mix of ASCII, control chars (NUL included), CJK, emoji and other planes; valid code points only
    pools = [(0, 0x80), (0, 0x20), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF), (0x80, 0x800), (0xE000, 0x10FFFF)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(pools)
        c = rng.randrange(lo, hi)
        if 0xD800 <= c <= 0xDFFF:
            c = 0x41
        out.append(chr(c))
    return "".join(out)


def test_tokenizer_roundtrip_unicode_and_id0_never_emitted(tok):
    rng = random.Random(0)
    texts = [random_text(rng, rng.randrange(0, 60)) for _ in range(300)] + SAMPLE_TEXTS[:5]
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert 0 not in ids
        assert all(0 < i < tok.bos_id for i in ids)
    for batch_ids, text in zip(tok.encode_batch(texts, num_threads=2), texts):
        assert batch_ids == tok.encode(text)
    # every single byte: as a 1-char string (bytes 0..127) and inside raw byte sequences (latin-1 chars)
    for b in range(256):
        ids = tok.encode(chr(b))
        assert 0 not in ids and tok.decode(ids) == chr(b)
        assert tok.enc.encode_single_token(bytes([b])) == b + 1  # raw byte b is id b + 1, never 0
    assert tok.encode("\x00") == [1]  # the NUL byte is id 1: ranks are shifted by one


def test_tokenizer_specials_not_produced_from_text(tok):
    text = "<|bos|><|system|><|user|><|assistant|><|end|>"
    ids = tok.encode(text)
    assert not set(ids) & set(tok.special_ids.values())
    assert tok.decode(ids) == text
    assert set(tok.special_ids) == {"<|bos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"}
    assert tok.bos_id == tok.special_ids["<|bos|>"]
    assert max(tok.special_ids.values()) < tok.vocab_size == 400
    assert tok.decode([tok.bos_id]) == "<|bos|>"
    with pytest.raises(ValueError):
        tok.decode([0])


def test_tokenizer_save_load_hash(tok, tmp_path):
    import hashlib

    p = tmp_path / "tokenizer.json"
    tok.save(p)
    assert hashlib.sha256(p.read_bytes()).hexdigest() == tok.hash
    tok2 = tokmod.Tokenizer.load(p)
    assert tok2.hash == tok.hash and tok2.vocab_size == tok.vocab_size and tok2.special_ids == tok.special_ids
    for t in SAMPLE_TEXTS[:5]:
        assert tok2.encode(t) == tok.encode(t)
    # missing and corrupt files: ValueError, one line, naming the file
    for bad in [tmp_path / "missing.json", tmp_path / "corrupt.json", tmp_path / "truncated.json"]:
        if bad.name == "corrupt.json":
            bad.write_bytes(b"\x80not json")
        if bad.name == "truncated.json":
            bad.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
        with pytest.raises(ValueError) as e:
            tokmod.Tokenizer.load(bad)
        assert str(bad) in str(e.value) and "\n" not in str(e.value)


def test_tokenizer_vocab_bounds():
    with pytest.raises(ValueError):
        tokmod.train_tokenizer(["abc"], 100)
    with pytest.raises(ValueError):
        tokmod.train_tokenizer(["abc"], 70000)
