"""
Chat corpus for supervised fine-tuning: conversations -> uint16 token shards + uint8 loss masks.

    python data/smoltalk/prepare.py --tokenizer out/tiny                     # smol-smoltalk, rows of 256 (tiny)
    python data/smoltalk/prepare.py --tokenizer out/nano                     # the nano SFT run: rows of 2048
    python data/smoltalk/prepare.py --tokenizer out/tiny --jsonl my_chats.jsonl   # offline: local conversations

--tokenizer is the PRETRAINED model's tokenizer (a checkpoint dir / run dir, its corpus dir, or a tokenizer.json file):
SFT data must be tokenized exactly as the model was pretrained. From the Hub (--repo, default
HuggingFaceTB/smol-smoltalk, a dataset) it downloads the parquet files matching --pattern with huggingface_hub (HF
cache, commit pinned) and reads the "messages" column (a list of {role, content}); files whose name contains "test"
are the val split.
--jsonl FILE reads one conversation per line instead: a JSON list of {role, content} (or {"messages": [...]}).

Calls recorded here:
- Rendering is chat.py's render_conversation (the one chat format); the mask is 1 on assistant content and its
  closing <|end|> (shards.py applies it: y = -1 elsewhere).
- Packing: conversations go whole into rows of exactly --max-len tokens (best fit among a few open rows); the
  rest of a row is padding <|bos|> tokens with mask 0 (train.py routes them but leaves them out of the expert
  load). Shards hold whole rows, so train.py with
  seq_len = --max-len reads every conversation whole in one window (index.json "row_tokens"); train.py's doc_mask
  keeps each conversation's attention within itself (each starts with <|bos|>).
- A conversation longer than --max-len is split at exchange boundaries (an exchange = the user turns up to an
  answer and the replies up to the next user turn); each piece starts with <|bos|> and the system prompt (every
  leading system message) if it fits, as chat.py drops the oldest exchanges of a full context. Splits are
  counted. An exchange that alone exceeds --max-len is dropped (counted, its tokens reported): never cut.
- Turns after the last assistant turn are dropped (counted: trailing_turns_dropped): nothing in them is trained.
  Other role orders (two user turns in a row, a system message mid-conversation) are rendered as given, as the
  HF and GGUF chat templates render them.
- Bad rows are counted by kind and skipped, never a crash: unknown role, empty assistant turn, no assistant
  turn, malformed row (not a list of {role, content} strings), malformed JSON or a line that is not UTF-8
  (--jsonl; such a line was trained on as U+FFFD characters), or text holding a lone surrogate (a JSON "\ud83d",
  half an emoji: also trained on as U+FFFD).
- val: the Hub's test file(s) (at most --val-conversations conversations); without one the first
  --val-conversations conversations are held out; with --jsonl the first --val-conversations, at most 10% of
  its lines (a Hub repo is streamed, its size unknown up front: a small one needs a smaller --val-conversations).
- A run that fails (no usable train split, a full disk) leaves the corpus in --out as it was: the new one is
  built in a staging folder and swapped in at the end.
"""

import argparse
import hashlib
import itertools
import json
import os
import re
import sys
import time
from collections import Counter

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # repo root: tokenizer.py, shards.py, chat.py
import checkpoint  # noqa: E402
import shards  # noqa: E402
from chat import ChatFormatError, check_messages, render_conversation  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

NOT_UTF8 = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of a byte that is not UTF-8
OPEN_ROWS = 16  # rows kept open for best-fit packing (more: less padding, a little more memory)


