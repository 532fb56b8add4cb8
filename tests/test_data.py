"""Tokenizer, shards (reader + integrity), data/local/prepare.py and data/fineweb_edu/prepare.py (against a local
fake Hub). Tiny tokenizers (vocab a few hundred) so the whole file runs in seconds on CPU."""

import json
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


def test_a_vocab_past_uint16_is_refused(tok):
    """DESIGN.md: shards hold uint16 tokens, so every id must be < vocab_size <= 65535, refused before training."""
    with pytest.raises(ValueError, match="65535"):
        tokmod.train_tokenizer(["never trained"], 65536)
    with pytest.raises(ValueError, match="65535"):
        tokmod.Tokenizer(tok.pattern, tok.token_bytes, 65536)
    assert tokmod.Tokenizer(tok.pattern, tok.token_bytes, 65535).vocab_size == 65535


def test_a_million_spaces_in_a_row_encode_and_train(tok):
    """~1M whitespace characters in one document overflowed the Rust pre-split regex's stack: a PanicException
    (a BaseException no handler caught) ended a whole prepare run, and tokenizer training, with a backtrace."""
    texts = ["a" + " " * 1_100_000 + "b", "x" + "\t\xa0" * 600_000 + "y z", "short"]
    for t in texts:
        ids = tok.encode(t)
        assert tok.decode(ids) == t and 0 not in ids
    assert [tok.decode(ids) for ids in tok.encode_batch(texts)] == texts
    ordinary = "some text " * 10_000  # no long run: one piece, the same ids as before
    assert tokmod.split_long_spaces(ordinary) == [ordinary] and tok.encode(ordinary) == tok.enc.encode_ordinary(ordinary)
    assert tokmod.train_tokenizer(["hello world " * 50, texts[0]], 300).vocab_size == 300


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
    assert tok.id_to_bytes(tok.bos_id) == b"<|bos|>" and tok.id_to_bytes(1) == tok.token_bytes[0]
    for bad in (0, tok.vocab_size, -1):  # id 0 gave the last merge's bytes
        with pytest.raises(ValueError):
            tok.id_to_bytes(bad)


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
    # a byte token replaced: it loaded, then encode panicked inside the BPE library (a BaseException)
    import base64
    import json as js
    doc = js.loads(p.read_bytes())
    doc["tokens"][ord("a")] = base64.b64encode(b"\xff\xfe").decode()
    bad = tmp_path / "bytes.json"
    bad.write_text(js.dumps(doc))
    with pytest.raises(ValueError, match="256 single bytes"):
        tokmod.Tokenizer.load(bad)
    # (found by fuzzing) a pattern that splits only some text: "a" or "\\p{L}+" loaded and encoded a prompt's other
    # characters as nothing, without a word; "" loaded and panicked inside tiktoken at the first encode
    for pattern in ["a", r"\p{L}+", ""]:
        bad.write_text(js.dumps(dict(js.loads(p.read_bytes()), pattern=pattern)))
        with pytest.raises(ValueError, match="corrupt tokenizer file.*pattern"):
            tokmod.Tokenizer.load(bad)
    bad.write_text(js.dumps(dict(js.loads(p.read_bytes()), vocab_size=str(tok.vocab_size))))  # (it loaded)
    with pytest.raises(ValueError, match="corrupt tokenizer file.*vocab_size '400' is not a whole number"):
        tokmod.Tokenizer.load(bad)


def test_tokenizer_vocab_bounds():
    with pytest.raises(ValueError):
        tokmod.train_tokenizer(["abc"], 100)
    with pytest.raises(ValueError):
        tokmod.train_tokenizer(["abc"], 70000)


# ---------------------------------------------------------------------------------------------------------------
# shards: reader, positions, integrity

import subprocess  # noqa: E402

import numpy as np  # noqa: E402

import shards  # noqa: E402

VOCAB = 400


def make_corpus(d, tok, lengths, split="train", seed=0):
    """A corpus of random non-zero tokens (< VOCAB); returns the concatenated stream."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    entries, parts = [], []
    for i, n in enumerate(lengths):
        t = rng.integers(1, VOCAB, n).astype(np.uint16)
        name = f"{split}_{i:06d}.bin"
        entries.append({"file": name, "tokens": n, "sha256": shards.write_shard(d / name, t), "source": {}})
        parts.append(t)
    tok.save(d / "tokenizer.json")
    shards.write_index(d, {"version": 1, "tokenizer": "tokenizer.json", "tokenizer_sha256": tok.hash,
                           "vocab_size": VOCAB, "source": {}, "splits": {split: entries}})
    return np.concatenate(parts).astype(np.int64)


def expected_rows(ref, p, B, T):
    idx = (p + np.arange(B)[:, None] * T + np.arange(T + 1)[None, :]) % len(ref)
    return ref[idx]


def test_stream_windows_cross_shards_and_wrap(tok, tmp_path):
    ref = make_corpus(tmp_path / "c", tok, [1000, 37, 500])
    s = shards.TokenStream(tmp_path / "c")
    assert s.position == {"shard": 0, "offset": 0, "epoch": 0}
    p, B, T = 0, 8, 32
    for _ in range(10):
        x, y = s.next_batch(B, T)
        assert x.dtype == y.dtype and str(x.dtype) == "torch.int64" and tuple(x.shape) == (B, T)
        rows = expected_rows(ref, p, B, T)
        assert (x.numpy() == rows[:, :-1]).all() and (y.numpy() == rows[:, 1:]).all()
        p += B * T
    assert p == 2560 and s.position == {"shard": 1, "offset": 2560 - 1537 - 1000, "epoch": 1}


def test_stream_position_survives_batch_shape_change(tok, tmp_path):
    ref = make_corpus(tmp_path / "c", tok, [700, 300, 129])
    shapes = [(4, 16), (2, 50), (8, 8), (3, 7), (1, 128), (5, 13)]
    s = shards.TokenStream(tmp_path / "c")
    consumed = []
    for i in range(24):
        B, T = shapes[i % len(shapes)]
        if i == 12:  # a "resume": a fresh stream put at the saved position continues exactly
            pos = dict(s.position)
            s = shards.TokenStream(tmp_path / "c")
            s.set_position(pos)
        x, _ = s.next_batch(B, T)
        consumed.append(x.numpy().reshape(-1))
    consumed = np.concatenate(consumed)
    n = len(consumed)
    assert n > len(ref)  # crossed the wrap too
    assert (consumed == ref[np.arange(n) % len(ref)]).all()
    # the same token sequence as with a single setting
    single = shards.TokenStream(tmp_path / "c")
    one = np.concatenate([single.next_batch(1, 1)[0].numpy().reshape(-1) for _ in range(n)])
    assert (one == consumed).all()
    assert single.position == s.position


def test_stream_rank_world_split_covers_world1(tok, tmp_path):
    make_corpus(tmp_path / "c", tok, [900, 400])
    W, B, T = 3, 2, 24
    ranks = [shards.TokenStream(tmp_path / "c") for _ in range(W)]
    whole = shards.TokenStream(tmp_path / "c")
    for _ in range(12):
        xs, ys = zip(*[r.next_batch(B, T, rank=i, world_size=W) for i, r in enumerate(ranks)])
        xw, yw = whole.next_batch(W * B, T)
        assert (np.concatenate([x.numpy() for x in xs]) == xw.numpy()).all()
        assert (np.concatenate([y.numpy() for y in ys]) == yw.numpy()).all()
        assert all(r.position == whole.position for r in ranks)
    assert whole.position["epoch"] >= 1


def test_stream_bad_inputs(tok, tmp_path):
    make_corpus(tmp_path / "c", tok, [100])
    with pytest.raises(shards.DataError) as e:
        shards.load_index(tmp_path / "nope")
    assert "prepare.py" in str(e.value) and "nope" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(shards.DataError) as e:
        shards.TokenStream(tmp_path / "empty")
    assert "index.json" in str(e.value) and "prepare.py" in str(e.value)
    with pytest.raises(shards.DataError) as e:
        shards.TokenStream(tmp_path / "c", vocab_size=VOCAB - 1)  # model vocab smaller than the corpus's
    assert "vocab_size" in str(e.value)
    s = shards.TokenStream(tmp_path / "c")
    with pytest.raises(shards.DataError):
        s.set_position({"shard": 5, "offset": 0, "epoch": 0})
    with pytest.raises(shards.DataError):
        shards.TokenStream(tmp_path / "c", split="val")  # no such split
    # values of the wrong type in index.json: "corrupt index", not a TypeError deep in the stream
    import json as js
    good = (tmp_path / "c" / "index.json").read_text()
    for edit in (lambda ix: ix["splits"]["train"][0].update(tokens=None),
                 lambda ix: ix["splits"]["train"][0].update(tokens="1000"), lambda ix: ix.update(vocab_size="300"),
                 # these crashed `shards.py verify` / `refetch` with a TypeError
                 lambda ix: ix.update(tokenizer=None), lambda ix: ix["splits"]["train"][0].update(sha256=7),
                 lambda ix: ix.update(source="x"), lambda ix: ix.update(vocab_size=70000),
                 # a TypeError in next_batch / `shards.py info`
                 lambda ix: ix.update(row_tokens="64"), lambda ix: ix["splits"]["train"][0].update(documents="3"),
                 lambda ix: ix.update(loss_mask="yes")):
        ix = js.loads(good)
        edit(ix)
        (tmp_path / "c" / "index.json").write_text(js.dumps(ix))
        with pytest.raises(shards.DataError, match="corrupt index"):
            shards.TokenStream(tmp_path / "c")
    (tmp_path / "c" / "index.json").write_text(good)


def test_a_position_is_refused_by_a_corpus_prepared_again(tok, tmp_path):
    """The same tokenizer, other shard sizes (or more tokens, another val share): a saved position landed elsewhere
    and the run skipped or repeated tokens without a word. The split's fingerprint saved with it says so."""
    make_corpus(tmp_path / "c", tok, [1000, 500, 300])
    s = shards.TokenStream(tmp_path / "c")
    s.next_batch(4, 100)
    pos, sha = dict(s.position), s.split_sha
    again = shards.TokenStream(tmp_path / "c")
    again.set_position(pos, sha)  # the same corpus: accepted
    assert again.position == pos
    make_corpus(tmp_path / "c", tok, [600, 600, 600])
    other = shards.TokenStream(tmp_path / "c")
    with pytest.raises(shards.DataError, match="prepared again") as e:
        other.set_position(pos, sha)
    assert e.value.kind == "index" and "\n" not in str(e.value)
    other.set_position(pos)  # a checkpoint from before the fingerprint: not checked


