"""
Build the offline corpus: no network, from a folder of .txt/.md/.py files (default: the installed Python's own
standard library sources, docstrings included), so the whole loop runs on a laptop.

    python data/local/prepare.py                         # stdlib, vocab 8192 (config/tiny.py), into data/local/
    python data/local/prepare.py --src ~/notes --vocab-size 32768 --out /tmp/corpus
    python data/local/prepare.py --tokenizer data/fineweb_edu/tokenizer.json   # reuse a tokenizer, no training

Calls recorded here:
- one file = one document: <|bos|> + its tokens, never cut (a document goes whole into one shard).
- the default vocab is 8192, config/tiny.py's; the nano run uses 32768 (on FineWeb-Edu).
- files are taken in a fixed pseudo-random order (sha1 of the relative path) so --max-files/--max-bytes caps
  sample the whole tree, not its first letters; a file goes to val when the sha1 of its text says so
  (--val-percent), so identical files land in the same split; a folder too small for any to land in val gives
  val one document (with its copies), unless --val-percent 0 asked for no val split.
- the default --max-bytes (64 MB) takes a whole stdlib (Python 3.11: ~1,870 files, 32 MB, ~8.2M tokens at vocab
  8192; 6-8 s on 2 cores); lower it (or --max-files) for a quicker, smaller corpus.
- index.json records, per shard, the exact files it holds, so shards.py refetch can re-make it.
"""

import argparse
import hashlib
import os
import sys
import sysconfig
import time

from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # repo root: tokenizer.py, shards.py
import checkpoint  # noqa: E402
import shards  # noqa: E402
from tokenizer import reuse_tokenizer, train_tokenizer  # noqa: E402

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "node_modules"}