def load_tokenizer_arg(path):
    """(tokenizer, its file, the model's max_seq_len or None) from a tokenizer file, corpus or checkpoint/run dir."""
    max_seq_len = None
    if os.path.isfile(os.path.join(path, "index.json")):  # a corpus folder: its tokenizer, checked against its index
        return shards.load_corpus_tokenizer(path), os.path.join(path, "tokenizer.json"), None
    if os.path.isdir(path):
        try:
            ck = checkpoint.resolve(path)
        except checkpoint.CheckpointError as e:
            raise ValueError(str(e)) from None
        path = os.path.join(ck, "tokenizer.json")
        if not os.path.exists(path):
            raise ValueError(f"{path}: the checkpoint has no tokenizer.json; pass --tokenizer the corpus's tokenizer.json")
        try:
            max_seq_len = int(json.load(open(os.path.join(ck, "state.json")))["model_config"]["max_seq_len"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return Tokenizer.load(path), path, max_seq_len


# ----------------------------------------------------------------------------------------------------------
# sources: (reference, messages) or (reference, ChatFormatError) per conversation

def jsonl_lines(path):
    """(line number, line) of a JSONL file; a read error names the file (an EIO said only "Input/output error").
    A byte that is not UTF-8 is kept as a lone surrogate (surrogateescape), for jsonl_conversations to refuse."""
    try:  # (errors="replace" trained a Latin-1 file's every accented letter as U+FFFD, reporting no bad row)
        with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:  # -sig: a BOM (Windows) cost row 1
            yield from enumerate(f, 1)
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e}); copy it to a readable disk and pass that "
                         f"--jsonl") from None


def jsonl_conversations(path):
    for n, line in jsonl_lines(path):
        if not line.strip():
            continue
        if bad := NOT_UTF8.search(line):
            byte = ord(bad.group()) - 0xDC00
            yield (path, n), ChatFormatError(f"not valid UTF-8 (byte 0x{byte:02x} at column {bad.start() + 1}); "
                                             f"convert the file to UTF-8 (iconv -f latin1 -t utf-8, or its own "
                                             f"encoding)", "not_utf8")
            continue
        try:
            row = json.loads(line)
        except ValueError:
            yield (path, n), ChatFormatError("not valid JSON", "malformed_json")
            continue
        yield (path, n), row.get("messages") if isinstance(row, dict) else row


def hub_conversations(repo, revision, files, column, limit=None):
    n = 0
    for file in files:
        path = shards.hub_download(repo, file, "dataset", revision)
        for row, messages in enumerate(shards.parquet_column(path, file, column)):
            if limit is not None and n >= limit:
                return
            yield (file, row), messages
            n += 1


# ----------------------------------------------------------------------------------------------------------
# conversation -> pieces of at most max_len tokens, split at exchange boundaries

