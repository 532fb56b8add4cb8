"""
FineWeb-Edu from the Hugging Face Hub -> uint16 token shards (the nano run's data).

    python data/fineweb_edu/prepare.py --max-tokens 5_500_000_000              # the nano run (vocab 32768)
    python data/fineweb_edu/prepare.py --max-tokens 50_000_000 --tokenizer data/fineweb_edu/tokenizer.json

Downloads the parquet files of --repo (default HuggingFaceFW/fineweb-edu, files matching --pattern, default
the sample/10BT/ ones) one at a time with huggingface_hub (HF cache, pinned to the repo's commit sha),
trains the tokenizer on --tokenizer-chars characters of documents (after the ones val takes) unless --tokenizer
is given,
tokenizes with --threads tokenizer threads and a progress bar, and writes whole-document shards.

Calls recorded here:
- a document is <|bos|> + its tokens and is never cut; the run stops at the first document that would take
  the total (val + train) past --max-tokens, so the corpus holds at most --max-tokens tokens. The documents
  left out are not counted as dropped tokens: nothing is truncated, the cap just ends the corpus.
- the first --val-tokens tokens of documents (default 0.5% of --max-tokens, at most 10M, at least one
  document; --val-tokens 0: no val split, and no val loss in training) form the val split; the rest is train.
  Empty rows are skipped; text that is not UTF-8 reads as U+FFFD.
  A tokenizer trained here skips those documents (the first ones up to VAL_CHARS_PER_TOKEN characters per val
  token) and later copies of them, so val is unseen text.
  A later document identical to a val one (sha1 of its text; web crawls repeat pages) is left out of train and
  counted (in the closing summary, when there are any).
- index.json records, per shard, the repo, commit sha and parquet row ranges its documents came from, so
  `python shards.py refetch data/fineweb_edu FILE` re-downloads and re-makes exactly that shard.
- Remote failures exit with a one-line cause: HTTP 401/403 = storage denied (token or billing, not data).
- Resume: the build lives in OUT/.staging with a journal (resume.json) written at each closed train shard; a run
  killed, interrupted, or stopped by a full disk or the Hub resumes when re-run with the same arguments (its
  tokenizer, shards and place in the parquet files; the corpus is the same bytes as an uninterrupted run's). Other corpus arguments, a torn
  journal or a changed shard start over with a one-line note; --fresh starts over on purpose.
"""

import argparse
import hashlib
import itertools
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the documents val will take are left out of a tokenizer trained here (val must be text the tokenizer never saw):
# the first ones up to this many characters per val token, generous (English web text runs ~4.5)
VAL_CHARS_PER_TOKEN = 8
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # repo root: tokenizer.py, shards.py
import checkpoint  # noqa: E402
import shards  # noqa: E402
from tokenizer import Tokenizer, reuse_tokenizer, train_tokenizer  # noqa: E402


def _count(v):
    return type(v) is int and v >= 0  # (not a bool, a float or a string of digits)


# what a resumed build restores from its journal, besides the tokenizer, and the shape this script writes it in (a
# journal of another shape is torn: a fresh start with a note, not a traceback mid-build)
JOURNAL_FIELDS = {
    "splits": lambda v: type(v) is dict and set(v) == {"val", "train"} and all(type(es) is list for es in v.values()),
    "val_docs": lambda v: v is None or _count(v),
    "next": lambda v: v is None or type(v) is dict and type(v.get("file")) is str and _count(v.get("row")),
    "counts": lambda v: type(v) is dict and set(v) == {"val", "train"} and all(map(_count, v.values())),
    "documents": _count,
    "files": lambda v: type(v) is list and all(type(f) is str for f in v),
    "val_digests": lambda v: type(v) is list and all(type(h) is str and len(h) == 40
                                                    and not h.strip("0123456789abcdef") for h in v),
    "val_copies": _count,
}


