"""
Token shards: the one place that writes, reads and checks them (prepare scripts, train.py, eval, SFT import it).

Corpus dir layout (e.g. data/local/):
    index.json          {"version": 1, "tokenizer": "tokenizer.json", "tokenizer_sha256": ..., "vocab_size": V,
                         "source": {...how the corpus was made...},
                         "splits": {"train": [{"file", "tokens", "sha256", "documents", "source"}, ...],
                                    "val": [...]}}
    tokenizer.json      tokenizer.Tokenizer file (its sha256 is pinned in index.json)
    train_000000.bin    uint16 tokens, little endian; every document is <|bos|> + its tokens, whole
    val_000000.bin      (a document is never cut: it goes whole into one shard)

Each shard's "source" says how to re-create it exactly (refetch_shard):
    {"kind": "files", "root": "/abs/dir", "files": ["rel/a.py", ...]}               documents = files, in order
    {"kind": "hub", "repo": ..., "repo_type": "dataset", "revision": <commit sha>, "column": "text",
     "rows": [{"file": "sample/10BT/000_00000.parquet", "start": a, "stop": b}, ...]}   documents = those rows

Integrity (issue 4): a shard's size must be tokens * 2 and its sha256 is verified the first time a process
opens it; every batch read is checked for ids >= vocab_size and for id 0, which the tokenizer never emits
(a zero is a corrupt page: the error names the shard, the token offset of the first zero and the zero-run
length). Failures raise DataError (path, offset, kind); remote faults raise StorageError, so an operator
never mistakes a billing/credential problem for corrupt data.

Loss masks (chat corpora, data/smoltalk/prepare.py): index.json "loss_mask": true, and each shard entry also has
"mask" (e.g. train_000000.mask.bin: uint8, one byte per token, 1 = this token is a training target) and
"mask_sha256". TokenStream.next_batch then sets y = -1 wherever the target token's mask is 0, so train.py's
cross_entropy(ignore_index=-1) trains on assistant tokens only with no change. "row_tokens": R says the shards
are made of rows of exactly R tokens (conversations never cross a row): batches of seq_len R (or a multiple)
read whole rows; another seq_len still works but cuts conversations at window edges (warned once; a window's part of a
conversation begun before it gets no loss: its answer without its question), and a batch of
seq_len R (or a multiple) that finds the position mid-row (left so by another seq_len) starts at the next row (warned).

TokenStream position is {"shard": i, "offset": o, "epoch": e} in tokens (i indexes the split's shard list
in index.json), so changing batch_size or seq_len keeps it exact.

    python shards.py info CORPUS_DIR
    python shards.py verify CORPUS_DIR              # re-hash every shard, list problems, exit 1 if any
    python shards.py refetch CORPUS_DIR FILE        # re-create one shard from its recorded source
"""

import contextlib
import errno
import hashlib
import json
import os
import sys

import numpy as np

from checkpoint import (DENIED_ERRNOS, DISK_ERRNOS, UNREACHABLE_ERRNOS, dir_size, fmt_size,  # one copy of each
                        sha256_file, warn, write_atomic as _atomic_write)
SHARD_DTYPE = np.dtype("<u2")  # uint16, little endian: vocab_size <= 65535
INDEX_VERSION = 1


class DataError(Exception):
    """Corrupt, missing or inconsistent data. path: the file at fault; offset: token offset in it (or None);
    kind: 'missing' | 'index' | 'truncated' | 'hash' | 'zeros' | 'vocab' | 'tokenizer' | 'source'."""

    def __init__(self, message, path=None, offset=None, kind=None):
        super().__init__(message)
        self.path, self.offset, self.kind = path, offset, kind


class StorageError(Exception):
    """A remote store refused or could not be reached, or the local disk could not hold what it sent (not a data
    fault). kind: 'denied' | 'not_found' | 'unreachable' | 'disk' | 'io' (a local read failed: EIO, a failing disk)."""

    def __init__(self, message, url=None, status=None, kind=None):
        super().__init__(message)
        self.url, self.status, self.kind = url, status, kind


class HashStopped(Exception):
    """A re-hash cut short between chunks by its should_stop (the guardian's stop signal): no verdict on the file."""


PIPED_BAR_S = 60.0  # a prepare's bar written to a log file or pipe: one frame a minute


def progress_bar(iterable=None, **kw):
    """tqdm for a prepare's long steps: on a terminal as usual; piped to a log, a frame each PIPED_BAR_S (tqdm's 10 a
    second filled a log with megabytes of bar frames over hours of tokenizing; disable=None left it with none)."""
    from tqdm import tqdm
    out = kw.setdefault("file", sys.stderr)
    if not getattr(out, "isatty", lambda: False)():
        kw.setdefault("mininterval", PIPED_BAR_S)
        kw.setdefault("maxinterval", PIPED_BAR_S)  # (tqdm's monitor forced a frame 10 s after each: two a minute)
    return tqdm(iterable, **kw)


def read_error(path, e):
    """An OSError reading a corpus file, as a StorageError (the bytes were never seen: not corrupt data): a mount that
    dropped = unreachable, permissions = denied, anything else (EIO: the disk itself failing) = io."""
    if e.errno in UNREACHABLE_ERRNOS:
        return StorageError(f"{path}: cannot be read ({e.strerror}): its network or bucket mount dropped? check it "
                            f"and retry", path, None, "unreachable")
    if e.errno in (errno.EACCES, errno.EPERM):
        return StorageError(f"{path}: cannot be read ({e.strerror}); check its permissions", path, None, "denied")
    return StorageError(f"{path}: cannot be read ({e.strerror or e}): the disk itself failing? (dmesg); not corrupt "
                        f"data: fix or replace the storage and run again", path, None, "io")