def pieces_of(tok, messages, bodies, max_len, stats):
    """[(ids, mask), ...] for one valid conversation; updates stats (splits, dropped exchanges)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    if last + 1 < len(messages):  # turns after the last answer: nothing in them is trained, they only took row space
        stats["trailing_turns_dropped"] += len(messages) - last - 1
        messages, bodies = messages[:last + 1], bodies[:last + 1]
    ids, mask = render_conversation(tok, messages, need_assistant=True, bodies=bodies)
    if len(ids) <= max_len:
        return [(ids, mask)]
    turn_len = [len(b) + 2 for b in bodies]  # <|role|> + content + <|end|>
    n_system = next(i for i, m in enumerate(messages) if m["role"] != "system")
    system = list(range(n_system))  # every leading system message (a second one was cut off as an exchange)
    exchanges, cur = [], []  # lists of message indices; a new exchange starts at the first user turn after an answer
    for i in range(n_system, len(messages)):  # (at every user turn: a question in two messages lost its first half)
        if messages[i]["role"] == "user" and any(messages[j]["role"] == "assistant" for j in cur):
            exchanges.append(cur)
            cur = []
        cur.append(i)
    if cur:
        exchanges.append(cur)
    groups, cur, cur_len = [], None, 0
    for ex in exchanges:
        ex_len = sum(turn_len[i] for i in ex)
        if cur is not None and cur_len + ex_len <= max_len:
            cur += ex
            cur_len += ex_len
            continue
        if cur is not None:
            groups.append(cur)
        sys_len = sum(turn_len[i] for i in system)
        if 1 + sys_len + ex_len <= max_len:
            cur, cur_len = system + ex, 1 + sys_len + ex_len
        elif 1 + ex_len <= max_len:
            cur, cur_len = list(ex), 1 + ex_len
            stats["pieces_without_system_prompt"] += bool(system)  # its instructions did not fit beside it
        else:  # one exchange longer than a row: dropped, never cut
            stats["exchanges_dropped_too_long"] += 1
            stats["tokens_dropped_too_long"] += ex_len
            cur, cur_len = None, 0
    if cur is not None:
        groups.append(cur)
    out = []
    for g in groups:
        sub = [messages[i] for i in g]
        if not any(m["role"] == "assistant" for m in sub):
            stats["pieces_without_assistant"] += 1
            continue
        out.append(render_conversation(tok, sub, bodies=[bodies[i] for i in g]))
    stats["conversations_split"] += 1
    stats["split_pieces"] += len(out)
    return out


class RowPacker:
    """Best-fit packing of pieces into rows of exactly row_len tokens (padding: <|bos|>, mask 0)."""

    def __init__(self, writer, row_len, pad_id):
        self.writer, self.row_len, self.pad_id = writer, row_len, pad_id
        self.rows = []  # [ids, mask, refs]
        self.pad_tokens = self.n_rows = 0

    def add(self, ids, mask, ref):
        fits = [r for r in self.rows if len(r[0]) + len(ids) <= self.row_len]
        if fits:
            row = min(fits, key=lambda r: self.row_len - len(r[0]))
        else:
            if len(self.rows) >= OPEN_ROWS:
                self.emit(max(self.rows, key=lambda r: len(r[0])))
            row = [[], [], []]
            self.rows.append(row)
        row[0] += ids
        row[1] += mask
        row[2].append(ref)

    def emit(self, row):
        self.rows.remove(row)
        pad = self.row_len - len(row[0])
        self.pad_tokens += pad
        self.n_rows += 1
        ids = np.array(row[0] + [self.pad_id] * pad, dtype=shards.SHARD_DTYPE)
        self.writer.add(ids, row[2], np.array(row[1] + [0] * pad, dtype=np.uint8))

    def close(self):
        for row in sorted(self.rows, key=lambda r: -len(r[0])):
            self.emit(row)
        return self.writer.close()


def build(tok, split_sources, max_len, out_dir, shard_tokens, stats, keep_val_copies=False):
    """split_sources: {split: iterator of (ref, messages)} -> {split: shard entries}."""
    shard_tokens = max(max_len, shard_tokens // max_len * max_len)  # shards hold whole rows
    def make_source(refs):  # refs: per row, the (file, line or row) of each piece packed into it
        pieces = [ref for row in refs for ref in row]
        return {"kind": "chat", "pieces": len(pieces), "conversations": len(set(pieces)),
                "files": sorted({str(ref[0]) for ref in pieces})}
    out, val_keys = {}, set()  # val conversations by content: a train copy of one is left out
    for split, source in split_sources.items():
        packer = RowPacker(shards.ShardWriter(out_dir, split, shard_tokens, make_source, with_mask=True), max_len,
                           tok.bos_id)
        batch = []

        def flush(batch):
            texts = [m["content"] for _, msgs in batch for m in msgs]
            flat = tok.encode_batch(texts) if texts else []
            k = 0
            for ref, msgs in batch:
                bodies, k = flat[k:k + len(msgs)], k + len(msgs)
                for ids, mask in pieces_of(tok, msgs, bodies, max_len, stats):
                    packer.add(ids, mask, ref)
                    stats[f"{split}_pieces"] += 1
                    stats[f"{split}_target_tokens"] += sum(mask)
                stats[f"{split}_conversations"] += 1

        for ref, msgs in shards.progress_bar(source, desc=f"{split} conversations", unit="conv"):
            stats["rows_read"] += 1
            try:
                if isinstance(msgs, ChatFormatError):
                    raise msgs
                check_messages(msgs, need_assistant=True)
            except ChatFormatError as e:
                stats[f"bad_{e.kind}"] += 1
                if stats[f"bad_{e.kind}"] <= 3:  # a few examples, then only the count
                    print(f"skipped {ref[0]}:{ref[1]}: {e}", file=sys.stderr)
                continue
            key = hashlib.sha1(json.dumps(msgs, sort_keys=True).encode("utf-8", "surrogatepass")).digest()
            if split == "val":  # (split_sources gives val first)
                val_keys.add(key)
            elif key in val_keys and not keep_val_copies:  # (chat sets repeat conversations: val loss measured recall)
                stats["train_copies_of_val_left_out"] += 1
                continue
            batch.append((ref, msgs))
            if len(batch) >= 512:
                flush(batch)
                batch = []
        flush(batch)
        out[split] = packer.close()
        stats[f"{split}_rows"] = packer.n_rows
        stats[f"{split}_pad_tokens"] = packer.pad_tokens
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True,
                    help="the pretrained model's tokenizer: checkpoint dir, its corpus dir or tokenizer.json")
    ap.add_argument("--jsonl", default=None, help="local conversations instead of the Hub (one JSON list per line)")
    ap.add_argument("--repo", default="HuggingFaceTB/smol-smoltalk", help="Hub dataset repo")
    ap.add_argument("--revision", default="main", help="branch or commit (the commit sha is recorded)")
    ap.add_argument("--pattern", default="data/*.parquet", help="parquet files to use (glob); names with the word 'test' = val")
    ap.add_argument("--column", default="messages", help="conversation column (a list of {role, content})")
    ap.add_argument("--max-len", type=int, default=None, help="row length in tokens = train seq_len (default: the "
                    "--tokenizer checkpoint's max_seq_len, at most 2048; 2048 for a tokenizer file)")
    ap.add_argument("--max-conversations", type=int, default=None, help="cap on train conversations (default: all)")
    ap.add_argument("--val-conversations", type=int, default=1000,
                    help="val conversations held out (1000; of a --jsonl file, at most a tenth)")
    ap.add_argument("--shard-tokens", type=int, default=1 << 25, help="tokens per shard (whole rows)")
    ap.add_argument("--keep-val-copies", action="store_true", help="keep train conversations identical to a val one "
                    "(left out by default: val loss would measure memorised text)")
    ap.add_argument("--out", default=HERE, help="corpus dir to write (default: this script's folder)")
    args = ap.parse_args()
    try:
        run(args)
    except (shards.StorageError, shards.DataError, ValueError) as e:
        offline = getattr(e, "kind", None) == "unreachable" and not args.jsonl  # the way on without the Hub
        sys.exit(f"error: {e}" + ("; offline, --jsonl FILE reads your own conversations (a JSON list of "
                                  "{role, content} per line)" if offline else ""))
    except OSError as e:  # a full disk, an --out that cannot be written: the corpus there is as it was
        sys.exit(f"error: {checkpoint.os_error_line(e, args.out)}; the corpus in --out is as it was")


def run(args):
    t0 = time.time()
    tok, tok_src, model_max = load_tokenizer_arg(args.tokenizer)
    if args.max_len is None:  # the model's context, at most 2048 (nano's SFT rows); config/sft.py's seq_len matches
        args.max_len = min(2048, model_max or 2048)
        print(f"--max-len {args.max_len} (rows = train seq_len)")
    if args.max_len < 8:
        raise ValueError(f"--max-len {args.max_len}: too short for a conversation; pass --max-len 8 or more")
    # (a negative cap was islice's own error; no val was found only after the whole train split was built)
    for flag in ("max_conversations", "val_conversations"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: at least 1")
    stats = Counter()
    if args.jsonl:
        if not os.path.isfile(args.jsonl):
            raise ValueError(f"{args.jsonl}: no such file; --jsonl takes one JSON list of {{role, content}} per line")
        n_lines = sum(1 for _, line in jsonl_lines(args.jsonl) if line.strip())
        n_val = min(args.val_conversations, max(1, n_lines // 10))
        it = jsonl_conversations(args.jsonl)
        val = [c for _, c in zip(range(n_val), it)]
        train = itertools.islice(it, args.max_conversations)
        source = {"kind": "jsonl", "file": os.path.abspath(args.jsonl), "lines": n_lines}
    else:
        revision, files = shards.hub_dataset_files(args.repo, args.revision, args.pattern)
        # "test" as a word of the name (test-00000-of-00001.parquet), not inside one (latest, contest_01)
        test_files = [f for f in files if re.search(r"(^|[^a-z])test([^a-z]|$)", os.path.basename(f).lower())]
        train_files = [f for f in files if f not in test_files]
        print(f"{args.repo}@{revision[:12]}: train {train_files}, val {test_files or '(held out from train)'}")
        for f in (train_files + test_files)[:1]:  # --column, before the old corpus is removed below
            shards.parquet_file(shards.hub_download(args.repo, f, "dataset", revision), f, args.column)
        if test_files:
            val = hub_conversations(args.repo, revision, test_files, args.column, args.val_conversations)
            train = hub_conversations(args.repo, revision, train_files, args.column, args.max_conversations)
        else:
            it = hub_conversations(args.repo, revision, train_files, args.column)
            val = [c for _, c in zip(range(args.val_conversations), it)]
            train = itertools.islice(it, args.max_conversations)
        source = {"kind": "hub", "repo": args.repo, "repo_type": "dataset", "revision": revision,
                  "pattern": args.pattern, "column": args.column, "train_files": train_files, "val_files": test_files}

    with shards.staging(args.out, "data/smoltalk/prepare.py") as stage:  # a failed run leaves --out as it was
        tok.save(os.path.join(stage, "tokenizer.json"))
        splits = build(tok, {"val": iter(val), "train": train}, args.max_len, stage, args.shard_tokens, stats,
                       args.keep_val_copies)
        for s in ("train", "val"):
            if not splits[s]:
                raise ValueError(f"{args.jsonl or args.repo}: no usable conversation for the {s} split "
                                 f"(bad rows: {dict((k, v) for k, v in stats.items() if k.startswith('bad_'))}; "
                                 f"{stats['val_conversations']:,} went to val); fix the bad rows, or give more "
                                 f"conversations (a larger --max-conversations)")
        index = finish(args, tok, tok_src, source, splits, stats)
        shards.install_corpus(args.out, stage, index)
    report_build(args, stats, splits, t0)


def finish(args, tok, tok_src, source, splits, stats):
    """The corpus's index.json contents."""
    report = dict(sorted(stats.items()))
    source.update(made_by="data/smoltalk/prepare.py", argv=sys.argv[1:], tokenizer_from=os.path.abspath(tok_src),
                  report=report)
    return {"version": shards.INDEX_VERSION, "tokenizer": "tokenizer.json", "tokenizer_sha256": tok.hash,
            "vocab_size": tok.vocab_size, "loss_mask": True, "row_tokens": args.max_len, "source": source,
            "splits": splits}