def find_files(root, exts):
    """Relative paths of every file with one of exts under root (skipping installed packages, caches, dot-dirs)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        for name in filenames:  # dot-files (editor locks, often dangling links) and anything unreadable are skipped
            path = os.path.join(dirpath, name)
            if name.endswith(exts) and not name.startswith(".") and os.path.isfile(path) and os.access(path, os.R_OK):
                found.append(os.path.relpath(path, root))
    return found


def sha1_number(data):
    return int(hashlib.sha1(data).hexdigest(), 16)


def path_hash(rel):
    return sha1_number(os.fsencode(rel))  # the name's bytes: not every file name is UTF-8


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=sysconfig.get_paths()["stdlib"], help="folder of text files (default: stdlib)")
    ap.add_argument("--out", default=HERE, help="corpus dir to write (default: this script's folder)")
    ap.add_argument("--exts", default=".py,.txt,.md", help="comma-separated file endings to take")
    ap.add_argument("--max-files", type=int, default=0, help="take at most this many files (0: no cap)")
    ap.add_argument("--max-bytes", type=int, default=64_000_000, help="stop adding files past this many bytes (0: no cap)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="tokenizer vocab incl. id 0 and specials (default 8192; nano: 32768)")
    ap.add_argument("--tokenizer", default=None, help="reuse this tokenizer file instead of training one")
    ap.add_argument("--shard-tokens", type=int, default=1 << 22, help="tokens per shard (whole documents, so about)")
    ap.add_argument("--val-percent", type=float, default=2.0,
                    help="percent of documents held out for val (0: no val split, no val loss in training)")
    ap.add_argument("--threads", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="tokenizer threads")
    args = ap.parse_args()
    t0 = time.time()
    if args.threads < 1:  # checked before anything is written: the old corpus is removed further down
        ap.error(f"--threads {args.threads}: at least 1")
    for flag in ("max_files", "max_bytes"):  # a negative cap was "reached" at once: "found no files for training"
        if getattr(args, flag) < 0:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: 0 (no cap) or more")
    if not 0 <= args.val_percent < 100:  # -5 was taken as 0; 100 said "found no files for training; pass --src DIR"
        ap.error(f"--val-percent {args.val_percent:g}: in [0, 100) (the rest is trained on)")
    if args.shard_tokens < 1:  # (0 or less wrote a shard per document, silently)
        ap.error(f"--shard-tokens {args.shard_tokens}: at least 1")
    args.reused_tokenizer = None  # loaded (and checked against --vocab-size) before anything is read or written
    if args.tokenizer:
        try:
            args.reused_tokenizer = reuse_tokenizer(args.tokenizer, args.vocab_size)
        except ValueError as e:
            sys.exit(f"error: {e}")
    if args.vocab_size is None:
        args.vocab_size = 8192
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        sys.exit(f"error: {args.out}: exists and is not a folder; pass --out DIR")

    if not os.path.isdir(args.src):
        sys.exit(f"error: {args.src}: no such folder; pass --src DIR with .txt/.md/.py files")
    exts = tuple(e if e.startswith(".") else "." + e for e in args.exts.split(",") if e)
    rels = sorted(find_files(args.src, exts), key=lambda r: (path_hash(r), r))
    docs, total_bytes, capped = [], 0, None  # (rel, text, split)
    for k, rel in enumerate(tqdm(rels, desc="reading", unit="file", disable=None)):
        if args.max_files and len(docs) >= args.max_files or args.max_bytes and total_bytes >= args.max_bytes:
            capped = (len(rels) - k, "--max-files" if args.max_files and len(docs) >= args.max_files else "--max-bytes")
            break
        try:
            text = shards.read_document(os.path.join(args.src, rel))
        except OSError as e:  # (a traceback naming no file; find_files' os.access passes anything for root)
            sys.exit(f"error: {os.path.join(args.src, rel)}: cannot be read ({e.strerror or e}); fix or remove it, or "
                     f"leave it out with --exts / another --src")
        if not text.strip():
            continue
        # by the text, not the name: identical files (the stdlib has 11 groups) once landed in both train and val
        split = "val" if sha1_number(text.encode("utf-8", "surrogatepass")) % 10000 < args.val_percent * 100 else "train"
        docs.append((rel, text, split))
        total_bytes += len(text.encode("utf-8"))
    # tiny folders still get a val document; --val-percent 0 asked for none (it moved one anyway)
    if args.val_percent > 0 and sum(s == "val" for _, _, s in docs) == 0 and len(docs) > 1:
        held = docs[-1][1]  # with every identical copy (one left in train leaked val into training)
        docs = [(rel, text, "val" if text == held else split) for rel, text, split in docs]
    n_train = sum(s == "train" for _, _, s in docs)
    if n_train == 0:
        sys.exit(f"error: {args.src}: found no non-empty {'/'.join(exts)} files for training; pass --src DIR")
    print(f"{len(docs):,} documents ({n_train:,} train, {len(docs) - n_train:,} val), {total_bytes / 1e6:.1f} MB "
          f"from {args.src}" + (f"; {capped[0]:,} more files left out by {capped[1]} (raise it to include them)"
                                if capped else ""))
    if args.val_percent == 0:
        print("--val-percent 0: no val split; train.py will log no val loss")

    try:
        with shards.staging(args.out, "data/local/prepare.py") as stage:  # a failed run leaves --out as it was
            build(args, docs, exts, total_bytes, stage, t0)
    except shards.DataError as e:  # (another prepare.py writing --out)
        sys.exit(f"error: {e}")
    except OSError as e:  # a full disk, an --out that cannot be written: the corpus there is as it was
        sys.exit(f"error: {checkpoint.os_error_line(e, args.out)}; the corpus in --out is as it was")


def build(args, docs, exts, total_bytes, stage, t0):
    """Tokenizer and shards into `stage`, then swapped in for the corpus in args.out (shards.install_corpus)."""
    tok_path = os.path.join(stage, "tokenizer.json")
    if args.tokenizer:
        tok = args.reused_tokenizer
        tok.save(tok_path)
        print(f"reusing tokenizer {args.tokenizer} (vocab {tok.vocab_size})")
    else:
        t1 = time.time()
        try:
            tok = train_tokenizer((text for _, text, s in docs if s == "train"), args.vocab_size)
        except ValueError as e:
            sys.exit(f"error: {e}")
        tok.save(tok_path)
        print(f"trained tokenizer: vocab {tok.vocab_size} in {time.time() - t1:.1f}s")

    writers = {s: shards.ShardWriter(stage, s, args.shard_tokens, lambda rs: shards.files_source(args.src, rs))
               for s in ("train", "val")}
    batch = 256
    with tqdm(total=total_bytes, desc="tokenizing", unit="B", unit_scale=True, disable=None) as bar:
        for i in range(0, len(docs), batch):
            chunk = docs[i:i + batch]
            for (rel, text, split), toks in zip(chunk, shards.documents_to_tokens(tok, [d[1] for d in chunk], args.threads)):
                writers[split].add(toks, rel)
                bar.update(len(text.encode("utf-8")))
    splits = {s: w.close() for s, w in writers.items()}
    index = {
        "version": shards.INDEX_VERSION, "tokenizer": "tokenizer.json", "tokenizer_sha256": tok.hash,
        "vocab_size": tok.vocab_size,
        "source": {"kind": "files", "root": os.path.abspath(args.src), "exts": list(exts), "max_files": args.max_files,
                   "max_bytes": args.max_bytes, "val_percent": args.val_percent, "documents": len(docs),
                   "bytes": total_bytes, "made_by": "data/local/prepare.py", "argv": sys.argv[1:]},
        "splits": splits,
    }
    shards.install_corpus(args.out, stage, index)
    for s, entries in splits.items():
        print(f"{s}: {len(entries)} shard{'s' if len(entries) != 1 else ''}, "
              f"{sum(e['tokens'] for e in entries):,} tokens")
    print(f"wrote {os.path.join(args.out, 'index.json')} in {time.time() - t0:.1f}s; train on it: "
          f"{train_command(args.out, tok.vocab_size)}")


def train_command(out, vocab_size):
    """config/tiny.py's command for the corpus in out: train.py finds a corpus as data_root/dataset (default
    data/local, from the repo root) and its model's vocab must hold the tokenizer's (tiny's: 8192)."""
    import shlex
    root, name = os.path.split(os.path.abspath(out))
    cmd = ["python", "train.py", "config/tiny.py"]
    if root != os.path.abspath("data"):
        cmd.append(f"--data_root={root}")
    if name != "local":
        cmd.append(f"--dataset={name}")
    if vocab_size != 8192:
        cmd.append(f"--vocab_size={vocab_size}")
    return shlex.join(cmd)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as e:  # (a traceback): shards.staging has removed the half-built corpus
        print(str(e) or "interrupted; the corpus in --out is as it was", file=sys.stderr)
        sys.exit(130)