def _stat(path):
    """os.stat, or None when the file is not there; any other failure (a dropped mount: isdir / isfile said "not
    there", and the guardian re-fetched or quarantined healthy shards) is a StorageError (read_error)."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise read_error(path, e) from None


def _fix_hint(corpus_dir, file=None):
    """The command that re-makes this corpus: the script index.json says made it with the arguments it recorded
    (without them it would fail, or make another corpus from the defaults), else its own prepare.py."""
    import shlex
    corpus_dir = str(corpus_dir)
    chat = False  # a chat corpus's packed rows cannot be re-made one shard at a time: refetch_shard refuses
    try:
        with open(os.path.join(corpus_dir, "index.json")) as f:
            index = json.load(f)
        chat = any("mask" in e for es in index["splits"].values() for e in es)
        src = index["source"]
        argv = [str(a) for a in src.get("argv") or []]
        # the corpus being read, not the --out it was made at (a copy elsewhere: the hint re-made the healthy one)
        argv = [corpus_dir if i and argv[i - 1] == "--out" else "--out=" + corpus_dir if a.startswith("--out=") else a
                for i, a in enumerate(argv)]
        if "--out" not in argv and not any(a.startswith("--out=") for a in argv):
            argv += ["--out", corpus_dir]
        prep = f"python {src['made_by']} " + " ".join(shlex.quote(a) for a in argv)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        here = os.path.join(corpus_dir, "prepare.py")
        prep = (f"python {here}" if os.path.isfile(here) else f"python data/<corpus>/prepare.py --out {corpus_dir}")
    if file is None or chat:
        return f"run {prep}"
    return f"re-run {prep} or re-fetch the shard (python shards.py refetch {corpus_dir} {file})"


# ----------------------------------------------------------------------------------------------------------
# index and tokenizer

def load_index(corpus_dir):
    corpus_dir = str(corpus_dir)
    path = os.path.join(corpus_dir, "index.json")
    if _stat(corpus_dir) is None or not os.path.isdir(corpus_dir):
        raise DataError(f"{corpus_dir}: corpus directory not found; {_fix_hint(corpus_dir)}", corpus_dir, None, "missing")
    if _stat(path) is None or not os.path.isfile(path):
        raise DataError(f"{path}: not found (no corpus prepared here); {_fix_hint(corpus_dir)}", path, None, "missing")
    try:
        with open(path) as f:
            index = json.load(f)
        if index.get("version") != INDEX_VERSION:
            raise ValueError(f"version {index.get('version')!r}, expected {INDEX_VERSION}")
        for key in ("tokenizer", "tokenizer_sha256", "vocab_size", "splits"):
            if key not in index:
                raise ValueError(f"no {key!r}")
        whole = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0
        if not whole(index["vocab_size"]) or index["vocab_size"] > 65535 or not all(
                isinstance(index[k], str) for k in ("tokenizer_sha256", "tokenizer")):
            raise ValueError("vocab_size must be a whole number <= 65535 (uint16 shards), tokenizer and "
                             "tokenizer_sha256 strings")
        if not isinstance(index.get("source", {}), dict):
            raise ValueError("source must be an object")
        if "row_tokens" in index and not (whole(index["row_tokens"]) and index["row_tokens"] > 0):
            raise ValueError(f"row_tokens {index['row_tokens']!r} is not a positive whole number")
        if not isinstance(index.get("loss_mask", False), bool):
            raise ValueError(f"loss_mask {index['loss_mask']!r} is not true or false")
        for split, entries in index["splits"].items():
            for e in entries:
                if not {"file", "tokens", "sha256"} <= set(e):
                    raise ValueError(f"split {split!r} has an entry without file/tokens/sha256")
                if not whole(e["tokens"]) or not isinstance(e["file"], str) or not isinstance(e["sha256"], str):
                    raise ValueError(f"split {split!r}: an entry's tokens {e['tokens']!r} is not a whole number or "
                                     f"its file / sha256 not a string")
                if index.get("loss_mask") and not ({"mask", "mask_sha256"} <= set(e) and isinstance(e["mask"], str)
                                                   and isinstance(e["mask_sha256"], str)):
                    raise ValueError(f"loss_mask is set but {e['file']} has no mask/mask_sha256 strings")
                if not isinstance(e.get("source", {}), dict):
                    raise ValueError(f"split {split!r}: {e['file']}'s source must be an object")
                bad = [k for k in ("documents", "target_tokens") if k in e and not whole(e[k])]
                if bad:
                    raise ValueError(f"split {split!r}: {e['file']}'s {bad[0]} {e[bad[0]]!r} is not a whole number")
    except OSError as e:  # a dropped mount or a failing disk: storage, not a corrupt index (it was a traceback)
        raise read_error(path, e) from None
    except (ValueError, TypeError, AttributeError) as e:
        msg = str(e).splitlines()[0]
        raise DataError(f"{path}: corrupt index ({msg}); {_fix_hint(corpus_dir)}", path, None, "index") from None
    return index


def write_index(corpus_dir, index):
    _atomic_write(os.path.join(corpus_dir, "index.json"), (json.dumps(index, indent=1) + "\n").encode())


def load_corpus_tokenizer(corpus_dir, index=None):
    """The corpus's tokenizer, checked against the hash pinned in index.json."""
    from tokenizer import Tokenizer

    index = index or load_index(corpus_dir)
    path = os.path.join(str(corpus_dir), index["tokenizer"])
    try:
        tok = Tokenizer.load(path)
    except ValueError as e:
        raise DataError(str(e), path, None, "tokenizer") from None
    if tok.hash != index["tokenizer_sha256"]:
        raise DataError(f"{path}: sha256 {tok.hash[:12]} differs from index.json's {index['tokenizer_sha256'][:12]} "
                        f"(the shards were made with another tokenizer); {_fix_hint(corpus_dir)}", path, None, "tokenizer")
    return tok


# ----------------------------------------------------------------------------------------------------------
# writing: documents -> whole-document shards

def documents_to_tokens(tok, texts, num_threads=4):
    """<|bos|> + tokens of each text, one uint16 array per document."""
    out = []
    for ids in tok.encode_batch(texts, num_threads=num_threads):
        a = np.empty(len(ids) + 1, dtype=SHARD_DTYPE)
        a[0] = tok.bos_id
        a[1:] = ids
        out.append(a)
    return out


def write_shard(path, tokens):
    """Write a uint16 token array atomically; returns its sha256."""
    data = np.ascontiguousarray(tokens, dtype=SHARD_DTYPE).tobytes()
    _atomic_write(path, data)
    return hashlib.sha256(data).hexdigest()


