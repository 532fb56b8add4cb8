"""
The picaflor tokenizer: byte-level BPE trained with rustbpe, run through a tiktoken Encoding.

Id layout (the calls recorded here, see DESIGN.md "Tokenizer and data"):
- id 0 is reserved and never emitted: a page of zeros in a shard is then detectably corrupt. rustbpe gives
  the 256 byte tokens ranks 0..255 (so the NUL byte would be id 0); we shift every rank by +1. BPE merges
  are applied in rank order, so a shift keeps the tokenization identical.
- ids 1..256 are the bytes, 257.. the learned merges, then the special tokens, all < vocab_size.
- vocab_size counts everything (reserved id 0, bytes, merges, specials) and is <= 65535 so shards fit
  uint16. If the training text is too small to learn every merge, the top ids stay unused (never emitted).
- special tokens: <|bos|> starts every document (the document separator); <|system|>, <|user|>,
  <|assistant|> and <|end|> (end of a turn) are reserved for chat. encode() never produces them from
  text: a special-token string inside text is encoded as ordinary text. Use .special_ids to emit them.

File format: one small JSON file, no pickle: {"format", "version", "pattern", "vocab_size",
"tokens": base64 bytes of ids 1..n in id order, "special_ids": {name: id}}. .hash is the sha256 of
exactly the bytes save() writes, so a corpus/checkpoint can pin the tokenizer it was made with; .content_hash that of
the file save() writes for a new one: the same for a copy whose line endings (CRLF) or JSON layout differ.

    python tokenizer.py TOKENIZER_FILE [--text "some text"]    # print the vocab and a sample encoding
"""

import base64
import hashlib
import json
import os
import re
import sys

import tiktoken