def documents(repo, revision, files, column, start=None, batch_rows=1024):
    """(parquet file, row number, text) of every non-empty row, file by file, downloading each when reached; from
    start = (file, row) on when given (a resumed build)."""
    for file in files[files.index(start[0]) if start else 0:]:
        path = shards.hub_download(repo, file, "dataset", revision)
        rows = enumerate(shards.parquet_column(path, file, column, batch_rows))
        for row, text in itertools.islice(rows, start[1] if start and file == start[0] else 0, None):
            if text:
                yield file, row, text


def corpus_key(args, revision):
    """The arguments that determine the corpus: a build is resumed only by a run with the same ones."""
    trained = args.reused_tokenizer is None  # (a reused tokenizer by its hash: vocab and chars are its own)
    return {"--repo": args.repo, "--revision": revision, "--pattern": args.pattern, "--column": args.column,
            "--max-tokens": args.max_tokens, "--val-tokens": args.val_tokens,
            "--vocab-size": args.vocab_size if trained else None,
            "--tokenizer": None if trained else args.reused_tokenizer.hash,
            "--tokenizer-chars": args.tokenizer_chars if trained else None, "--shard-tokens": args.shard_tokens}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default="HuggingFaceFW/fineweb-edu", help="Hub dataset repo")
    ap.add_argument("--revision", default="main", help="branch or commit (the commit sha is recorded)")
    ap.add_argument("--pattern", default="sample/10BT/*.parquet", help="parquet files to use (glob, in name order)")
    ap.add_argument("--column", default="text", help="text column of the parquet files")
    ap.add_argument("--max-tokens", type=int, default=100_000_000, help="corpus size cap (whole documents only)")
    ap.add_argument("--val-tokens", type=int, default=None,
                    help="tokens of val documents (default 0.5%% of max, <=10M; 0: no val split)")
    ap.add_argument("--vocab-size", type=int, default=None, help="vocab when training a tokenizer (default 32768)")
    ap.add_argument("--tokenizer", default=None, help="reuse this tokenizer file instead of training one")
    ap.add_argument("--tokenizer-chars", type=int, default=1_000_000_000, help="characters of text to train it on")
    ap.add_argument("--shard-tokens", type=int, default=1 << 26, help="tokens per shard (whole documents, so about)")
    ap.add_argument("--out", default=HERE, help="corpus dir to write (default: this script's folder)")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1)), help="tokenizer threads")
    ap.add_argument("--fresh", action="store_true", help="discard an interrupted run's build instead of resuming it")
    args = ap.parse_args()
    if args.threads < 1:
        ap.error(f"--threads {args.threads}: at least 1")
    # a negative cap was found only after the download ("no train split left"), or gave val one document anyway
    for flag, least in (("max_tokens", 1), ("tokenizer_chars", 1), ("val_tokens", 0)):
        if getattr(args, flag) is not None and getattr(args, flag) < least:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: at least {least}")
    args.reused_tokenizer = None  # loaded (and checked against --vocab-size) before anything is read or written
    if args.tokenizer:
        try:
            args.reused_tokenizer = reuse_tokenizer(args.tokenizer, args.vocab_size)
        except ValueError as e:
            sys.exit(f"error: {e}")
    if args.vocab_size is None:
        args.vocab_size = 32768
    args.journaled = False  # set once OUT/.staging holds a build a re-run resumes
    resume = lambda: "; re-run the same command to resume" if args.journaled else ""  # noqa: E731
    try:
        run(args)
    except (shards.StorageError, shards.DataError) as e:  # (the Hub down, a corrupt cached file: fixed, it resumes)
        sys.exit(f"error: {e}{resume()}")
    except ValueError as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # a full disk, an --out that cannot be written: the corpus there is as it was
        sys.exit(f"error: {checkpoint.os_error_line(e, args.out)}; the corpus in --out is as it was{resume()}")