class ShardWriter:
    """Packs whole documents into shards of at most shard_tokens tokens (a longer document gets a shard of its
    own: never cut). make_source(list of per-document sources) -> the shard's "source" dict. with_mask: every
    document comes with a uint8 loss mask of its length, written as {split}_NNNNNN.mask.bin next to the shard."""

    def __init__(self, out_dir, split, shard_tokens, make_source, with_mask=False):
        self.out_dir, self.split, self.shard_tokens, self.make_source = str(out_dir), split, shard_tokens, make_source
        self.with_mask = with_mask
        self.entries, self.docs, self.masks, self.doc_sources, self.n_tokens = [], [], [], [], 0

    def add(self, doc_tokens, doc_source, mask=None):
        if self.with_mask and (mask is None or len(mask) != len(doc_tokens)):
            raise ValueError(f"{self.split}: a masked corpus needs one mask byte per token")
        if self.docs and self.n_tokens + len(doc_tokens) > self.shard_tokens:
            self.flush()
        self.docs.append(doc_tokens)
        if self.with_mask:
            self.masks.append(np.asarray(mask, dtype=np.uint8))
        self.doc_sources.append(doc_source)
        self.n_tokens += len(doc_tokens)

    def flush(self):
        if not self.docs:
            return
        name = f"{self.split}_{len(self.entries):06d}.bin"
        tokens = np.concatenate(self.docs)
        sha = write_shard(os.path.join(self.out_dir, name), tokens)
        entry = {"file": name, "tokens": int(len(tokens)), "sha256": sha, "documents": len(self.docs),
                 "source": self.make_source(self.doc_sources)}
        if self.with_mask:
            mask_name = name[:-4] + ".mask.bin"
            data = np.concatenate(self.masks).astype(np.uint8).tobytes()
            _atomic_write(os.path.join(self.out_dir, mask_name), data)
            entry.update(mask=mask_name, mask_sha256=hashlib.sha256(data).hexdigest(),
                         target_tokens=int(np.concatenate(self.masks).sum()))
        self.entries.append(entry)
        self.docs, self.masks, self.doc_sources, self.n_tokens = [], [], [], 0

    def close(self):
        self.flush()
        return self.entries