SPECIAL_TOKENS = ["<|bos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
FORMAT = "picaflor-tokenizer"
VERSION = 1
MAX_VOCAB = 65535  # ids must be < vocab_size <= 65535 to fit uint16 shards
# letters, digits, punctuation, whitespace runs, control bytes, CJK and an emoji: every pattern must cover them all
PATTERN_PROBE = "Hello, World! It's 2024: x=3.14;\n\n\t  (a)[b]{c} \x00\x7f caf\u00e9 \u4e2d\u6587 \U0001F600 end  "


class Tokenizer:
    def __init__(self, pattern, token_bytes, vocab_size):
        """token_bytes[i] is the byte string of id i + 1 (id 0 is reserved); specials follow them."""
        n_ordinary = 1 + len(token_bytes)  # reserved id 0 + bytes + merges
        if not 256 + 1 + len(SPECIAL_TOKENS) <= n_ordinary + len(SPECIAL_TOKENS) <= vocab_size <= MAX_VOCAB:
            raise ValueError(f"tokenizer vocab_size {vocab_size} cannot hold {n_ordinary} ordinary ids + "
                             f"{len(SPECIAL_TOKENS)} specials (and must be <= {MAX_VOCAB})")
        self.pattern = pattern
        self.token_bytes = list(token_bytes)
        self.vocab_size = vocab_size
        self.special_ids = {name: n_ordinary + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.bos_id = self.special_ids["<|bos|>"]
        self.enc = tiktoken.Encoding(
            name="picaflor",
            pat_str=pattern,
            mergeable_ranks={b: i + 1 for i, b in enumerate(self.token_bytes)},
            special_tokens=self.special_ids,
        )
        self._file_bytes = None  # the exact bytes this tokenizer was loaded from / saves to
        self.hash = self.content_hash = hashlib.sha256(self.to_bytes()).hexdigest()  # (load: .hash its file's)

    # ---- (de)serialisation: one small JSON file ----
    def to_bytes(self):
        if self._file_bytes is None:
            doc = {"format": FORMAT, "version": VERSION, "pattern": self.pattern, "vocab_size": self.vocab_size,
                   "special_ids": self.special_ids,
                   "tokens": [base64.b64encode(b).decode("ascii") for b in self.token_bytes]}
            self._file_bytes = (json.dumps(doc, separators=(",", ":")) + "\n").encode("utf-8")
        return self._file_bytes

    def save(self, path):
        """Write the tokenizer file atomically (temp name, fsync, rename). Its sha256 is self.hash."""
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(self.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path):
        """Load a tokenizer file; a missing or corrupt file raises ValueError with a one-line message."""
        path = str(path)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ValueError(f"{path}: cannot read tokenizer file ({e.strerror}); re-run the corpus's "
                             f"data/<corpus>/prepare.py or copy tokenizer.json from the checkpoint") from None
        return cls.from_file_bytes(raw, path)

    @classmethod
    def from_file_bytes(cls, raw, path):
        """A tokenizer file's bytes (path: where they came from, for the message) -> Tokenizer, as load()."""
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and "model" in doc and "added_tokens" in doc and "format" not in doc:
            # a Hugging Face tokenizers file (an HF export's tokenizer.json): picaflor's own sits beside it
            raise ValueError(f"{path}: a Hugging Face tokenizers file, not picaflor's; pass the "
                             f"picaflor_tokenizer.json beside it (an HF export), or a checkpoint's tokenizer.json")
        try:
            doc = json.loads(raw)
            if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise ValueError(f"not a {FORMAT} v{VERSION} file")
            token_bytes = [base64.b64decode(s, validate=True) for s in doc["tokens"]]
            # ids 1..256 are the 256 single bytes (encode falls back on them: otherwise it panics in the BPE library)
            if token_bytes[:256] != [bytes([b]) for b in range(256)] or len(set(token_bytes)) != len(token_bytes):
                raise ValueError("ids 1..256 are not the 256 single bytes, or a token appears twice")
            if type(doc["vocab_size"]) is not int:  # (int() took "4096" and 300.7)
                raise ValueError(f"vocab_size {doc['vocab_size']!r} is not a whole number")
            tok = cls(doc["pattern"], token_bytes, doc["vocab_size"])
            if doc["special_ids"] != tok.special_ids:
                raise ValueError("special ids do not match the token list")
            if not tok.pattern_covers(PATTERN_PROBE):
                raise ValueError("its pattern does not split every text into pieces that cover it")
        except Exception as e:  # any parse/shape problem is the same fault to the user: a corrupt file
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{path}: corrupt tokenizer file ({msg}); re-run the corpus's "
                             f"data/<corpus>/prepare.py or copy tokenizer.json from the checkpoint") from None
        tok._file_bytes = raw
        tok.hash = hashlib.sha256(raw).hexdigest()
        return tok

    def pattern_covers(self, text):
        """Whether text encodes and decodes back to itself: a pattern that matches only some characters ("a")
        drops the rest of every text without a word, and "" panics inside tiktoken (a BaseException)."""
        import regex  # tiktoken's own dependency
        try:  # an empty match ("", "a*") panics inside tiktoken, its backtrace on stderr: refused before encoding
            if any(m.start() == m.end() for m in regex.finditer(self.pattern, text)):
                return False
        except regex.error:  # (syntax only tiktoken's fancy_regex reads: the encode below decides)
            pass
        try:
            return self.enc.decode_bytes(self.enc.encode_ordinary(text)) == text.encode()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # pyo3's PanicException
            return False

    # ---- encode / decode ----
    def encode(self, text):
        """Ordinary text -> ids (never id 0, never a special id, even if text contains '<|bos|>')."""
        pieces = split_long_spaces(text)
        if len(pieces) == 1:
            return self.enc.encode_ordinary(text)
        return [i for p in pieces for i in self.enc.encode_ordinary(p)]

    def encode_batch(self, texts, num_threads=8):
        """Many texts at once, encoded on num_threads threads (tiktoken releases the GIL)."""
        texts = list(texts)
        pieces = [split_long_spaces(t) for t in texts]
        if all(len(p) == 1 for p in pieces):
            return self.enc.encode_ordinary_batch(texts, num_threads=num_threads)
        flat = self.enc.encode_ordinary_batch([q for p in pieces for q in p], num_threads=num_threads)
        out, at = [], 0
        for p in pieces:
            out.append([i for ids in flat[at:at + len(p)] for i in ids])
            at += len(p)
        return out

    def decode(self, ids):
        """ids -> text; invalid UTF-8 (a sequence cut mid-character) becomes U+FFFD."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 < i < self.vocab_size or (self.bos_id + len(SPECIAL_TOKENS) <= i)]
        if bad:
            raise ValueError(f"token id {bad[0]} is not in this tokenizer (vocab {self.vocab_size}, id 0 reserved)")
        return self.enc.decode(ids, errors="replace")

    def decode_generated(self, ids):
        """Text of ids a model produced: specials dropped, and an id no text maps to (reserved 0, the unused ids
        above the merges that an early or mismatched model can still sample) shown as U+FFFD instead of an error."""
        out, run = [], []
        for i in ids:
            if 0 < i < self.bos_id:  # ordinary ids: bytes and merges
                run.append(i)
            elif i not in self.special_ids.values():
                out += [self.decode(run), "\ufffd"]
                run = []
        return "".join(out) + self.decode(run)

    def id_to_bytes(self, i):
        """The bytes of one id (specials give their name), for inspection and streaming decode."""
        for name, sid in self.special_ids.items():
            if sid == i:
                return name.encode()
        if not 0 < i <= len(self.token_bytes):  # (id 0 read token_bytes[-1], the last merge)
            raise ValueError(f"token id {i}: not an ordinary or special id of this tokenizer (1..{self.vocab_size - 1})")
        return self.token_bytes[i - 1]


_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 but \t and \n, DEL, C1 (U+0080-U+009F)


def terminal_text(text):
    """Generated text as a terminal is to show it: every control character but \\n and \\t written as \\x1b, one by
    one, so a model's ESC [ or OSC 52 (clipboard) sequence, \\r or BEL cannot drive the terminal, even cut across
    two streamed pieces. Only for a terminal: text piped to a file stays exact."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


LONG_SPACE_RUN = 65536  # tiktoken's and rustbpe's pre-split regex overflow their stack on ~1M whitespace in a row
_SPACE_RUNS = re.compile(r"\s{1024,}")  # (a lower floor than the run's: a failed match costs its run length squared)


def split_long_spaces(text):
    """text as pieces with no whitespace run longer than LONG_SPACE_RUN, to be encoded one by one (their ids
    joined decode to text exactly); [text] for any text that has none. Such a run panicked in Rust, a
    BaseException no handler caught: one document ended a whole prepare run with a backtrace."""
    if len(text) <= LONG_SPACE_RUN:
        return [text]
    pieces, pos = [], 0
    for m in _SPACE_RUNS.finditer(text):
        if m.end() - m.start() > LONG_SPACE_RUN:
            pieces.append(text[pos:m.start()])
            pieces += [text[i:min(i + LONG_SPACE_RUN, m.end())] for i in range(m.start(), m.end(), LONG_SPACE_RUN)]
            pos = m.end()
    if not pieces:
        return [text]
    pieces.append(text[pos:])
    return [p for p in pieces if p]


def reuse_tokenizer(path, vocab_size=None):
    """The --tokenizer file a prepare script reuses as is: an explicit --vocab-size it does not have is an error (it
    was silently ignored). ValueError, one line, for either mistake. path: the file, or a corpus or checkpoint folder
    holding it (a folder was "cannot read tokenizer file (Is a directory)", with the fix of re-running its prepare)."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        path = os.path.join(path, "tokenizer.json")
    tok = Tokenizer.load(path)
    if vocab_size is not None and vocab_size != tok.vocab_size:
        raise ValueError(f"--vocab-size {vocab_size}, but --tokenizer {path} has vocab {tok.vocab_size} (it is reused "
                         f"as is); drop --vocab-size, or drop --tokenizer to train one")
    return tok


def train_tokenizer(texts, vocab_size):
    """Train byte-level BPE on an iterable of strings with rustbpe (GPT-4 style split pattern, rustbpe's
    default). vocab_size counts the reserved id 0, the 256 bytes, the merges and the specials."""
    import rustbpe

    n_bpe = vocab_size - 1 - len(SPECIAL_TOKENS)  # bytes + merges that rustbpe may learn
    if not 256 <= n_bpe or vocab_size > MAX_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} must be in [{256 + 1 + len(SPECIAL_TOKENS)}, {MAX_VOCAB}]")
    bpe = rustbpe.Tokenizer()
    bpe.train_from_iterator((p for t in texts for p in split_long_spaces(t)), n_bpe)
    ranks = sorted(bpe.get_mergeable_ranks(), key=lambda kv: kv[1])
    assert [r for _, r in ranks] == list(range(len(ranks))), "rustbpe ranks are not dense"
    return Tokenizer(bpe.get_pattern(), [bytes(b) for b, _ in ranks], vocab_size)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Inspect a picaflor tokenizer file.")
    ap.add_argument("file")
    ap.add_argument("--text", default="Hello, world! The quick brown fox.")
    args = ap.parse_args()
    try:
        tok = Tokenizer.load(args.file)
    except ValueError as e:
        sys.exit(f"error: {e}")
    ids = tok.encode(args.text)
    print(f"{args.file}: vocab_size {tok.vocab_size}, {len(tok.token_bytes)} byte+merge tokens, "
          f"specials {tok.special_ids}, sha256 {tok.hash}")
    print(f"{args.text!r} -> {ids}")
    print(" | ".join(tok.id_to_bytes(i).decode("utf-8", "replace") for i in ids))