def run(args):
    t0 = time.time()
    revision, files = shards.hub_dataset_files(args.repo, args.revision, args.pattern)
    print(f"{args.repo}@{revision[:12]}: {len(files)} parquet files match {args.pattern}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"{args.out}: exists and is not a folder; pass --out DIR")
    # --column checked on the first file before anything is written; a run that fails later leaves the corpus in
    # --out as it was (the new one is built in a staging folder and swapped in at the end)
    shards.text_column(shards.parquet_file(shards.hub_download(args.repo, files[0], "dataset", revision), files[0],
                                           args.column), files[0], args.column)
    with shards.staging(args.out, "data/fineweb_edu/prepare.py", resumable=True) as stage:
        build(args, revision, files, stage, t0)


def build(args, revision, files, stage, t0):
    """Tokenizer and shards into `stage`, then swapped in for the corpus in args.out (shards.install_corpus)."""
    tok_path = os.path.join(stage, "tokenizer.json")
    val_target = args.val_tokens if args.val_tokens is not None else min(10_000_000, args.max_tokens // 200)
    no_val = args.val_tokens == 0  # asked for no val split (the default's share keeps one document, however small)
    val_docs = [float("inf")]  # val comes from the first documents; a tokenizer trained here never sees them
    key = corpus_key(args, revision)
    journal, note = shards.resume_journal(stage, key, args.fresh, JOURNAL_FIELDS)
    if note:
        print(f"note: {note}")
    if journal:  # the tokenizer the killed run trained or reused (checked against the journal's hash)
        tok = Tokenizer.load(tok_path)
        val_docs[0] = float("inf") if journal["val_docs"] is None else journal["val_docs"]
        at = f"at {journal['next']['file']} row {journal['next']['row']}" if journal["next"] else "at the start"
        n_shards = sum(map(len, journal["splits"].values()))
        print(f"resuming from {stage}: {n_shards} shard{'s' * (n_shards != 1)}, "
              f"{sum(journal['counts'].values()):,} tokens done, {at}")
    elif args.tokenizer:
        tok = args.reused_tokenizer
        tok.save(tok_path)
        print(f"reusing tokenizer {args.tokenizer} (vocab {tok.vocab_size})")
    else:
        def training_texts():
            chars, skipped, n_skipped, held = 0, 0, 0, set()
            with shards.progress_bar(total=args.tokenizer_chars, desc="tokenizer text", unit="char",
                                     unit_scale=True) as bar:
                for _, _, text in documents(args.repo, revision, files, args.column):
                    digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).digest()
                    if not no_val and (n_skipped == 0 or skipped < VAL_CHARS_PER_TOKEN * val_target):  # val's
                        skipped += len(text)
                        n_skipped += 1
                        val_docs[0] = n_skipped
                        held.add(digest)
                        continue
                    if digest in held:  # a later copy of a held-out page (it was trained on: val was not unseen)
                        continue
                    if chars >= args.tokenizer_chars:
                        return
                    chars += len(text)
                    bar.update(len(text))
                    yield text

        t1 = time.time()
        tok = train_tokenizer(training_texts(), args.vocab_size)
        tok.save(tok_path)
        print(f"trained tokenizer: vocab {tok.vocab_size} in {time.time() - t1:.0f}s")
    if not journal:  # (the tokenizer is the first expensive step: a run killed after it resumes without training)
        journal = {"key": key, "tokenizer": "tokenizer.json", "tokenizer_sha256": tok.hash,
                   "val_docs": None if val_docs[0] == float("inf") else val_docs[0], "next": None,
                   "splits": {"val": [], "train": []}, "counts": {"val": 0, "train": 0}, "documents": 0, "files": [],
                   "val_digests": [], "val_copies": 0}
        shards.save_journal(stage, journal)
    args.journaled = True

    make_source = lambda rows: shards.hub_source(args.repo, "dataset", revision, args.column, rows)  # noqa: E731
    writers = {s: shards.ShardWriter(stage, s, args.shard_tokens, make_source) for s in ("val", "train")}
    for s in writers:
        writers[s].entries = journal["splits"][s]
    counts, n_docs, used_files = journal["counts"], journal["documents"], journal["files"]
    stop_reason = "source exhausted"
    # sha1 of each val document: a later copy of one is not trained on
    val_texts, n_val_copies = {bytes.fromhex(h) for h in journal["val_digests"]}, journal["val_copies"]
    batch_docs = 512 * max(1, args.threads)
    bar = shards.progress_bar(total=args.max_tokens, initial=counts["val"] + counts["train"], desc="tokenizing",
                              unit="tok", unit_scale=True)
    start = (journal["next"]["file"], journal["next"]["row"]) if journal["next"] else None
    doc_iter = documents(args.repo, revision, files, args.column, start)
    done = False
    while not done:
        batch = [d for _, d in zip(range(batch_docs), doc_iter)]
        if not batch:
            break
        for (file, row, text), toks in zip(batch, shards.documents_to_tokens(tok, [t for _, _, t in batch], args.threads)):
            total = counts["val"] + counts["train"]
            if total + len(toks) > args.max_tokens:  # whole documents only: the cap ends the corpus here
                stop_reason = f"--max-tokens {args.max_tokens:,} reached (next document: {len(toks):,} tokens)"
                done = True
                break
            split = ("val" if not no_val and n_docs < val_docs[0] and (counts["val"] < val_target or counts["val"] == 0)
                     else "train")
            digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).digest()
            if split == "val":
                val_texts.add(digest)
            elif digest in val_texts:  # (web crawls repeat pages: the copy made val loss a training loss)
                n_val_copies += 1
                continue
            n_train_shards = len(writers["train"].entries)
            writers[split].add(toks, (file, row))
            if len(writers["train"].entries) > n_train_shards:  # a train shard closed: journal the state before this doc
                writers["val"].flush()  # (val is the accepted documents' prefix: final once a train one is taken)
                journal.update(splits={s: w.entries for s, w in writers.items()}, next={"file": file, "row": row},
                               counts=counts, documents=n_docs, files=used_files, val_copies=n_val_copies,
                               val_digests=journal["val_digests"] or sorted(d.hex() for d in val_texts))
                shards.save_journal(stage, journal)
                if os.environ.get("PICAFLOR_INJECT_KILL_AT_SHARDS") == str(len(writers["train"].entries)):
                    os.kill(os.getpid(), signal.SIGKILL)  # a machine gone mid-run: the resume test
            counts[split] += len(toks)
            n_docs += 1
            if not used_files or used_files[-1] != file:
                used_files.append(file)
            bar.update(len(toks))
    bar.close()
    if counts["val"] < val_target and val_docs[0] != float("inf"):
        print(f"note: val holds {counts['val']:,} tokens, under --val-tokens {val_target:,}: only the "
              f"{val_docs[0]:,} documents the tokenizer did not train on can be val")
    if counts["train"] == 0:
        raise ValueError(f"{args.repo}: only {n_docs} document(s) fit in --max-tokens {args.max_tokens:,}; no train "
                         f"split left (raise --max-tokens or lower --val-tokens)")
    splits = {s: writers[s].close() for s in ("train", "val")}
    index = {
        "version": shards.INDEX_VERSION, "tokenizer": "tokenizer.json", "tokenizer_sha256": tok.hash,
        "vocab_size": tok.vocab_size,
        "source": {"kind": "hub", "repo": args.repo, "repo_type": "dataset", "revision": revision,
                   "pattern": args.pattern, "column": args.column, "files": used_files, "documents": n_docs,
                   "max_tokens": args.max_tokens, "stopped": stop_reason, "made_by": "data/fineweb_edu/prepare.py",
                   "argv": sys.argv[1:]},
        "splits": splits,
    }
    shards.install_corpus(args.out, stage, index)
    print(f"{n_docs:,} documents from {len(used_files)} parquet file(s); stopped: {stop_reason}"
          + (f"; {n_val_copies:,} train copies of val documents left out" if n_val_copies else ""))
    for s, entries in splits.items():
        print(f"{s}: {len(entries)} shard{'s' * (len(entries) != 1)}, {counts[s]:,} tokens")
    print(f"wrote {os.path.join(args.out, 'index.json')} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as e:  # (a traceback): shards.staging keeps the half-built corpus for a resume
        print(str(e) or "interrupted; the corpus in --out is as it was; re-run the same command to resume "
              "(--fresh: start over)", file=sys.stderr)
        sys.exit(130)