@contextlib.contextmanager
def staging(out_dir, made_by=None, resumable=False):
    """A prepare run builds its tokenizer and shards in OUT/.staging-PID, and install_corpus swaps them in at the
    end: a run that fails (no train split left, a bad --column, a full disk, Ctrl-C) leaves the corpus it found as it
    was (the old corpus used to be deleted first, and hours of tokenizing with it). made_by: the prepare script; a
    corpus in OUT that another one made is refused (a mistyped --out silently replaced hours of FineWeb shards).
    resumable: the stage is OUT/.staging, kept when the run fails (but for a ValueError) so the next one resumes it
    (resume_journal)."""
    import fcntl
    import shutil
    made_out = not os.path.exists(out_dir)  # (a failed run into a new --out left it behind, holding a lock file)
    os.makedirs(out_dir, exist_ok=True)
    # one prepare run per --out: a second one deleted the first's staging dir as a killed run's (hours of FineWeb
    # tokenizing lost) and their installs could interleave one's tokenizer.json with the other's index.json
    lock = open(os.path.join(out_dir, ".prepare.lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise DataError(f"{out_dir}: another prepare.py is writing this corpus ({out_dir}/.prepare.lock); wait for it "
                        f"to end, or pass another --out", out_dir, None, "busy") from None
    except OSError:  # a filesystem without locks: as before, unguarded
        pass
    try:
        other = corpus_made_by(out_dir)
        if made_by and other and other != made_by:
            raise DataError(f"{out_dir}: holds a corpus made by {other}, not {made_by}; pass another --out, or delete "
                            f"{os.path.join(out_dir, 'index.json')} to replace it", out_dir, None, "index")
        for name in os.listdir(out_dir):  # a killed run's (the lock says no other run is alive)
            if name.startswith(".staging-"):
                shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
        stage = os.path.join(out_dir, ".staging" if resumable else f".staging-{os.getpid()}")
        os.makedirs(stage, exist_ok=resumable)
        keep = resumable
        try:
            yield stage
            keep = False
        except ValueError:  # wrong arguments (no train split left): a re-run with them fails alike, nothing to resume
            keep = False
            raise
        finally:
            if not keep or not os.listdir(stage):  # (kept only while it holds a build to resume)
                shutil.rmtree(stage, ignore_errors=True)
    finally:
        lock.close()
        if made_out and os.path.isdir(out_dir) and set(os.listdir(out_dir)) <= {".prepare.lock"}:
            shutil.rmtree(out_dir, ignore_errors=True)


def corpus_made_by(out_dir):
    """The prepare script index.json in out_dir says made its corpus, or None (no index, or one that does not say)."""
    try:
        with open(os.path.join(out_dir, "index.json")) as f:
            source = json.load(f).get("source")
        return source.get("made_by") if isinstance(source, dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def install_corpus(out_dir, stage, index):
    """The staged build replaces the previous corpus; the index comes last (a crash in between: no index.json). The
    index is written in the stage first: a full disk then fails before the old corpus is touched (it failed after
    the old one was deleted, with "the corpus in --out is as it was"); what follows is renames."""
    write_index(stage, index)
    try:
        with signals_held():  # a Ctrl-C between the deletions and the last rename: the old corpus gone, the new one too
            remove_old_shards(out_dir)
            for name in sorted((n for n in os.listdir(stage) if n != RESUME_JOURNAL), key=lambda n: n == "index.json"):
                if name == "index.json" and os.path.exists(os.path.join(stage, RESUME_JOURNAL)):
                    # (its shards are installed: nothing to resume; removed after the index, a kill between the two
                    # left a complete corpus beside a journal: "re-run to resume", and the re-run started over)
                    os.remove(os.path.join(stage, RESUME_JOURNAL))
                os.replace(os.path.join(stage, name), os.path.join(out_dir, name))
    except KeyboardInterrupt:  # the Ctrl-C held above: "the corpus is as it was" and "re-run to resume" were wrong
        raise KeyboardInterrupt(f"interrupted after the new corpus was installed in {out_dir}; it is complete") from None


RESUME_JOURNAL = "resume.json"  # in a resumable stage: how far its build got (never installed with the corpus)


def interrupted_prepare(corpus_dir):
    """A note when corpus_dir holds an interrupted prepare's build (OUT/.staging, kept for the same command to resume:
    GBs at FineWeb scale that nothing else mentions once training starts), else None."""
    stage = os.path.join(str(corpus_dir), ".staging")
    size = dir_size(stage)
    if not size:
        return None
    return (f"{stage} holds an interrupted prepare ({fmt_size(size)}): re-run the same prepare command to resume "
            f"it, or delete the folder to free the disk")


def save_journal(stage, journal):
    """Record a resumable build's progress, atomically; the shards it lists were fsync'd before (write_shard)."""
    _atomic_write(os.path.join(stage, RESUME_JOURNAL), (json.dumps(journal) + "\n").encode())


def resume_journal(stage, key, fresh=False, fields=()):
    """The journal a killed run left in a resumable stage, if its build can go on: (journal, None), with the stage
    pruned to the files it lists; else (None, a one-line note or None when there was nothing to resume), with the
    stage emptied. key: {flag: value} of the arguments that determine the corpus; another key, a torn journal, or a
    listed shard or tokenizer gone or changed is a fresh start (never a silently wrong corpus). fields: the other keys
    the caller's journal must hold, or {key: check(value) -> whether it is what the caller writes} (a wrong one is
    torn)."""
    import shutil
    from tokenizer import Tokenizer
    path = os.path.join(stage, RESUME_JOURNAL)
    journal, note = None, None
    if fresh and os.listdir(stage):
        note = f"--fresh: discarding the interrupted run in {stage}"
    elif os.path.exists(path):
        try:
            with open(path) as f:
                journal = json.load(f)
            old, missing = journal["key"], [k for k in dict.fromkeys(("tokenizer", "tokenizer_sha256",
                                                                             "splits", *fields)) if k not in journal]
            if missing:  # (another version of the script wrote it)
                raise ValueError(f"no {', '.join(missing)}")
            # a hand-edited or foreign journal: caught here, not as a traceback mid-build
            wrong = [k for k, ok in (fields.items() if isinstance(fields, dict) else ()) if not ok(journal[k])]
            if wrong:
                raise ValueError(", ".join(f"{k} is {json.dumps(journal[k])[:40]}" for k in wrong))
            differ = [k for k in key if old.get(k) != key[k]] + [k for k in old if k not in key]
            if differ:
                journal, note = None, (f"{stage} holds an interrupted run with other arguments ({', '.join(differ)} "
                                       f"changed): discarded, starting over")
            elif Tokenizer.load(os.path.join(stage, journal["tokenizer"])).hash != journal["tokenizer_sha256"]:
                journal, note = None, f"{stage}/{journal['tokenizer']}: not the tokenizer its journal lists; starting over"
            for e in (e for es in (journal or {"splits": {}})["splits"].values() for e in es):
                shard = os.path.join(stage, e["file"])
                st = _stat(shard)
                want = e["tokens"] * SHARD_DTYPE.itemsize
                why = ("missing" if st is None else f"{st.st_size} bytes, not {want}" if st.st_size != want
                       else "sha256 differs" if sha256_file(shard) != e["sha256"] else None)
                if why:
                    journal, note = None, f"{shard}: {why} (its journal lists it); starting over"
                    break
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            msg = (str(e).splitlines() or [type(e).__name__])[0]
            journal, note = None, f"{path}: its journal or tokenizer is torn or corrupt ({msg}); starting over"
    keep = {RESUME_JOURNAL, journal["tokenizer"]} | {e["file"] for es in journal["splits"].values() for e in es} \
        if journal else set()
    for name in os.listdir(stage):  # a killed write's temp file, a shard after the journal's last: written again
        if name not in keep:
            p = os.path.join(stage, name)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    return journal, note


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM wait until the block ends, then reach the handler they had (main thread only)."""
    import signal
    import threading
    held = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not None]  # (None: set outside Python)
    if threading.current_thread() is not threading.main_thread() or not held:
        yield
        return
    got = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if got:
            os.kill(os.getpid(), got[0])


def remove_old_shards(out_dir):
    """Delete a previous prepare run's index.json and shards (only *.bin named like ours): none is left unindexed,
    and an interrupted run leaves "no index.json" (run prepare.py) rather than an index naming deleted shards."""
    if os.path.exists(os.path.join(out_dir, "index.json")):
        os.remove(os.path.join(out_dir, "index.json"))
    for name in os.listdir(out_dir):
        stem = name[:-len(".mask.bin")] if name.endswith(".mask.bin") else name[:-4]
        if name.endswith(".bin") and name.split("_")[0] in ("train", "val") and stem.split("_")[-1].isdigit():
            os.remove(os.path.join(out_dir, name))


# sources: how each document is read back, shared by prepare scripts and refetch_shard

def corrupt_parquet(path, name, e):
    """A parquet file pyarrow cannot read (a download cut short, a bad page): a DataError naming the file in the
    Hugging Face cache to delete (the error named no file, or blamed --out, over three lines)."""
    said = (str(e).strip().splitlines() or [type(e).__name__])[0]
    real = os.path.realpath(path)
    return DataError(f"{name}: corrupt or unreadable parquet file ({said}); delete {real} from the Hugging Face "
                     f"cache and run again (it is downloaded anew)", real, None, "source")


def parquet_file(path, name, column):
    """pyarrow's ParquetFile of a downloaded file that has `column` (else DataError naming --column: pyarrow
    itself reads a missing column as no columns at all, and the failure came later, as an IndexError)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
    except (OSError, pa.ArrowException) as e:
        raise corrupt_parquet(path, name, e) from None
    if column not in names:
        raise DataError(f"{name}: no column {column!r} (it has {', '.join(pf.schema_arrow.names)}); pass --column NAME")
    return pf


def parquet_column(path, name, column, batch_rows=1024):
    """Every value of one column of a downloaded parquet file, in row order, read batch by batch."""
    import pyarrow as pa
    pf = parquet_file(path, name, column)
    try:
        for batch in pf.iter_batches(batch_size=batch_rows, columns=[column]):
            yield from utf8_values(batch.column(0))
    except (OSError, pa.ArrowException) as e:
        raise corrupt_parquet(path, name, e) from None
    except UnicodeDecodeError as e:  # (in a nested column: a ValueError, taken for wrong arguments, naming no file)
        real = os.path.realpath(path)
        raise DataError(f"{name}: column {column!r} holds text that is not UTF-8 ({e.reason}); a corrupt download? "
                        f"delete {real} from the Hugging Face cache and run again, else leave the file out (--pattern)",
                        real, None, "source") from None


def utf8_values(col):
    """col.to_pylist(), a string column's invalid UTF-8 (pyarrow reads it unchecked) as U+FFFD, as read_document
    does: it raised UnicodeDecodeError, a ValueError that a resumable prepare took for wrong arguments (build deleted)."""
    import pyarrow as pa
    try:
        return col.to_pylist()
    except UnicodeDecodeError:
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            raise
        as_bytes = col.cast(pa.binary() if pa.types.is_string(col.type) else pa.large_binary())
        return [None if b is None else b.decode("utf-8", "replace") for b in as_bytes.to_pylist()]


def text_column(pf, name, column):
    """pf, once its `column` holds strings (a numeric --column failed deep in tokenizing, with a traceback)."""
    import pyarrow as pa
    kind = pf.schema_arrow.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{name}: column {column!r} holds {kind}, not text; pass the text column with --column NAME")
    return pf


def read_document(path):
    """A text file as one document (invalid UTF-8 replaced, so any file reads)."""
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def files_source(root, rel_paths):
    return {"kind": "files", "root": os.path.abspath(root), "files": list(rel_paths)}


def hub_source(repo, repo_type, revision, column, doc_rows):
    """doc_rows: [(parquet file, row number), ...] in document order -> compact contiguous row ranges."""
    rows = []
    for file, row in doc_rows:
        if rows and rows[-1]["file"] == file and rows[-1]["stop"] == row:
            rows[-1]["stop"] = row + 1
        else:
            rows.append({"file": file, "start": row, "stop": row + 1})
    return {"kind": "hub", "repo": repo, "repo_type": repo_type, "revision": revision, "column": column, "rows": rows}


def parquet_texts(path, column, start=0, stop=None):
    """Rows [start, stop) of one text column of a local parquet file, reading only the row groups needed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        stop = pf.metadata.num_rows if stop is None else stop
        texts, first = [], 0  # first: row number of the current row group's first row
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if first < stop and first + n > start:
                col = pf.read_row_group(g, columns=[column]).column(column)
                lo, hi = max(start, first) - first, min(stop, first + n) - first
                texts.extend(utf8_values(col.slice(lo, hi - lo)))
            first += n
    except (OSError, pa.ArrowException) as e:  # (a refetch's ArrowInvalid was a traceback in the guardian)
        raise corrupt_parquet(path, os.path.basename(path), e) from None
    return texts


def _http_status(exc):
    """The HTTP status behind an exception, following its cause/context chain (hf wraps errors), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status is not None:
            return status
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def hub_errors(what):
    """Turn huggingface_hub failures into StorageError: 401/403 = denied (credentials or billing, not the data),
    404, a repo the Hub does not show or a malformed name = not found, a full local disk (the HF cache) = disk,
    anything else on the wire = unreachable. Other errors pass through."""
    try:
        yield
    except Exception as e:
        if isinstance(e, (DataError, StorageError)):
            raise
        status = _http_status(e)
        mod = type(e).__module__
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:  # (a full cache was retried as a Hub outage)
            raise StorageError(f"{what}: out of disk while downloading ({e.strerror}); free space where the HF cache "
                               f"lives (HF_HOME / HF_HUB_CACHE) and retry", what, None, "disk") from None
        if type(e).__name__ == "GatedRepoError":  # (a RepositoryNotFoundError too)
            raise StorageError(f"{what}: the Hub says this repo is gated: accept its terms on hf.co with the account "
                               f"of your HF_TOKEN", what, status, "denied") from None
        if type(e).__name__ in ("RepositoryNotFoundError", "RevisionNotFoundError", "HFValidationError"):
            # hf.co answers 401 for a repo that does not exist; a malformed id never reaches the wire
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise StorageError(f"{what}: no such repo or revision on the Hub, or private to another account "
                               f"({first[:160]}); check --repo / --revision and HF_TOKEN", what, status,
                               "not_found") from None
        if status in (401, 403):
            raise StorageError(f"{what}: HTTP {status} from the Hub: storage denied (check the token/credentials or "
                               f"billing; the data is not at fault)", what, status, "denied") from None
        if status == 404:
            raise StorageError(f"{what}: HTTP 404 from the Hub: not found (check --repo / the file name / the "
                               f"revision)", what, status, "not_found") from None
        if isinstance(e, OSError) and e.filename is not None:  # a local file (the cache folder), not the wire
            raise
        if status is not None or isinstance(e, OSError) or mod.startswith(("huggingface_hub", "httpx", "requests")):
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise StorageError(f"{what}: Hub unreachable ({first[:160]}); check the network / HF_ENDPOINT and retry",
                               what, status, "unreachable") from None
        raise


def hub_download(repo, filename, repo_type="dataset", revision=None, cache_dir=None):
    """hf_hub_download (into the HF cache), remote faults as StorageError."""
    from huggingface_hub import hf_hub_download

    with hub_errors(f"{repo}/{filename}"):
        return hf_hub_download(repo, filename, repo_type=repo_type, revision=revision, cache_dir=cache_dir)


def hub_dataset_files(repo, revision, pattern):
    """(commit sha, sorted files matching the glob pattern) of a Hub dataset repo; remote faults as StorageError;
    no match is a ValueError naming the repo and pattern."""
    import fnmatch
    from huggingface_hub import HfApi

    api = HfApi()
    with hub_errors(f"{repo}@{revision}"):
        sha = api.dataset_info(repo, revision=revision).sha
        files = sorted(f for f in api.list_repo_files(repo, repo_type="dataset", revision=sha) if fnmatch.fnmatch(f, pattern))
    if not files:
        raise ValueError(f"{repo}@{sha}: no files match --pattern {pattern!r}; pass a --pattern that matches its files")
    return sha, files


def source_texts(source):
    """The documents of one shard, re-read from its recorded source."""
    if source["kind"] == "files":
        return [read_document(os.path.join(source["root"], f)) for f in source["files"]]
    if source["kind"] == "hub":
        texts = []
        for r in source["rows"]:
            path = hub_download(source["repo"], r["file"], source["repo_type"], source["revision"])
            texts.extend(parquet_texts(path, source["column"], r["start"], r["stop"]))
        return texts
    raise ValueError(f"unknown source kind {source.get('kind')!r}")


# ----------------------------------------------------------------------------------------------------------
# integrity

_VERIFIED = set()  # (realpath, size, mtime_ns, sha256) of shards whose hash was checked in this process


def _zero_run(tokens, pos):
    """(start, length) of the run of zeros containing tokens[pos] (tokens: the whole shard)."""
    start, end, step = pos, pos + 1, 1 << 16
    while start > 0:
        chunk = tokens[max(0, start - step):start]
        nz = np.flatnonzero(chunk)
        if len(nz):
            start = start - len(chunk) + int(nz[-1]) + 1
            break
        start -= len(chunk)
    while end < len(tokens):
        chunk = tokens[end:end + step]
        nz = np.flatnonzero(chunk)
        if len(nz):
            end += int(nz[0])
            break
        end += len(chunk)
    return start, end - start


def _check_tokens(tokens, start, stop, vocab_size, path, corpus_dir, file):
    """Check tokens[start:stop] of a shard (memmap): no id 0, no id >= vocab_size. Raise DataError at the first."""
    piece = tokens[start:stop]
    zeros = np.flatnonzero(piece == 0)
    big = np.flatnonzero(piece >= vocab_size)
    first_zero = int(zeros[0]) if len(zeros) else None
    first_big = int(big[0]) if len(big) else None
    if first_zero is not None and (first_big is None or first_zero < first_big):
        run_start, run_len = _zero_run(tokens, start + first_zero)
        raise DataError(f"{path} offset {run_start} (byte {2 * run_start}): {run_len} zero tokens (id 0 is reserved: "
                        f"the page is corrupt); {_fix_hint(corpus_dir, file)}", path, run_start, "zeros")
    if first_big is not None:
        off = start + first_big
        raise DataError(f"{path} offset {off} (byte {2 * off}): token id {int(piece[first_big])} >= vocab_size "
                        f"{vocab_size} (corrupt data); {_fix_hint(corpus_dir, file)}", path, off, "vocab")


def _check_shard_size(corpus_dir, entry):
    """A shard's stat, after checking it exists with the size index.json records (a cheap check of every shard when
    a stream opens: a truncated one was found only when reached, hours into a run)."""
    file = entry["file"]
    path = os.path.join(str(corpus_dir), file)
    st = _stat(path)
    if st is None:
        raise DataError(f"{path}: shard missing; {_fix_hint(corpus_dir, file)}", path, None, "missing")
    want = entry["tokens"] * SHARD_DTYPE.itemsize
    if st.st_size != want:
        what = "truncated" if st.st_size < want else "longer than recorded"
        raise DataError(f"{path} offset {st.st_size // 2}: {what} ({st.st_size} bytes, index.json says {want}); "
                        f"{_fix_hint(corpus_dir, file)}", path, min(st.st_size, want) // 2, "truncated")
    if entry.get("mask"):  # its loss mask too: a missing one surfaced hours into an SFT run
        _check_mask_size(corpus_dir, entry)
    return st


def _check_mask_size(corpus_dir, entry):
    """A shard's loss mask's stat, after checking it exists with one byte per token of its shard."""
    path = os.path.join(str(corpus_dir), entry["mask"])
    st = _stat(path)
    if st is None:
        raise DataError(f"{path}: loss mask missing; {_fix_hint(corpus_dir)}", path, None, "missing")
    if st.st_size != entry["tokens"]:
        raise DataError(f"{path}: {st.st_size} bytes, index.json says {entry['tokens']} (one per token of "
                        f"{entry['file']}); {_fix_hint(corpus_dir)}", path, min(st.st_size, entry["tokens"]), "truncated")
    return st


def _hash(path, should_stop=None):
    """sha256_file; a read that fails after the stat (EIO, a mount dropped mid-hash) is a StorageError (read_error),
    not an OSError that train.py took for a crash (exit 10). should_stop() true between chunks: HashStopped."""
    def tick():
        if should_stop():
            raise HashStopped(f"{path}: hashing stopped")
    try:
        return sha256_file(path, tick=tick if should_stop else None)
    except OSError as e:
        raise read_error(path, e) from None


def _open_shard(corpus_dir, entry, vocab_size, should_stop=None):
    """Memory-map one shard after checking existence, size and (once per process) sha256."""
    file = entry["file"]
    path = os.path.join(str(corpus_dir), file)
    st = _check_shard_size(corpus_dir, entry)
    want = st.st_size
    tokens = np.memmap(path, dtype=SHARD_DTYPE, mode="r") if want else np.zeros(0, SHARD_DTYPE)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, entry["sha256"])
    if key not in _VERIFIED:
        got = _hash(path, should_stop)
        if got != entry["sha256"]:
            # say where it is wrong if we can: a zero run or an out-of-vocab id names the offset
            try:
                for s in range(0, len(tokens), 1 << 22):
                    _check_tokens(tokens, s, min(len(tokens), s + (1 << 22)), vocab_size, path, corpus_dir, file)
            except DataError as e:
                raise DataError(str(e).replace("; re-run", ", sha256 mismatch; re-run", 1), path, e.offset, e.kind) from None
            raise DataError(f"{path}: sha256 {got[:12]} differs from index.json's {entry['sha256'][:12]} (corrupt "
                            f"shard); {_fix_hint(corpus_dir, file)}", path, None, "hash")
        _VERIFIED.add(key)
    return tokens


def _open_mask(corpus_dir, entry, should_stop=None):
    """Memory-map one shard's loss mask (uint8, one byte per token) after checking size and (once) sha256."""
    path = os.path.join(str(corpus_dir), entry["mask"])
    st = _check_mask_size(corpus_dir, entry)
    mask = np.memmap(path, dtype=np.uint8, mode="r") if entry["tokens"] else np.zeros(0, np.uint8)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, entry["mask_sha256"])
    if key not in _VERIFIED:
        got = _hash(path, should_stop)
        if got != entry["mask_sha256"]:
            raise DataError(f"{path}: sha256 {got[:12]} differs from index.json's {entry['mask_sha256'][:12]} (corrupt "
                            f"loss mask); {_fix_hint(corpus_dir)}", path, None, "hash")
        _VERIFIED.add(key)
    return mask