def _poke(path, byte_offset, data):
    with open(path, "r+b") as f:
        f.seek(byte_offset)
        f.write(data)


def test_shard_hash_mismatch_names_shard(tok, tmp_path):
    make_corpus(tmp_path / "c", tok, [3000, 3000])
    shard = tmp_path / "c" / "train_000001.bin"
    _poke(shard, 2 * 1234, np.array([7], np.uint16).tobytes())  # a valid id, but not the recorded one
    s = shards.TokenStream(tmp_path / "c")
    s.next_batch(4, 100)  # shard 0 is fine
    with pytest.raises(shards.DataError) as e:
        for _ in range(10):
            s.next_batch(4, 100)
    assert e.value.kind == "hash" and e.value.path == str(shard) and str(shard) in str(e.value)
    assert "\n" not in str(e.value)
    problems = shards.verify_corpus(tmp_path / "c")
    assert len(problems) == 1 and "train_000001.bin" in problems[0]


def test_zeroed_page_caught_with_shard_and_offset(tok, tmp_path):
    make_corpus(tmp_path / "c", tok, [20000])
    shard = tmp_path / "c" / "train_000000.bin"
    # (a) the page goes bad after the shard was verified and mapped: caught by the per-batch check
    s = shards.TokenStream(tmp_path / "c")
    s.next_batch(4, 256)
    _poke(shard, 16384, bytes(4096))  # tokens 8192 .. 10239
    with pytest.raises(shards.DataError) as e:
        for _ in range(20):
            s.next_batch(4, 256)
    assert e.value.kind == "zeros" and e.value.offset == 8192 and e.value.path == str(shard)
    msg = str(e.value)
    assert f"{shard} offset 8192" in msg and "2048 zero tokens" in msg and "\n" not in msg
    assert s.position["offset"] <= 8192  # the bad batch was not consumed
    # (b) a fresh process opening it: sha256 mismatch, still naming the offset
    shards._VERIFIED.clear()
    with pytest.raises(shards.DataError) as e:
        shards.TokenStream(tmp_path / "c").next_batch(1, 8)
    assert e.value.offset == 8192 and "sha256 mismatch" in str(e.value) and str(shard) in str(e.value)


def test_truncated_shard_and_ids_over_vocab(tok, tmp_path):
    make_corpus(tmp_path / "c", tok, [500, 500])
    shard = tmp_path / "c" / "train_000001.bin"
    with open(shard, "r+b") as f:
        f.truncate(999)
    with pytest.raises(shards.DataError) as e:  # when the stream opens, not when it reaches the shard (hours in)
        shards.TokenStream(tmp_path / "c")
    assert e.value.kind == "truncated" and str(shard) in str(e.value)
    shards.TokenStream(tmp_path / "c", skip_shards=["train_000001.bin"]).next_batch(2, 400)  # quarantined: read past
    # an id >= vocab_size, in a shard whose recorded hash matches (so only the per-batch check can see it)
    t = np.random.default_rng(1).integers(1, VOCAB, 1000).astype(np.uint16)
    t[777] = VOCAB + 50
    bad = tmp_path / "b"
    make_corpus(bad, tok, [10])
    index = shards.load_index(bad)
    index["splits"]["train"] = [{"file": "train_000000.bin", "tokens": 1000,
                                 "sha256": shards.write_shard(bad / "train_000000.bin", t)}]
    shards.write_index(bad, index)
    with pytest.raises(shards.DataError) as e:
        shards.TokenStream(bad).next_batch(1, 999)
    assert e.value.kind == "vocab" and e.value.offset == 777 and f"token id {VOCAB + 50}" in str(e.value)


def test_a_stat_failing_on_a_dropped_mount_is_storage_not_a_missing_shard(tok, tmp_path, monkeypatch):
    """A shard (or the corpus folder) whose stat failed with ENOTCONN, ESTALE or EIO was a DataError "missing": the
    guardian re-fetched or quarantined healthy shards for a mount that dropped. Now a StorageError (read_error); only a
    file that is not there is missing."""
    import errno
    make_corpus(tmp_path / "c", tok, [500, 500])
    shard = str(tmp_path / "c" / "train_000001.bin")
    failing, real_stat = {}, os.stat

    def stat(path, *a, **k):
        if str(path) in failing:
            raise OSError(failing[str(path)], os.strerror(failing[str(path)]), str(path))
        return real_stat(path, *a, **k)
    monkeypatch.setattr(os, "stat", stat)
    failing[shard] = errno.ENOTCONN
    for read in (lambda: shards.TokenStream(tmp_path / "c"), lambda: shards.verify_corpus(tmp_path / "c")):
        with pytest.raises(shards.StorageError) as e:
            read()
        assert e.value.kind == "unreachable" and shard in str(e.value), str(e.value)
    failing[shard] = errno.EIO
    with pytest.raises(shards.StorageError) as e:
        shards.TokenStream(tmp_path / "c")
    assert e.value.kind == "io"
    failing.clear()
    failing[str(tmp_path / "c")] = errno.ESTALE  # the corpus folder's own mount
    with pytest.raises(shards.StorageError) as e:
        shards.load_index(tmp_path / "c")
    assert e.value.kind == "unreachable"
    failing.clear()
    os.remove(shard)  # really gone: missing data, as before
    with pytest.raises(shards.DataError) as e:
        shards.TokenStream(tmp_path / "c")
    assert e.value.kind == "missing"


# ---------------------------------------------------------------------------------------------------------------
# data/local/prepare.py