def report_build(args, stats, splits, t0):
    bad = {k[4:]: v for k, v in stats.items() if k.startswith("bad_")}
    print(f"read {stats['rows_read']:,} conversations; bad rows skipped: {sum(bad.values())}{f' {bad}' if bad else ''}; train "
          f"copies of val conversations left out: {stats['train_copies_of_val_left_out']}")
    print(f"split at exchange boundaries (longer than --max-len {args.max_len}): {stats['conversations_split']} "
          f"conversations -> {stats['split_pieces']} pieces; exchanges dropped (alone longer than a row): "
          f"{stats['exchanges_dropped_too_long']} ({stats['tokens_dropped_too_long']:,} tokens); pieces without "
          f"their system prompt (it did not fit beside them): {stats['pieces_without_system_prompt']}; pieces with no "
          f"assistant turn (nothing to train on: dropped): {stats['pieces_without_assistant']}; turns after a "
          f"conversation's last answer (untrained) dropped: {stats['trailing_turns_dropped']}")
    for s in ("train", "val"):
        total = stats[f"{s}_rows"] * args.max_len
        print(f"{s}: {stats[f'{s}_conversations']:,} conversations, {stats[f'{s}_rows']:,} rows of {args.max_len} "
              f"= {total:,} tokens, {stats[f'{s}_target_tokens']:,} target (assistant) tokens, padding "
              f"{stats[f'{s}_pad_tokens'] / max(total, 1):.1%}, {len(splits[s])} shard{'s' * (len(splits[s]) != 1)}")
    print(f"wrote {os.path.join(args.out, 'index.json')} in {time.time() - t0:.0f}s "
          f"(train with seq_len = {args.max_len}: python train.py config/sft.py)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as e:  # (a traceback): shards.staging has removed the half-built corpus
        print(str(e) or "interrupted; the corpus in --out is as it was", file=sys.stderr)
        sys.exit(130)