def verify_corpus(corpus_dir, should_stop=None):
    """Re-hash every shard of every split (ignoring the per-process cache). Returns a list of one-line problems; a file
    that cannot be read raises StorageError (read_error); should_stop() true between hash chunks raises HashStopped
    (the guardian's stop signal: a corpus of GBs hashed to its end first)."""
    try:
        index = load_index(corpus_dir)
        load_corpus_tokenizer(corpus_dir, index)
    except DataError as e:
        return [str(e)]
    except OSError as e:  # (a traceback that ended the guardian)
        raise read_error(e.filename or corpus_dir, e) from None
    return [p for entries in index["splits"].values() for entry in entries
            for p in verify_shard(corpus_dir, entry, index["vocab_size"], should_stop)]


def verify_shard(corpus_dir, entry, vocab_size, should_stop=None):
    """Re-hash one shard of index.json and its loss mask (ignoring the per-process cache). Returns one-line problems; a
    file that cannot be read raises StorageError (read_error: an EIO or a dropped mount was a traceback out of the
    guardian, which caught DataError only); should_stop() true between hash chunks raises HashStopped."""
    problems = []
    path = os.path.join(str(corpus_dir), entry["file"])
    try:
        st = os.stat(path)
        _VERIFIED.discard((os.path.realpath(path), st.st_size, st.st_mtime_ns, entry["sha256"]))
    except OSError:
        pass
    try:
        _open_shard(corpus_dir, entry, vocab_size, should_stop)
    except DataError as e:
        problems.append(str(e))
    except OSError as e:
        raise read_error(e.filename or path, e) from None
    if "mask" in entry:
        mpath = os.path.join(str(corpus_dir), entry["mask"])
        with contextlib.suppress(OSError):
            st = os.stat(mpath)
            _VERIFIED.discard((os.path.realpath(mpath), st.st_size, st.st_mtime_ns, entry["mask_sha256"]))
        try:
            _open_mask(corpus_dir, entry, should_stop)
        except DataError as e:
            problems.append(str(e))
        except OSError as e:
            raise read_error(e.filename or mpath, e) from None
    return problems