def _run(args, env=None, check=True):
    full_env = dict(os.environ, **(env or {}))
    r = subprocess.run([sys.executable] + args, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def split_docs(tok, tokens):
    """Decode a shard's tokens into documents: it must start with BOS, and BOS starts each document."""
    tokens = [int(t) for t in tokens]
    assert tokens[0] == tok.bos_id
    starts = [i for i, t in enumerate(tokens) if t == tok.bos_id] + [len(tokens)]
    return [tok.decode(tokens[a + 1:b]) for a, b in zip(starts, starts[1:])]


def read_split_docs(corpus, tok, split):
    index = shards.load_index(corpus)
    docs = []
    for e in index["splits"][split]:
        t = np.fromfile(corpus / e["file"], dtype=np.uint16)
        assert len(t) == e["tokens"] and e.get("documents", len(split_docs(tok, t))) == len(split_docs(tok, t))
        docs.append((e, split_docs(tok, t)))
    return docs


def test_local_prepare_whole_documents_and_refetch(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    rng = random.Random(3)
    texts = {}
    for i in range(24):
        name = f"sub/f{i}.py" if i % 3 == 0 else f"doc{i}.{'md' if i % 2 else 'txt'}"
        body = f"# document {i}\n" + " ".join(rng.choice(["alpha", "beta", "gamma", "δ", "日本", "🎉", "x=1\n"])
                                             for _ in range(rng.randrange(5, 120)))
        texts[name] = body
    texts["big.txt"] = "a long document that must not be cut. " * 200  # longer than --shard-tokens
    for i in range(20):  # copies of one file under other names: the split went by the name, so copies leaked into val
        texts[f"copies/c{i}.txt"] = "the same text in every copy\n"
    (src / "copies").mkdir()
    for name, body in texts.items():
        (src / name).write_text(body, encoding="utf-8")
    (src / "ignored.bin").write_bytes(b"\x00\x01")
    (src / "empty.txt").write_text("")
    latin1 = os.fsdecode(b"caf\xe9.txt")  # a file name that is not UTF-8 (was a UnicodeEncodeError traceback)
    texts[latin1] = "un document en latin-1, nomm\u00e9 ainsi"
    with open(os.path.join(os.fsencode(src), b"caf\xe9.txt"), "w", encoding="utf-8") as f:
        f.write(texts[latin1])
    os.symlink("user@host.123:456", src / ".#doc1.md")  # an editor's lock file: a dangling link (was a traceback)
    out = tmp_path / "corpus"
    _run(["data/local/prepare.py", "--src", str(src), "--out", str(out), "--vocab-size", "300",
          "--shard-tokens", "300", "--val-percent", "15"])
    tok = tokmod.Tokenizer.load(out / "tokenizer.json")
    index = shards.load_index(out)
    assert index["tokenizer_sha256"] == tok.hash and index["vocab_size"] == 300
    seen = {}
    for split in ("train", "val"):
        assert index["splits"][split], split
        for entry, docs in read_split_docs(out, tok, split):
            files = entry["source"]["files"]
            assert len(files) == len(docs)
            for f, d in zip(files, docs):
                assert d == texts[f]  # exact text, never cut
                seen[f] = split
            assert entry["tokens"] <= 300 or len(docs) == 1  # only a single long document may overflow a shard
    assert set(seen) == set(texts)  # every non-empty text file, once; nothing else
    assert len({seen[f"copies/c{i}.txt"] for i in range(20)}) == 1  # identical texts share a split
    assert shards.verify_corpus(out) == []
    # damage a shard, see it reported, re-make it from its recorded source, and it verifies again
    victim = index["splits"]["train"][0]["file"]
    _poke(out / victim, 4, bytes(8))
    assert any(victim in p for p in shards.verify_corpus(out))
    shards.refetch_shard(out, victim)
    assert shards.verify_corpus(out) == []
    with pytest.raises(shards.DataError, match="nope.bin: not in .*; pass a shard FILE it lists"):
        shards.refetch_shard(out, "nope.bin")
    good = (out / "index.json").read_text()  # a source of another shape (a hand-made index): one line, no KeyError
    for source in ({}, {"kind": "files"}, {"kind": "hub", "rows": 3}):
        bad = json.loads(good)
        bad["splits"]["train"][0]["source"] = source
        (out / "index.json").write_text(json.dumps(bad))
        with pytest.raises(shards.DataError, match="cannot re-read its source"):
            shards.refetch_shard(out, victim)
    (out / "index.json").write_text(good)
    # the fix a DataError offers re-runs prepare.py with the arguments it was run with (not the stdlib defaults)
    hint = shards._fix_hint(out, victim)
    assert f"data/local/prepare.py --src {src} --out {out} --vocab-size 300" in hint, hint
    import shutil
    shutil.copytree(out, tmp_path / "moved")  # a copy (another machine, another data_root): its hint names the copy
    assert f"--out {tmp_path / 'moved'} --vocab-size 300" in shards._fix_hint(tmp_path / "moved", victim)
    r = _run(["data/local/prepare.py", "--src", str(src), "--out", str(tmp_path / "capped"), "--vocab-size", "300",
              "--max-files", "5"])
    assert "5 documents" in r.stdout and "more files left out by --max-files" in r.stdout, r.stdout  # said, not silent
    # the closing line names the command that trains on this corpus (it named none), and one shard is "1 shard"
    assert "val: 1 shard, " in r.stdout, r.stdout
    said = r.stdout.rpartition("train on it: ")[2].strip()
    assert said == (f"python train.py config/tiny.py --data_root={tmp_path} --dataset=capped --vocab_size=300"), said
    r = _run(["data/local/prepare.py", "--src", str(src), "--out", str(out), "--threads", "0"], check=False)
    assert r.returncode != 0 and "--threads 0" in r.stderr and shards.verify_corpus(out) == []  # nothing removed
    # --tokenizer reuses it: same hash, same shards
    out2 = tmp_path / "corpus2"
    _run(["data/local/prepare.py", "--src", str(src), "--out", str(out2), "--tokenizer", str(out / "tokenizer.json"),
          "--shard-tokens", "300", "--val-percent", "15"])
    index2 = shards.load_index(out2)
    assert index2["tokenizer_sha256"] == tok.hash
    assert [e["sha256"] for e in index2["splits"]["train"]] == [e["sha256"] for e in index["splits"]["train"]]
    r = _run(["data/local/prepare.py", "--src", str(tmp_path / "missing"), "--out", str(out2)], check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "missing" in r.stderr


def test_one_prepare_per_out_and_a_tiny_folders_val_takes_every_copy(tmp_path, monkeypatch, capsys):
    """A second prepare.py on the same --out deleted the first's staging dir as a killed run's (hours of tokenizing
    lost, and the first then blamed the disk); a tiny folder's fallback val document left its identical copies in
    train (the val text trained on)."""
    out = str(tmp_path / "corpus")
    with shards.staging(out) as first:
        with pytest.raises(shards.DataError, match="another prepare.py is writing this corpus"):
            with shards.staging(out):
                pass
        assert os.path.isdir(first)
    os.makedirs(os.path.join(out, ".staging-999999999"))  # a killed run's: removed once nobody holds the lock
    with shards.staging(out) as again:
        assert sorted(os.listdir(out)) == sorted([".prepare.lock", os.path.basename(again)])
    src = tmp_path / "src"
    src.mkdir()
    for name, text in (("a.txt", "alpha beta " * 20), ("b.txt", "gamma delta " * 20), ("c.txt", "the same text " * 20),
                       ("d.txt", "epsilon " * 30), ("e.txt", "the same text " * 20)):
        (src / name).write_text(text)
    # a val share too small for any of 5 documents: the fallback val document
    r = _run(["data/local/prepare.py", "--src", str(src), "--out", out, "--vocab-size", "300", "--val-percent", "0.01"])
    assert "\nval: 1 shard, " in r.stdout and "\ntrain: 1 shard, " in r.stdout, r.stdout  # (it said "1 shards")
    monkeypatch.setattr(sys, "argv", ["shards.py", "info", out])
    import runpy
    runpy.run_path(os.path.join(ROOT, "shards.py"), run_name="__main__")
    assert "\n  val: 1 shard, " in capsys.readouterr().out
    tok = tokmod.Tokenizer.load(os.path.join(out, "tokenizer.json"))
    where = {f: split for split in ("train", "val") for entry, _ in read_split_docs(tmp_path / "corpus", tok, split)
             for f in entry["source"]["files"]}
    assert where["c.txt"] == where["e.txt"] and "val" in where.values() and "train" in where.values(), where
    # --val-percent 0 asks for no val split: the fallback moved one document there anyway
    r = _run(["data/local/prepare.py", "--src", str(src), "--out", out, "--val-percent", "0",
              "--tokenizer", os.path.join(out, "tokenizer.json")])
    index = shards.load_index(out)
    assert index["splits"]["val"] == [] and "--val-percent 0: no val split" in r.stdout, r.stdout
    assert sum(len(e["source"]["files"]) for e in index["splits"]["train"]) == 5


# ---------------------------------------------------------------------------------------------------------------
# data/fineweb_edu/prepare.py against a local fake Hub (tests/hub_server.py), the real huggingface_hub client

def _write_parquets(repo_dir, rng):
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = ["the", "cell", "energy", "photosynthesis", "Ω", "ü", "数学", "🌱", "42,", "learning.\n"]
    all_texts = []
    (repo_dir / "sample" / "10BT").mkdir(parents=True)
    for k in range(2):
        texts = [" ".join(rng.choice(words) for _ in range(rng.randrange(3, 60))) for _ in range(25)]
        texts[5] = ""  # empty rows are skipped
        texts[9] = None
        pq.write_table(pa.table({"text": texts, "id": [f"{k}-{i}" for i in range(25)], "score": [i / 25 for i in range(25)]}),
                       repo_dir / "sample" / "10BT" / f"00{k}_00000.parquet", row_group_size=7)
        all_texts += [t for t in texts if t]
    (repo_dir / "README.md").write_text("fake fineweb-edu\n")
    (repo_dir / "sample" / "100BT").mkdir()
    pq.write_table(pa.table({"text": ["not this one"]}), repo_dir / "sample" / "100BT" / "000_00000.parquet")
    return all_texts


def test_fineweb_prepare_from_fake_hub(tok, tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from hub_server import FakeHub

    repo_dir = tmp_path / "hub" / "datasets" / "HuggingFaceFW" / "fineweb-edu"
    texts = _write_parquets(repo_dir, random.Random(5))
    tok_file = tmp_path / "tok.json"
    tok.save(tok_file)
    lengths = [1 + len(tok.encode(t)) for t in texts]
    cum = np.cumsum(lengths)
    k = 33  # the corpus must end after document k, in the second parquet file
    max_tokens = int(cum[k] + lengths[k + 1] // 2)
    out = tmp_path / "fw"
    with FakeHub(tmp_path / "hub") as hub:
        env = hub.client_env(tmp_path / "hf_home")
        r = _run(["data/fineweb_edu/prepare.py", "--tokenizer", str(tok_file), "--max-tokens", str(max_tokens),
                  "--val-tokens", "60", "--shard-tokens", "250", "--threads", "2", "--out", str(out)], env=env)
        assert "stopped: --max-tokens" in r.stdout
        assert any(m == "GET" and "/resolve/" in p and p.endswith("001_00000.parquet") for m, p in hub.requests)
        assert not any("100BT" in p and "/resolve/" in p for _, p in hub.requests)
        index = shards.load_index(out)
        got = []
        for split in ("val", "train"):
            for entry, docs in read_split_docs(out, tok, split):
                got += docs
                assert entry["source"]["kind"] == "hub" and entry["source"]["revision"] == index["source"]["revision"]
        assert got == texts[:k + 1]  # whole documents, in order, stopping at a document boundary
        total = sum(e["tokens"] for es in index["splits"].values() for e in es)
        assert total == cum[k] <= max_tokens < cum[k + 1]
        assert index["splits"]["val"] and index["splits"]["train"]
        assert len(index["splits"]["val"]) == 1 and "\nval: 1 shard, " in r.stdout, r.stdout  # (it said "1 shards")
        assert shards.verify_corpus(out) == []
        # refetch a shard from the Hub with an empty HF cache: downloads the parquet again, re-makes it exactly
        victim = index["splits"]["train"][-1]["file"]
        _poke(out / victim, 0, bytes(2))
        env2 = hub.client_env(tmp_path / "hf_home2")
        n_before = len(hub.requests)
        r = _run(["shards.py", "refetch", str(out), victim], env=env2)
        assert any("/resolve/" in p for _, p in hub.requests[n_before:])
        assert shards.verify_corpus(out) == []
        # the store answering 403 is "storage denied", not corrupt data
        hub.status_override = 403
        _poke(out / victim, 0, bytes(2))
        r = _run(["shards.py", "refetch", str(out), victim], env=hub.client_env(tmp_path / "hf_home3"), check=False)
        assert r.returncode != 0 and "storage denied" in r.stderr and "Traceback" not in r.stderr
        r = _run(["data/fineweb_edu/prepare.py", "--tokenizer", str(tok_file), "--out", str(tmp_path / "fw2")],
                 env=env, check=False)
        assert r.returncode != 0 and "storage denied" in r.stderr and "Traceback" not in r.stderr
        hub.status_override = None
        # a mistyped --column, or --threads 0, on an existing corpus: one line, and the corpus is left as it was
        # (the old shards were removed before the flag was first used, then pyarrow's IndexError)
        _run(["shards.py", "refetch", str(out), victim], env=env)
        before = sorted(os.listdir(out))
        # (and a failure only found while tokenizing: no train split left, a numeric --column, which deleted it)
        for bad, want in ((["--column", "txt"], "--column"), (["--threads", "0"], "--threads 0"),
                          (["--val-tokens", "100000000"], "no train split left"),
                          (["--column", "score"], "not text")):
            r = _run(["data/fineweb_edu/prepare.py", "--tokenizer", str(tok_file), "--out", str(out), *bad],
                     env=env, check=False)
            assert r.returncode != 0 and want in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
            assert sorted(os.listdir(out)) == before and shards.verify_corpus(out) == []
        # training the tokenizer on the first documents (no --tokenizer)
        r = _run(["data/fineweb_edu/prepare.py", "--vocab-size", "300", "--tokenizer-chars", "3000",
                  "--max-tokens", "1500", "--shard-tokens", "400", "--threads", "2", "--out", str(tmp_path / "fw3")],
                 env=env)
        tok3 = tokmod.Tokenizer.load(tmp_path / "fw3" / "tokenizer.json")
        assert tok3.vocab_size == 300 and shards.load_index(tmp_path / "fw3")["tokenizer_sha256"] == tok3.hash
        assert shards.verify_corpus(tmp_path / "fw3") == []
        # val is text the tokenizer never trained on: the first documents, which its training skipped (it trained
        # on the first documents, val's included)
        sys.path.insert(0, os.path.join(ROOT, "data", "fineweb_edu"))
        import prepare as fw
        val = [d for _, docs in read_split_docs(tmp_path / "fw3", tok3, "val") for d in docs]
        held, chars = 0, 0
        while held == 0 or chars < fw.VAL_CHARS_PER_TOKEN * (1500 // 200):
            chars += len(texts[held])
            held += 1
        assert val and val == texts[:len(val)] and len(val) <= held

        def after_val(budget=3000, first=None):  # what the script's tokenizer trained on: the documents after val's
            used = 0
            for t in texts[held if first is None else first:]:
                if used >= budget:
                    return
                used += len(t)
                yield t
        assert tokmod.train_tokenizer(after_val(), 300).hash == tok3.hash
        # --val-tokens 0 asks for no val split: it still took the first document (and kept it from the tokenizer)
        r = _run(["data/fineweb_edu/prepare.py", "--vocab-size", "300", "--tokenizer-chars", "3000",
                  "--val-tokens", "0", "--max-tokens", "1500", "--shard-tokens", "400", "--threads", "2",
                  "--out", str(tmp_path / "fw4")],
                 env=env)
        assert shards.load_index(tmp_path / "fw4")["splits"]["val"] == [], r.stdout
        tok4 = tokmod.Tokenizer.load(tmp_path / "fw4" / "tokenizer.json")
        train4 = [d for _, docs in read_split_docs(tmp_path / "fw4", tok4, "train") for d in docs]
        assert train4 == texts[:len(train4)] and tok4.hash == tokmod.train_tokenizer(after_val(first=0), 300).hash
        # a page the crawl holds twice, once among val's first documents: its later copy is not trained on
        import pyarrow as pa
        import pyarrow.parquet as pq
        dup_dir = tmp_path / "hub" / "datasets" / "me" / "dups" / "sample" / "10BT"
        dup_dir.mkdir(parents=True)
        page = "the cell energy photosynthesis learning."
        docs = [page] + [f"document {i} about the cell" for i in range(30)] + [page, "the end"]
        pq.write_table(pa.table({"text": docs}), dup_dir / "000_00000.parquet")
        r = _run(["data/fineweb_edu/prepare.py", "--repo", "me/dups", "--tokenizer", str(tok_file), "--val-tokens",
                  "5", "--out", str(tmp_path / "dups")], env=env)
        val = [d for _, ds in read_split_docs(tmp_path / "dups", tok, "val") for d in ds]
        train = [d for _, ds in read_split_docs(tmp_path / "dups", tok, "train") for d in ds]
        assert val == [page] and page not in train and train == docs[1:31] + ["the end"], (val, train)
        assert "1 train copies of val documents left out" in r.stdout
        # a corrupt parquet file in the HF cache: one line naming it, the corpus in --out as it was
        cached = [os.path.realpath(os.path.join(d, n)) for d, _, ns in os.walk(tmp_path / "hf_home") for n in ns
                  if n == "000_00000.parquet" and "dups" in d]
        assert len(cached) == 1
        raw = bytearray(open(cached[0], "rb").read())
        for cut in (raw[:len(raw) // 2], raw[:4] + bytes(b ^ 0x5A for b in raw[4:len(raw) - 200]) + raw[len(raw) - 200:]):
            open(cached[0], "wb").write(bytes(cut))
            r = _run(["data/fineweb_edu/prepare.py", "--repo", "me/dups", "--tokenizer", str(tok_file), "--out",
                      str(tmp_path / "dups")], env=env, check=False)
            err = r.stderr.strip().splitlines()
            assert r.returncode != 0 and len(err) == 1 and f"delete {cached[0]}" in err[0], r.stderr[-2000:]
            assert shards.verify_corpus(tmp_path / "dups") == []
            with pytest.raises(shards.DataError, match=f"delete {cached[0]}"):  # a refetch's read (the guardian's)
                shards.parquet_texts(cached[0], "text")


def test_fineweb_prepare_resumes_a_killed_run_to_the_same_bytes(tmp_path):
    """A killed FineWeb prepare (hours of tokenizing: Ctrl-C, a machine gone, a full disk) lost everything: its staging
    folder was deleted and the next run started over. Re-run with the same arguments it now resumes from its journal
    (tokenizer, shards, parquet row) to the same bytes; other arguments or a torn journal start over, with a note."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from hub_server import FakeHub

    _write_parquets(tmp_path / "hub" / "datasets" / "HuggingFaceFW" / "fineweb-edu", random.Random(5))
    out = tmp_path / "fw"
    stage = out / ".staging"
    argv = ["data/fineweb_edu/prepare.py", "--vocab-size", "300", "--tokenizer-chars", "3000", "--max-tokens", "3000",
            "--shard-tokens", "300", "--threads", "2", "--out", str(out)]

    def corpus():
        return {n: (out / n).read_bytes() for n in os.listdir(out) if not n.startswith(".")}
    with FakeHub(tmp_path / "hub") as hub:
        env = dict(hub.client_env(tmp_path / "hf_home"), PYTHONUNBUFFERED="1")  # (the notes before a SIGKILL)
        _run(argv, env=env)
        whole = corpus()
        assert len(shards.load_index(out)["splits"]["train"]) >= 6
        r = _run(argv, env=dict(env, PICAFLOR_INJECT_KILL_AT_SHARDS="5"), check=False)
        assert r.returncode == -9 and corpus() == whole  # the corpus in --out untouched
        journal = json.loads((stage / shards.RESUME_JOURNAL).read_text())
        assert len(journal["splits"]["train"]) == 5 and len(journal["splits"]["val"]) == 1
        # the kept build is said where it is easy to forget (train.py warns at start with this note)
        note = shards.interrupted_prepare(out)
        assert note.startswith(f"{stage} holds an interrupted prepare (") and "resume" in note, note
        (stage / "train_000005.bin.tmp-1-1").write_bytes(b"half")  # a write the kill cut short: not installed
        # a shard the journal lists that changed, or --fresh: a fresh start (checked on a copy of the stage)
        import shutil
        key = journal["key"]
        for damage, want in ((lambda d: _poke(d / "train_000002.bin", 4, b"\x07\x00"), "sha256 differs"),
                             (lambda d: os.truncate(d / "train_000003.bin", 6), "6 bytes, not"),
                             (lambda d: os.remove(d / "val_000000.bin"), "missing")):
            copy = tmp_path / "copy"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(stage, copy)
            damage(copy)
            got, note = shards.resume_journal(str(copy), key, fields=["next"])
            assert got is None and want in note and os.listdir(copy) == [], note
        shutil.copytree(stage, copy, dirs_exist_ok=True)
        got, note = shards.resume_journal(str(copy), key, fresh=True)
        assert got is None and note.startswith("--fresh: discarding") and os.listdir(copy) == []
        # the same command: resumes (no tokenizer training) and ends with the same bytes as the uninterrupted run
        r = _run(argv, env=env)
        nxt = journal["next"]
        assert (f"resuming from {stage}: 6 shards, {sum(journal['counts'].values()):,} tokens done, at {nxt['file']} "
                f"row {nxt['row']}") in r.stdout and "trained tokenizer" not in r.stdout, r.stdout
        assert corpus() == whole and not stage.exists() and shards.interrupted_prepare(out) is None
        # a torn journal: a note and a fresh start (the tokenizer trained again), then a Ctrl-C after its first shard
        _run(argv, env=dict(env, PICAFLOR_INJECT_KILL_AT_SHARDS="2"), check=False)
        raw = (stage / shards.RESUME_JOURNAL).read_bytes()
        (stage / shards.RESUME_JOURNAL).write_bytes(raw[:len(raw) // 2])
        code = ("import os, runpy, signal, sys; sys.path.insert(0, '.'); import shards\n"
                "real = shards.save_journal\n"
                "def save(stage, journal):\n"
                "    real(stage, journal)\n"
                "    if journal['splits']['train']: os.kill(os.getpid(), signal.SIGINT)\n"
                "shards.save_journal = save\n"
                f"sys.argv = {argv!r}\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n")
        r = _run(["-c", code], env=env, check=False)
        assert r.returncode == 130 and "resume.json: its journal or tokenizer is torn or corrupt" in r.stdout, r.stdout
        assert ("interrupted; the corpus in --out is as it was; re-run the same command to resume (--fresh: start "
                "over)\n") in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert "trained tokenizer" in r.stdout and corpus() == whole
        assert len(json.loads((stage / shards.RESUME_JOURNAL).read_text())["splits"]["train"]) == 1
        # another corpus argument: the old build discarded with a note naming it
        r = _run(argv[:-2] + ["--shard-tokens", "400", "--out", str(out)], env=env)
        assert f"note: {stage} holds an interrupted run with other arguments (--shard-tokens changed)" in r.stdout
        assert "resuming" not in r.stdout and corpus() != whole and shards.verify_corpus(out) == []



def test_fineweb_journal_of_the_wrong_shape_starts_over_with_a_note(tok, tmp_path):
    """resume.json was checked only for its keys: one with a string, a list or null where the script writes a number or
    a dict (hand-edited, another version's) resumed, then crashed mid-build with a traceback (AttributeError: 'list'
    object has no attribute 'values'). It is now torn like a cut-short one: a one-line note naming it, a fresh start."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("fineweb_prepare", os.path.join(ROOT, "data/fineweb_edu/prepare.py"))
    fw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fw)
    key = {"--repo": "me/corpus"}
    good = {"key": key, "tokenizer": "tokenizer.json", "tokenizer_sha256": tok.hash, "val_docs": 3,
            "next": {"file": "a.parquet", "row": 7}, "splits": {"val": [], "train": []},
            "counts": {"val": 5, "train": 9}, "documents": 4, "files": ["a.parquet"], "val_digests": ["ab" * 20],
            "val_copies": 0}
    stage = tmp_path / "stage"
    for field, bad in ((None, None), ("counts", [5, 9]), ("counts", None), ("next", ["a.parquet", 7]),
                       ("next", {"file": "a.parquet", "row": "7"}), ("val_docs", "3"), ("documents", 4.0),
                       ("files", {"a.parquet": 1}), ("val_digests", ["not hex"]), ("val_copies", None),
                       ("splits", {"val": []})):
        stage.mkdir(exist_ok=True)
        tok.save(stage / "tokenizer.json")
        shards.save_journal(str(stage), dict(good, **({field: bad} if field else {})))
        got, note = shards.resume_journal(str(stage), key, fields=fw.JOURNAL_FIELDS)
        if field is None:  # the shape the script writes resumes
            assert got == good and note is None
            continue
        assert got is None and os.listdir(stage) == [], (field, bad)
        torn = f"{stage / shards.RESUME_JOURNAL}: its journal or tokenizer is torn or corrupt ({field} is"
        assert note.startswith(torn), note
        assert note.endswith("starting over") and "\n" not in note, note

def test_a_prepare_bar_piped_to_a_log_draws_a_frame_a_minute():
    """fineweb's tokenizing bar drew 10 frames a second into a piped log (megabytes over hours); smoltalk's drew none.
    Piped: a frame each PIPED_BAR_S; on a terminal, tqdm's usual pace."""
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    log, tty = io.StringIO(), Terminal()
    with shards.progress_bar(total=10, desc="tokenizing", file=log) as piped, \
            shards.progress_bar(total=10, desc="tokenizing", file=tty) as shown:
        for _ in range(10):
            piped.update(1)
            shown.update(1)
    assert piped.mininterval == piped.maxinterval == shards.PIPED_BAR_S >= 30 and shown.mininterval < 1
    assert "tokenizing: 100%" in log.getvalue() and "tokenizing: 100%" in tty.getvalue()


def test_hub_errors_name_the_cause():
    """A full HF cache was a Hub outage (retried, then exit 5 instead of 6); a malformed repo id was 'unreachable'; a
    repo hf.co does not show (it answers 401) was 'denied, check billing'; a local file error was 'the network'."""
    import errno
    import httpx2 as httpx  # (the HTTP client huggingface_hub 2.x uses)
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    def kind_of(exc):
        try:
            with shards.hub_errors("o/d/f.parquet"):
                raise exc
        except shards.StorageError as e:
            assert "o/d/f.parquet" in str(e) and "\n" not in str(e)
            return e.kind, str(e)
    resp = lambda code: httpx.Response(code, request=httpx.Request("GET", "https://hf.co/x"))  # noqa: E731
    assert kind_of(OSError(errno.EFBIG, "File too large"))[0] == "disk"
    assert "HF_HOME" in kind_of(OSError(errno.ENOSPC, "No space left on device"))[1]
    try:
        validate_repo_id("HuggingFaceFW/fineweb-edu ")
    except Exception as e:
        bad_id = e
    assert kind_of(bad_id)[0] == "not_found"
    kind, msg = kind_of(RepositoryNotFoundError("401 Client Error: Repository Not Found", response=resp(401)))
    assert kind == "not_found" and "--repo" in msg
    assert kind_of(GatedRepoError("403 gated", response=resp(403)))[0] == "denied"
    assert kind_of(httpx.ConnectError("connection refused"))[0] == "unreachable"
    assert kind_of(ConnectionResetError(errno.ECONNRESET, "reset"))[0] == "unreachable"
    with pytest.raises(PermissionError):  # a local file, not the wire: as it is
        with shards.hub_errors("o/d"):
            raise PermissionError(errno.EACCES, "Permission denied", "/root/.cache/huggingface")


def test_an_input_that_cannot_be_read_is_one_line_naming_it(tok, tmp_path):
    """Helper-57's review: a source file whose read fails (EIO; a symlink to /proc/self/mem stands in for a failing
    disk: os.access passes it) was a traceback naming no file in data/local/prepare.py, and "error: [Errno 5]
    Input/output error" with no file in data/smoltalk/prepare.py --jsonl."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("alpha beta gamma\n" * 20)
    (src / "b.txt").write_text("def f(x): return x\n" * 20)
    os.symlink("/proc/self/mem", src / "bad.txt")
    r = _run(["data/local/prepare.py", "--src", str(src), "--out", str(tmp_path / "c"), "--vocab-size", "300"],
             check=False)
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1 and f"{src / 'bad.txt'}: cannot be read" in err[0], r.stderr[-2000:]
    tok.save(tmp_path / "tok.json")
    os.symlink("/proc/self/mem", tmp_path / "chats.jsonl")
    r = _run(["data/smoltalk/prepare.py", "--tokenizer", str(tmp_path / "tok.json"), "--jsonl",
              str(tmp_path / "chats.jsonl"), "--max-len", "64", "--out", str(tmp_path / "st")], check=False)
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1 and f"{tmp_path / 'chats.jsonl'}: cannot be read" in err[0], err


def test_prepare_refuses_negative_caps_and_a_vocab_size_its_tokenizer_lacks(tok, tmp_path):
    """--max-files/--max-bytes -1 were a cap reached at once ("found no non-empty files"); fineweb's negative caps
    were found only after a download, or gave val a document anyway; --vocab-size beside --tokenizer was silently
    ignored (a corpus of another vocab than asked for). Each is refused before anything is read or written."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("alpha beta gamma\n" * 20)
    (src / "b.txt").write_text("def f(x): return x\n" * 20)
    tok_file = str(tmp_path / "tok.json")
    tok.save(tok_file)
    local = ["data/local/prepare.py", "--src", str(src), "--out", str(tmp_path / "c")]
    fw = ["data/fineweb_edu/prepare.py", "--out", str(tmp_path / "fw")]
    for argv, want in ((local + ["--max-files", "-1"], "--max-files -1: 0 (no cap) or more"),
                       (local + ["--max-bytes", "-5"], "--max-bytes -5: 0 (no cap) or more"),
                       # -5 was taken as 0, 100 said "found no files for training; pass --src DIR", 0 a shard a document
                       (local + ["--val-percent", "-5"], "--val-percent -5: in [0, 100)"),
                       (local + ["--val-percent", "100"], "--val-percent 100: in [0, 100)"),
                       (local + ["--shard-tokens", "0"], "--shard-tokens 0: at least 1"),
                       (fw + ["--max-tokens", "-1"], "--max-tokens -1: at least 1"),
                       (fw + ["--val-tokens", "-2"], "--val-tokens -2: at least 0"),
                       (local + ["--tokenizer", tok_file, "--vocab-size", "300"], f"{tok_file} has vocab 400"),
                       (fw + ["--tokenizer", tok_file, "--vocab-size", "300"], f"{tok_file} has vocab 400")):
        r = _run(argv, env={"HF_HUB_OFFLINE": "1"}, check=False)  # (offline: the old code failed at the Hub instead)
        err = r.stderr.strip().splitlines()
        assert r.returncode != 0 and want in err[-1] and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert "usage:" in r.stderr or len(err) == 1, r.stderr  # argparse's usage, or one line
        assert not (tmp_path / "c").exists() and not (tmp_path / "fw").exists()
    # the tokenizer's own vocab, said or not: accepted
    _run(local + ["--tokenizer", tok_file, "--vocab-size", "400", "--threads", "1"])
    assert shards.load_index(tmp_path / "c")["vocab_size"] == 400


def test_a_full_disk_at_install_leaves_the_old_corpus(tok, tmp_path, monkeypatch):
    """Helper-57's review: install_corpus deleted the old corpus and then wrote index.json; a full disk there left
    neither, while prepare.py said "the corpus in --out is as it was"."""
    out = tmp_path / "c"
    os.makedirs(out)
    old = {"version": shards.INDEX_VERSION, "splits": {}}
    shards.write_index(out, old)
    (out / "train_000000.bin").write_bytes(b"old!")
    stage = out / ".staging-1"
    os.makedirs(stage)
    (stage / "train_000000.bin").write_bytes(b"new!")
    real = shards._atomic_write

    def full_disk(path, data):
        raise OSError(28, "No space left on device", path)
    monkeypatch.setattr(shards, "_atomic_write", full_disk)
    with pytest.raises(OSError):
        shards.install_corpus(str(out), str(stage), {"version": shards.INDEX_VERSION, "splits": {"train": []}})
    assert (out / "train_000000.bin").read_bytes() == b"old!" and json.load(open(out / "index.json")) == old
    monkeypatch.setattr(shards, "_atomic_write", real)
    shards.install_corpus(str(out), str(stage), {"version": shards.INDEX_VERSION, "splits": {"train": []}})
    assert (out / "train_000000.bin").read_bytes() == b"new!" and json.load(open(out / "index.json"))["splits"] == {"train": []}


def test_a_ctrl_c_during_install_waits_for_the_swap(tmp_path, monkeypatch):
    """Helper-72's review: a Ctrl-C between install_corpus's deletion of the old shards and its last rename left no
    corpus at all (the staged one was removed by staging()'s cleanup): hours of tokenizing, and the old corpus, lost.
    The signal now waits for the swap, then interrupts saying the new corpus is installed (it said "the corpus in
    --out is as it was", and a resumable build's journal, left behind, had a re-run start over)."""
    import signal
    out = tmp_path / "c"
    with pytest.raises(KeyboardInterrupt, match=f"interrupted after the new corpus was installed in {out}; it is "
                                                f"complete"), shards.staging(str(out), resumable=True) as stage:
        shards.save_journal(stage, {"splits": {}})
        for i in range(3):
            open(os.path.join(stage, f"train_{i:06d}.bin"), "wb").write(b"new!")
        real, calls = os.replace, []

        def replace_then_ctrl_c(a, b):
            calls.append(b)
            real(a, b)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGINT)
        monkeypatch.setattr(shards.os, "replace", replace_then_ctrl_c)
        try:
            shards.install_corpus(str(out), stage, {"version": shards.INDEX_VERSION, "splits": {"train": []}})
        finally:
            monkeypatch.setattr(shards.os, "replace", real)
    assert len(calls) == 5 and os.path.exists(out / "index.json")  # the staged index, three shards, the index
    assert not os.path.exists(stage)  # nothing left to resume: no journal, no stage
    assert sorted(n for n in os.listdir(out) if n.endswith(".bin")) == [f"train_{i:06d}.bin" for i in range(3)]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_during_prepare_is_one_line_and_exit_130(tmp_path):
    """A Ctrl-C while data/local/prepare.py built its shards printed a Python traceback; now one line, exit 130, the
    old corpus and no staging dir left."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.txt").write_text(f"alpha beta gamma {i}\n" * 20)
    out = tmp_path / "c"
    argv = ["data/local/prepare.py", "--src", str(src), "--out", str(out), "--vocab-size", "300"]
    _run(argv)
    before = (out / "index.json").read_text()
    # a real SIGINT to the process while the shards are being written (in the staging dir)
    code = ("import os, runpy, signal, sys; sys.path.insert(0, '.'); import shards\n"
            "def ctrl_c(*a, **k): os.kill(os.getpid(), signal.SIGINT)\n"
            "shards.ShardWriter = ctrl_c\n"
            f"sys.argv = {argv!r}\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    r = _run(["-c", code], check=False)
    assert r.returncode == 130 and r.stderr.strip() == "interrupted; the corpus in --out is as it was", r.stderr[-2000:]
    assert (out / "index.json").read_text() == before and shards.verify_corpus(out) == []
    assert not [n for n in os.listdir(out) if n.startswith(".staging-")]


def _chats(path, n=40):
    path.write_text("".join(json.dumps([{"role": "user", "content": f"ping {i}"},
                                        {"role": "assistant", "content": f"pong {i}"}]) + "\n" for i in range(n)))
    return str(path)


def test_prepare_refuses_an_out_holding_a_corpus_another_script_made(tok, tmp_path):
    """A mistyped --out (the SFT prepare pointed at data/fineweb_edu) silently replaced hours of another script's
    shards with its own; now refused before anything is written. The same script replaces its own corpus, as before."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(f"alpha beta gamma {i}\n" * 20)
    tok.save(tmp_path / "tok.json")
    local = ["data/local/prepare.py", "--src", str(src), "--tokenizer", str(tmp_path / "tok.json")]
    chat = ["data/smoltalk/prepare.py", "--tokenizer", str(tmp_path / "tok.json"), "--jsonl", _chats(tmp_path / "c.jsonl"),
            "--max-len", "64"]
    _run(local + ["--out", str(tmp_path / "pre")])
    _run(chat + ["--out", str(tmp_path / "sft")])
    for argv, out, other in ((chat, "pre", "data/local/prepare.py"), (local, "sft", "data/smoltalk/prepare.py")):
        before = (tmp_path / out / "index.json").read_text()
        r = _run(argv + ["--out", str(tmp_path / out)], check=False)
        err = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(err) == 1 and f"holds a corpus made by {other}" in err[0], r.stderr[-2000:]
        assert (tmp_path / out / "index.json").read_text() == before and shards.verify_corpus(tmp_path / out) == []
    _run(local + ["--out", str(tmp_path / "pre")])  # its own corpus: made again
    os.remove(tmp_path / "sft" / "index.json")  # the way the error offers
    _run(local + ["--out", str(tmp_path / "sft")])
    assert shards.load_index(tmp_path / "sft")["source"]["made_by"] == "data/local/prepare.py"
    assert not any(n.endswith(".mask.bin") for n in os.listdir(tmp_path / "sft"))


def test_smoltalk_prepare_full_disk_bad_caps_and_a_corpus_as_tokenizer(tok, tmp_path, monkeypatch, capsys):
    """A full disk in the SFT prepare was '[Errno 28] No space left on device: FILE' (no fix, no word on --out); the
    free space the local prepare's error offers was never shown (the staging folder holding FILE was removed first);
    --max-conversations -1 was islice's own error and --val-conversations 0 failed after the whole train split was
    built; a corpus folder as --tokenizer was 'holds no valid checkpoint' (smoltalk) or 'Is a directory ... re-run
    the corpus's prepare.py' (local, fineweb)."""
    import errno
    import runpy
    tok.save(tmp_path / "tok.json")
    chats = _chats(tmp_path / "c.jsonl")
    sft = ["data/smoltalk/prepare.py", "--tokenizer", str(tmp_path / "tok.json"), "--jsonl", chats, "--max-len", "64"]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("alpha beta gamma\n" * 20)
    local = ["data/local/prepare.py", "--src", str(src), "--vocab-size", "300"]

    def main(argv):  # the script in this process, so its disk can be filled
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as e:
            runpy.run_path(os.path.join(ROOT, argv[0]), run_name="__main__")
        return str(e.value.code)
    real = shards._atomic_write
    for argv in (sft, local):
        out = tmp_path / f"out_{len(argv)}"
        monkeypatch.setattr(shards, "_atomic_write", real)
        _run(argv + ["--out", str(out)])
        before = sorted(os.listdir(out))

        def full_disk(path, data):
            raise OSError(errno.ENOSPC, "No space left on device", path + ".tmp-1-1")
        monkeypatch.setattr(shards, "_atomic_write", full_disk)
        msg = main(argv + ["--out", str(out)])
        assert msg.startswith(f"error: {out}/.staging-") and "No space left on device" in msg, msg
        assert "MB free on its disk: free space, or write elsewhere" in msg and "the corpus in --out is as it was" in msg
        assert sorted(os.listdir(out)) == before and shards.verify_corpus(out) == []
    monkeypatch.setattr(shards, "_atomic_write", real)
    for bad, want in ((["--max-conversations", "-1"], "--max-conversations -1: at least 1"),
                      (["--val-conversations", "0"], "--val-conversations 0: at least 1")):
        assert main(sft + bad + ["--out", str(tmp_path / "none")]) == f"error: {want}"
        assert not os.path.exists(tmp_path / "none" / "index.json")
    # a corpus folder as --tokenizer: its tokenizer.json (checked against its index in the SFT prepare)
    corpus = tmp_path / f"out_{len(local)}"
    ctok = tokmod.Tokenizer.load(corpus / "tokenizer.json")
    assert tokmod.reuse_tokenizer(str(corpus)).hash == ctok.hash
    _run(["data/smoltalk/prepare.py", "--tokenizer", str(corpus), "--jsonl", chats, "--max-len", "64", "--out",
          str(tmp_path / "sft2")])
    assert shards.load_index(tmp_path / "sft2")["tokenizer_sha256"] == ctok.hash
    _run(local[:3] + ["--tokenizer", str(corpus), "--out", str(tmp_path / "local2")])
    assert shards.load_index(tmp_path / "local2")["tokenizer_sha256"] == ctok.hash


def test_smoltalk_prepare_without_the_hub_names_jsonl(tok, tmp_path, monkeypatch):
    """Offline, the SFT prepare said 'Hub unreachable ... check the network' and not the way on without it: --jsonl."""
    import runpy
    tok.save(tmp_path / "tok.json")

    def offline(*a, **kw):
        raise shards.StorageError("HuggingFaceTB/smol-smoltalk@main: Hub unreachable (no network); check the network "
                                  "/ HF_ENDPOINT and retry", kind="unreachable")
    monkeypatch.setattr(shards, "hub_dataset_files", offline)
    monkeypatch.setattr(sys, "argv", ["prepare.py", "--tokenizer", str(tmp_path / "tok.json"), "--max-len", "64",
                                      "--out", str(tmp_path / "sft")])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(ROOT, "data/smoltalk/prepare.py"), run_name="__main__")
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "Hub unreachable" in msg and "--jsonl FILE" in msg and "\n" not in msg, msg
    assert not (tmp_path / "sft").exists()  # (an empty --out folder was left behind)


def test_a_failed_prepare_into_a_new_out_leaves_no_folder_and_an_old_one_as_it_was(tmp_path):
    """A prepare that failed into a --out it had made left that folder behind, holding only .prepare.lock."""
    for existed in (False, True):
        out = tmp_path / f"corpus_{existed}"
        if existed:
            out.mkdir()
        with pytest.raises(ValueError):
            with shards.staging(str(out), "data/local/prepare.py") as stage:
                open(os.path.join(stage, "train_000000.bin"), "wb").write(b"\1\0")
                raise ValueError("no train split left")
        assert out.exists() == existed and (not existed or os.listdir(out) == [".prepare.lock"])


def test_smoltalk_prepare_shows_progress_on_a_terminal(tok, tmp_path):
    """Hours of Hub conversations were rendered and packed without a word until the end (the other prepares show a
    progress bar); now a bar per split, on a terminal (a pty stands in for one)."""
    import fcntl
    import pty
    import struct
    import termios
    tok.save(tmp_path / "tok.json")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # (0 columns: an empty bar)
    p = subprocess.Popen([sys.executable, "data/smoltalk/prepare.py", "--tokenizer", str(tmp_path / "tok.json"),
                          "--jsonl", _chats(tmp_path / "c.jsonl"), "--max-len", "64", "--out", str(tmp_path / "sft")],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # (EIO: the script ended and closed its end)
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert p.wait(timeout=60) == 0, seen[-2000:]
    assert b"train conversations" in seen and b"val conversations" in seen, seen[-2000:]


def make_chat_corpus(d, tok, n_rows, row, rows_per_shard, seed=0):
    """A loss-masked corpus of whole rows of `row` tokens, each starting with <|bos|> (as data/smoltalk/prepare.py
    packs them); returns the concatenated stream."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    w = shards.ShardWriter(d, "train", rows_per_shard * row, lambda refs: {}, with_mask=True)
    parts = []
    for i in range(n_rows):
        t = rng.integers(1, tok.bos_id, row).astype(np.uint16)
        t[0] = tok.bos_id
        w.add(t, i, (t != tok.bos_id).astype(np.uint8))
        parts.append(t)
    tok.save(d / "tokenizer.json")
    shards.write_index(d, {"version": 1, "tokenizer": "tokenizer.json", "tokenizer_sha256": tok.hash,
                           "vocab_size": tok.vocab_size, "source": {}, "loss_mask": True, "row_tokens": row,
                           "splits": {"train": w.close()}})
    return np.concatenate(parts)


def test_a_chat_stream_left_mid_row_by_another_seq_len_reads_whole_rows_again_at_the_rows_seq_len(tok, tmp_path,
                                                                                                    capsys):
    """A run at a seq_len that is not the corpus's row length (warned: conversations cut) left the position mid-row;
    resumed with seq_len = row_tokens, as the warning says, every window went on starting mid-row (each conversation
    cut at its window's edge for the rest of the run) without a word. The stream moves on to the next row start."""
    R = 16
    ref = make_chat_corpus(tmp_path / "c", tok, 40, R, 7)
    s = shards.TokenStream(tmp_path / "c")
    s.next_batch(3, 12)  # 36 tokens: mid-row
    assert "conversations get cut" in capsys.readouterr().err
    pos = dict(s.position)
    for world in (1, 2):  # a fresh process at the saved position, one or two ranks
        ranks = [shards.TokenStream(tmp_path / "c") for _ in range(world)]
        for r in ranks:
            r.set_position(pos)
        for _ in range(6):  # across shard ends (7 rows a shard) and the wrap
            for rank, r in enumerate(ranks):
                x, y = r.next_batch(2, 2 * R, rank, world)
                assert (x[:, ::R] == tok.bos_id).all(), (world, r.position)  # every window whole rows
        assert len({str(r.position) for r in ranks}) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()  # once a stream (three here), each line naming what it skipped: 36 -> 48
    assert len(lines) == 3 and all("mid-row" in ln and "12 tokens skipped" in ln for ln in lines), err
    # one row past where it stood, then whole windows: nothing else skipped or read twice
    s = shards.TokenStream(tmp_path / "c")
    s.set_position(pos)
    x, _ = s.next_batch(1, R)
    assert (x.numpy().ravel() == ref[48:48 + R]).all() and s.position == {"shard": 0, "offset": 48 + R, "epoch": 0}


def test_a_chat_window_begun_mid_conversation_trains_nothing_before_its_first_conversation_start(tok, tmp_path):
    """At a seq_len that cuts the corpus's rows (warned), a window starting inside a conversation trained its answer
    tokens there without the question in view; they get no loss now, and the rest of the window is unchanged."""
    R = 16
    ref = make_chat_corpus(tmp_path / "c", tok, 8, R, 4).astype(np.int64)
    x, y = shards.TokenStream(tmp_path / "c").next_batch(3, 12)  # windows at 0, 12 (bos at +4), 24 (bos at +8)
    for b, first_bos in ((0, 0), (1, 4), (2, 8)):
        assert x[b, first_bos] == tok.bos_id and (x[b, :first_bos] != tok.bos_id).all()
        assert (y[b, :first_bos] == -1).all(), b
        targets = ref[12 * b + 1:12 * b + 13]
        want = np.where((targets != tok.bos_id), targets, -1)[first_bos:]
        assert (y[b, first_bos:].numpy() == want).all(), b
    x, y = shards.TokenStream(tmp_path / "c").next_batch(2, R)  # whole rows: the mask alone, as before
    want = np.where(ref[1:2 * R + 1] != tok.bos_id, ref[1:2 * R + 1], -1)
    assert (y.numpy().ravel() == want).all()


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), BrokenPipeError(32, "Broken pipe")])
def test_stream_warnings_on_a_lost_terminal_do_not_end_the_run(tok, tmp_path, monkeypatch, error):
    """TokenStream's warnings (quarantined shard, conversations cut, mid-row) went to stderr with a bare print: with
    the terminal gone (EIO) or its pipe dead (EPIPE), reading a batch raised and ended a healthy run."""
    R = 16
    make_chat_corpus(tmp_path / "c", tok, 40, R, 7)

    def lost(text):
        tries.append(text)
        raise error
    tries = []
    monkeypatch.setattr(sys, "stderr", type("LostTerminal", (), {"write": staticmethod(lost), "flush": lambda s: 0})())
    first = shards.load_index(tmp_path / "c")["splits"]["train"][0]["file"]
    s = shards.TokenStream(tmp_path / "c", skip_shards=[first])  # quarantined
    s.next_batch(3, 12)  # conversations cut; leaves the position mid-row
    s.next_batch(2, 2 * R)  # mid-row: skipped to the next row start
    assert sum("WARNING" in t for t in tries) == 3, tries


def test_a_parquet_row_that_is_not_utf8_reads_replaced_in_prepare_and_refetch(tok, tmp_path):
    """pyarrow does not check a string column's UTF-8 when it reads a parquet file: one row of bad bytes (a file some
    tool wrote, a flipped bit) was a UnicodeDecodeError, a ValueError: prepare.py took it for wrong arguments, deleted
    its resumable build (hours of tokenizing) and said only "'utf-8' codec can't decode byte 0xff", naming no file.
    Now such bytes read as U+FFFD (as a local text file's do), the same in prepare and in refetch."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from hub_server import FakeHub

    good = [f"document {i} about the cell and its energy" for i in range(40)]
    raw = [t.encode() for t in good]
    raw[25] = b"bad bytes \xff\xfe in the cell " + "日本".encode()[:4]  # (a character cut short at the end, too)
    want = raw[25].decode("utf-8", "replace")
    col = pa.array(raw, pa.binary()).view(pa.string())  # (pyarrow writes it unchecked, as another tool may)
    d = tmp_path / "hub" / "datasets" / "me" / "badutf8" / "sample" / "10BT"
    d.mkdir(parents=True)
    pq.write_table(pa.table({"text": col}), d / "000_00000.parquet", row_group_size=8)
    texts = list(shards.parquet_column(str(d / "000_00000.parquet"), "000_00000.parquet", "text", batch_rows=8))
    assert texts == good[:25] + [want] + good[26:]
    assert shards.parquet_texts(str(d / "000_00000.parquet"), "text", 24, 27) == [good[24], want, good[26]]
    # in a nested column (chat messages) there is no string to replace: one line naming the file, not a ValueError
    chat = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    msgs = pa.array([[{"role": b"user", "content": b"hi"}, {"role": b"assistant", "content": b"\xff"}]],
                    pa.list_(pa.struct([("role", pa.binary()), ("content", pa.binary())]))).view(chat)
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "chat.parquet")
    with pytest.raises(shards.DataError, match=f"chat.parquet: column 'messages' holds text that is not UTF-8 .*"
                                               f"delete {tmp_path / 'chat.parquet'}"):
        list(shards.parquet_column(str(tmp_path / "chat.parquet"), "chat.parquet", "messages"))
    tok_file = tmp_path / "tok.json"
    tok.save(tok_file)
    out = tmp_path / "fw"
    with FakeHub(tmp_path / "hub") as hub:
        env = hub.client_env(tmp_path / "hf_home")
        _run(["data/fineweb_edu/prepare.py", "--repo", "me/badutf8", "--tokenizer", str(tok_file), "--val-tokens", "20",
              "--shard-tokens", "60", "--threads", "2", "--out", str(out)], env=env)
        docs = [doc for split in ("val", "train") for _, ds in read_split_docs(out, tok, split) for doc in ds]
        assert docs == good[:25] + [want] + good[26:] and shards.verify_corpus(out) == []
        victim = next(e["file"] for e in shards.load_index(out)["splits"]["train"]
                      if any(r["start"] <= 25 < r["stop"] for r in e["source"]["rows"]))
        _poke(out / victim, 0, bytes(2))
        _run(["shards.py", "refetch", str(out), victim], env=env)
        assert shards.verify_corpus(out) == []


def test_a_fineweb_tokenizer_does_not_train_on_later_copies_of_val_pages(tmp_path):
    """val must be text the tokenizer never saw: its training skipped the held-out (val) documents, but not a later
    copy of one (web crawls repeat pages; the copy is already left out of train)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from hub_server import FakeHub

    page = "photosynthesis turns light energy into chemical energy."
    others = [f"document {i} about the cell, {i * 7} cells" for i in range(40)]
    docs = [page] + others[:20] + [page] * 15 + others[20:]
    d = tmp_path / "hub" / "datasets" / "me" / "repeats" / "sample" / "10BT"
    d.mkdir(parents=True)
    pq.write_table(pa.table({"text": docs}), d / "000_00000.parquet")
    out = tmp_path / "fw"
    with FakeHub(tmp_path / "hub") as hub:
        _run(["data/fineweb_edu/prepare.py", "--repo", "me/repeats", "--vocab-size", "300", "--max-tokens", "400",
              "--val-tokens", "2", "--threads", "2", "--out", str(out)], env=hub.client_env(tmp_path / "hf_home"))
    tok = tokmod.Tokenizer.load(out / "tokenizer.json")
    assert [doc for _, ds in read_split_docs(out, tok, "val") for doc in ds] == [page]
    assert tok.hash == tokmod.train_tokenizer(others, 300).hash  # (with the copies: another tokenizer)
    assert tok.hash != tokmod.train_tokenizer(docs[1:], 300).hash


def test_a_build_killed_just_after_its_index_is_installed_leaves_nothing_to_resume(tmp_path, monkeypatch):
    """install_corpus removed a resumable build's journal after the index was in place: a kill (SIGKILL, power) between
    the two left a complete corpus beside a journal whose shards were gone: train.py warned "re-run the same prepare
    command to resume" and that re-run started over (hours). The journal now goes before the index is renamed in."""
    out = tmp_path / "c"

    class Killed(BaseException):  # a SIGKILL: no handler, no cleanup of its own
        pass
    with pytest.raises(Killed), shards.staging(str(out), resumable=True) as stage:
        shards.save_journal(stage, {"splits": {}})
        open(os.path.join(stage, "train_000000.bin"), "wb").write(b"new!")
        real = os.replace

        def replace_then_die(a, b):
            real(a, b)
            if b == os.path.join(str(out), "index.json"):
                raise Killed
        monkeypatch.setattr(shards.os, "replace", replace_then_die)
        try:
            shards.install_corpus(str(out), stage, {"version": shards.INDEX_VERSION, "splits": {"train": []}})
        finally:
            monkeypatch.setattr(shards.os, "replace", real)
    assert os.path.exists(out / "index.json") and (out / "train_000000.bin").read_bytes() == b"new!"
    assert shards.interrupted_prepare(out) is None and not os.path.exists(out / ".staging")