def index_entry(index, file):
    """index.json's entry for a shard file (any split), or None."""
    return next((e for entries in index["splits"].values() for e in entries if e["file"] == file), None)


def refetch_shard(corpus_dir, file):
    """Re-create one shard from the source recorded in index.json (re-read the files or re-download the parquet,
    re-tokenize with the corpus tokenizer), check it against the recorded sha256, put it in place, re-verify."""
    corpus_dir = str(corpus_dir)
    index = load_index(corpus_dir)
    entry = index_entry(index, file)
    path = os.path.join(corpus_dir, file)
    if entry is None:
        raise DataError(f"{path}: not in {corpus_dir}/index.json; pass a shard FILE it lists", path, None, "index")
    if "source" not in entry:
        raise DataError(f"{path}: index.json records no source for it; {_fix_hint(corpus_dir)}", path, None, "source")
    if "mask" in entry:  # chat shards are packed rows of rendered conversations, not documents re-read in order
        raise DataError(f"{path}: a chat (loss-masked) shard cannot be re-made on its own; {_fix_hint(corpus_dir)}",
                        path, None, "source")
    tok = load_corpus_tokenizer(corpus_dir, index)
    try:
        texts = source_texts(entry["source"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # (a hand-made index's source: a traceback)
        raise DataError(f"{path}: cannot re-read its source ({str(e).splitlines()[0]}); {_fix_hint(corpus_dir)}",
                        path, None, "source") from None
    tokens = np.concatenate(documents_to_tokens(tok, texts)) if texts else np.zeros(0, SHARD_DTYPE)
    data = tokens.astype(SHARD_DTYPE).tobytes()
    got = hashlib.sha256(data).hexdigest()
    if got != entry["sha256"]:
        raise DataError(f"{path}: re-made from its source it hashes {got[:12]}, not {entry['sha256'][:12]} (the source "
                        f"changed); {_fix_hint(corpus_dir)}", path, None, "source")
    try:
        _atomic_write(path, data)
    except OSError as e:  # (a traceback that ended the guardian); the old shard stays as it was
        if e.errno in DENIED_ERRNOS:  # a read-only corpus: not re-fetchable here (the guardian quarantines it); it
            # was "out of disk" with "free space" for a fix, and stopped the run
            raise DataError(f"{path}: cannot write the re-made shard ({e.strerror}); make {corpus_dir} writable and "
                            f"run python shards.py refetch {corpus_dir} {file}", path, None, "source") from None
        raise StorageError(f"{path}: cannot write the re-made shard ({e.strerror}); free space in {corpus_dir} "
                           f"and run again", path, None, "disk") from None
    _open_shard(corpus_dir, entry, index["vocab_size"])  # re-verify what is on disk now
    return path


# ----------------------------------------------------------------------------------------------------------
# reading

class TokenStream:
    """The split as one endless token stream: all shards concatenated, wrapping to shard 0 (epoch + 1)."""

    def __init__(self, corpus_dir, split="train", vocab_size=None, skip_shards=()):
        """vocab_size: the model's; must be >= the corpus's. skip_shards: files quarantined by an operator or the
        guardian (read as empty, with a loud warning); positions keep indexing index.json's list."""
        self.corpus_dir = str(corpus_dir)
        self.index = load_index(self.corpus_dir)
        index_path = os.path.join(self.corpus_dir, "index.json")
        self.entries = self.index["splits"].get(split) or []
        self.split = split
        self.vocab_size = self.index["vocab_size"]
        if vocab_size is not None and vocab_size < self.vocab_size:
            raise DataError(f"{index_path}: corpus vocab_size {self.vocab_size} > model vocab_size {vocab_size}; set "
                            f"vocab_size = {self.vocab_size} in the config or re-prepare with --vocab-size {vocab_size}",
                            index_path, None, "index")
        skip = set(skip_shards) & {e["file"] for e in self.entries}  # the other split's files: not said here
        for f in sorted(skip):
            warn(f"WARNING: shard {os.path.join(self.corpus_dir, f)} is quarantined: skipped")
        self.lengths = [0 if e["file"] in skip else int(e["tokens"]) for e in self.entries]
        for e in self.entries:
            if e["file"] not in skip:
                _check_shard_size(self.corpus_dir, e)
        if sum(self.lengths) < 2:
            held = sorted(f"{os.path.basename(self.corpus_dir)}/{e['file']}" for e in self.entries
                          if e["file"] in skip and int(e["tokens"]))
            if held:  # (it said to run prepare.py, after which the quarantine still held: the same error again)
                raise DataError(f"{index_path}: split {split!r} has no tokens left: its shards are quarantined "
                                f"({', '.join(held)}); once they verify (python shards.py verify {self.corpus_dir}), "
                                f"train with --release_shards=\"{held!r}\"", index_path, None, "index")
            raise DataError(f"{index_path}: split {split!r} has no tokens to read; {_fix_hint(self.corpus_dir)}",
                            index_path, None, "index")
        self.total_tokens = sum(self.lengths)
        # which split a saved position indexes: prepared again (other shard sizes, more tokens, another val share)
        # with the same tokenizer, a position lands elsewhere and the run skips or repeats tokens without a word
        self.split_sha = hashlib.sha256(json.dumps([[e["file"], int(e["tokens"]), e["sha256"]]
                                                    for e in self.entries]).encode()).hexdigest()[:16]
        self.has_mask = bool(self.index.get("loss_mask"))  # y = -1 where the target token's mask is 0
        self.row_tokens = self.index.get("row_tokens")
        self._warned_rows = False
        self._bos_id = None  # a loss-masked corpus cut at window edges: its conversations' starts (read when needed)
        self._maps, self._mask_maps = {}, {}
        self._shard, self._offset, self._epoch = self._advance(0, 0, 0, 0)

    @property
    def position(self):
        return {"shard": self._shard, "offset": self._offset, "epoch": self._epoch}

    @property
    def tokens_read(self):
        """Tokens the split has given from its start to its position, over every epoch (as its shards count now)."""
        return self._epoch * self.total_tokens + sum(self.lengths[:self._shard]) + self._offset

    def set_position(self, pos, split_sha=None):
        """pos: a saved `position`; split_sha: the `split_sha` saved with it (None: not checked, older checkpoints)."""
        if split_sha is not None and split_sha != self.split_sha:
            path = os.path.join(self.corpus_dir, "index.json")
            raise DataError(f"{path}: the {self.split} split is not the one the checkpoint's data position indexes (the "
                            f"corpus was prepared again: other shards or sizes), so the run would skip or repeat tokens; "
                            f"prepare it as before (the same arguments), or fine-tune from the checkpoint "
                            f"(--init_from=finetune) on the new corpus", path, None, "index")
        shard, offset, epoch = int(pos["shard"]), int(pos["offset"]), int(pos.get("epoch", 0))
        if not (0 <= shard < len(self.entries) and 0 <= offset <= self.entries[shard]["tokens"]):
            raise DataError(f"{self.corpus_dir}/index.json: position {pos} is outside split {self.split!r} (the corpus "
                            f"changed since the checkpoint?); prepare it as before, or fine-tune from the checkpoint "
                            f"(--init_from=finetune) on the new corpus", os.path.join(self.corpus_dir, "index.json"),
                            offset, "index")
        self._shard, self._offset, self._epoch = self._advance(shard, offset, epoch, 0)

    def _advance(self, shard, offset, epoch, n):
        """Position n tokens further, normalised so that offset < length of a non-empty shard."""
        while True:
            rem = self.lengths[shard] - offset
            if n < rem:
                return shard, offset + n, epoch
            n -= max(rem, 0)
            shard, offset = shard + 1, 0
            if shard == len(self.lengths):
                shard, epoch = 0, epoch + 1

    def _tokens(self, shard):
        if shard not in self._maps:
            self._maps[shard] = _open_shard(self.corpus_dir, self.entries[shard], self.vocab_size)
        return self._maps[shard]

    def _mask(self, shard):
        if shard not in self._mask_maps:
            self._mask_maps[shard] = _open_mask(self.corpus_dir, self.entries[shard])
        return self._mask_maps[shard]

    def _read(self, shard, offset, n, masks=None):
        """n tokens from (shard, offset), across shard ends and the wrap, each piece checked. masks: a uint8 array
        of n that receives the loss mask of the same tokens (masked corpora)."""
        out = np.empty(n, dtype=np.int64)
        got = 0
        while got < n:
            take = min(n - got, self.lengths[shard] - offset)
            tokens = self._tokens(shard)
            _check_tokens(tokens, offset, offset + take, self.vocab_size,
                          os.path.join(self.corpus_dir, self.entries[shard]["file"]), self.corpus_dir,
                          self.entries[shard]["file"])
            out[got:got + take] = tokens[offset:offset + take]
            if masks is not None:
                masks[got:got + take] = self._mask(shard)[offset:offset + take]
            got += take
            shard, offset, _ = self._advance(shard, offset, 0, take)
        return out

    def next_batch(self, batch_size, seq_len, rank=0, world_size=1, device=None):
        """(x, y) int64 (B, T). Global row j is stream[p + j*T : p + j*T + T + 1] (x its first T, y its last T);
        rank r takes rows r*B .. r*B+B-1. The call consumes world_size*B*T tokens on every rank (a chat corpus's
        rows: and the rest of a row the position was left in the middle of, when T is a multiple of row_tokens)."""
        import torch

        B, T = batch_size, seq_len
        start = (self._shard, self._offset, self._epoch)
        R = self.row_tokens
        if R and T % R == 0 and self._offset % R:  # (shards hold whole rows: a row starts at offset % R == 0)
            # mid-row, left by an earlier seq_len that cut rows: every window went on cutting conversations, unsaid
            skip = R - self._offset % R
            warn(f"WARNING: {self.corpus_dir} {self.split}: the data position {self.position} is mid-row (an earlier "
                 f"seq_len was not a multiple of the {R}-token rows): {skip} tokens skipped to the next row start, so "
                 f"windows hold whole conversations again")
            start = self._advance(*start, skip)
        shard, offset, _ = self._advance(start[0], start[1], 0, rank * B * T)
        masks = np.empty(B * T + 1, dtype=np.uint8) if self.has_mask else None
        span = torch.from_numpy(self._read(shard, offset, B * T + 1, masks))
        x, y = span[:-1].view(B, T), span[1:].view(B, T)
        if masks is not None:
            y = y.masked_fill(torch.from_numpy(masks[1:] == 0).view(B, T), -1)  # no loss on non-target tokens
            if self.row_tokens and T % self.row_tokens:
                # a window begun mid-conversation: its answer tokens there were trained without the question (only
                # warned); no loss before the window's first <|bos|> (each conversation's start, see prepare.py)
                if self._bos_id is None:
                    self._bos_id = load_corpus_tokenizer(self.corpus_dir, self.index).bos_id
                y = y.masked_fill((x == self._bos_id).cumsum(1) == 0, -1)
                if not self._warned_rows:
                    self._warned_rows = True
                    warn(f"WARNING: {self.corpus_dir} packs conversations in rows of {self.row_tokens} tokens but "
                         f"batches use seq_len {T}: conversations get cut at window edges (a window's part of one "
                         f"begun before it is not trained); set seq_len = {self.row_tokens}")
        self._shard, self._offset, self._epoch = self._advance(*start, world_size * B * T)
        if device is not None and str(device).startswith("cuda"):
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        elif device is not None:
            x, y = x.to(device), y.to(device)
        return x, y


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Inspect, verify or repair a token-shard corpus.")
    ap.add_argument("cmd", choices=["info", "verify", "refetch"])
    ap.add_argument("corpus_dir")
    ap.add_argument("file", nargs="?", help="shard file name (refetch)")
    args = ap.parse_args()
    try:
        if args.cmd == "info":
            index = load_index(args.corpus_dir)
            print(f"{args.corpus_dir}: vocab_size {index['vocab_size']}, tokenizer {index['tokenizer_sha256'][:12]}")
            for split, entries in index["splits"].items():
                n = len(entries)
                print(f"  {split}: {n} shard{'s' * (n != 1)}, {sum(e['tokens'] for e in entries):,} tokens, "
                      f"{sum(e.get('documents', 0) for e in entries):,} documents"
                      + (f", {sum(e.get('target_tokens', 0) for e in entries):,} loss-masked target tokens"
                         if index.get("loss_mask") else ""))
        elif args.cmd == "verify":
            problems = verify_corpus(args.corpus_dir)
            for p in problems:
                print(p)
            print(f"{args.corpus_dir}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
            sys.exit(1 if problems else 0)
        else:
            if not args.file:
                sys.exit("error: refetch needs the shard FILE name (as in index.json)")
            print(f"re-created and verified {refetch_shard(args.corpus_dir, args.file)}")
    except (DataError, StorageError) as e:
        sys.exit(f"error: {e}")
