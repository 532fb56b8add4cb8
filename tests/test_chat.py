"""Chat: the format and its loss mask (token level and through TokenStream), the chat corpus builder (bad rows
counted, long conversations split at turn boundaries), an SFT run of train.py that learns a fixed pattern, the
KV-cache chat (history never re-prefilled), checkpoint choice, a real terminal session in tmux, and the HF
export's chat template rendering the same ids."""

import collections
import io
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import chat  # noqa: E402
import checkpoint  # noqa: E402
sys.path.insert(0, os.path.join(REPO, "tests"))
import forkserver  # noqa: E402
import shards  # noqa: E402
from model import ModelConfig, Picaflor, load_checkpoint, save_checkpoint  # noqa: E402
from tokenizer import train_tokenizer  # noqa: E402

MODEL = dict(vocab_size=384, n_layer=2, n_dense_layers=1, d_model=64, n_head=4, n_kv_head=2, dense_ffn=128,
             n_experts=4, expert_ffn=32, n_shared=1, top_k=2, max_seq_len=96)
ROW = 32  # prepare.py --max-len = the SFT seq_len


def render_prompt(tok, messages):
    """Ids to generate the next assistant turn from (chat.py's docstring): the rendered history + <|assistant|>."""
    return chat.render_conversation(tok, messages)[0] + [tok.special_ids["<|assistant|>"]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: extra threads only wait on each other (2 shared cores). For this module only: set at import,
    it leaked into every test of the suite."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    rng = random.Random(0)
    words = "hello world the quick brown fox says what is your name ping pong".split()
    texts = [" ".join(rng.choice(words) for _ in range(20)) + f" ping {i} pong {i}" for i in range(400)]
    t = train_tokenizer(texts, MODEL["vocab_size"])
    t.path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    t.save(t.path)
    return t


@pytest.fixture(scope="module")
def corpus(tok, tmp_path_factory):
    """ping N -> pong N conversations, plus bad rows and a conversation too long for one row."""
    d = tmp_path_factory.mktemp("chatdata")
    rng = random.Random(1)
    lines = []
    for i in range(600):
        n = rng.randrange(10)
        conv = [{"role": "user", "content": f"ping {n}"}, {"role": "assistant", "content": f"pong {n}"}]
        if i % 3 == 0:  # two exchanges: the only multi-turn history a model sees (packed rows attend within one)
            m = (n + 3) % 10
            conv += [{"role": "user", "content": f"ping {m}"}, {"role": "assistant", "content": f"pong {m}"}]
        lines.append(json.dumps(conv))
    long_conv = [{"role": "system", "content": "be brief"}]
    for n in range(4):  # 4 exchanges of ~10 tokens: longer than a row of 32, split into pieces
        long_conv += [{"role": "user", "content": f"ping {n}"}, {"role": "assistant", "content": f"pong {n}"}]
    lines.insert(100, json.dumps(long_conv))
    wordy = [{"role": "system", "content": "you are a helpful assistant that says pong " * 3}]  # no room beside a turn
    lines.insert(150, json.dumps(wordy + [{"role": "user", "content": f"ping {n}"} if i % 2 == 0 else
                                          {"role": "assistant", "content": f"pong {n}"} for n in (1, 2) for i in (0, 1)]))
    lines.insert(200, json.dumps([{"role": "user", "content": "hello " * 40}, {"role": "assistant", "content": "x"}]))
    lines.insert(300, "{this is not json")
    lines.insert(301, json.dumps([{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "pong 1"}]))
    lines.insert(302, json.dumps([{"role": "user", "content": "ping 1"}, {"role": "assistant", "content": "  "}]))
    lines.insert(303, json.dumps([{"role": "user", "content": "ping 1"}]))
    lines.insert(304, json.dumps({"messages": [{"role": "user", "content": 5}]}))
    src = d / "chats.jsonl"
    src.write_text("\ufeff" + "\n".join(lines) + "\n", encoding="utf-8")  # a BOM (Windows): cost the first row
    out = d / "pp"
    r = subprocess.run([sys.executable, "data/smoltalk/prepare.py", "--tokenizer", tok.path, "--jsonl", str(src),
                        "--max-len", str(ROW), "--val-conversations", "40", "--shard-tokens", "4000", "--out", str(out),
                        "--keep-val-copies"],  # (ten distinct conversations: every one is also in val)
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return out, r


@pytest.fixture(scope="module")
def sft_run(tok, corpus, tmp_path_factory):
    """A random-init 'pretrained' checkpoint, then config/sft.py fine-tunes it (train.py, a subprocess)."""
    d = tmp_path_factory.mktemp("sft")
    torch.manual_seed(0)
    save_checkpoint(Picaflor(ModelConfig(**MODEL)), str(d / "pre"), 0, tokenizer_file=tok.path)
    stages = [{"name": "warmup", "steps": 10, "lr_phase": "warmup"}, {"name": "stable", "steps": 150, "lr_phase": "stable"},
              {"name": "decay", "steps": 40, "lr_phase": "decay"}]
    args = ["config/sft.py", f"--finetune_from={d / 'pre'}", f"--data_root={corpus[0].parent}", "--dataset=pp",
            f"--out_dir={d / 'sft'}", f"--seq_len={ROW}", "--batch_size=8", "--learning_rate=5e-3",
            f"--stages={json.dumps(stages)}", "--ckpt_interval=100", "--eval_interval=100", "--eval_iters=2",
            "--log_interval=50"]
    r = forkserver.run(["train.py", *args], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    # the finished line named eval.py's piqa for a chat model; its checkpoints are compared by chat.py pick
    assert f"next: python chat.py pick {d / 'sft'} --data {corpus[0].parent / 'pp'}, then" in r.stdout, r.stdout[-500:]
    return str(d / "sft")


def test_render_mask_token_level(tok):
    sp = tok.special_ids
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ping 3 <|end|>"},
            {"role": "assistant", "content": "pong 3"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "pong"}]
    ids, mask = chat.render_conversation(tok, msgs)
    E = tok.encode
    want = ([sp["<|bos|>"], sp["<|system|>"]] + E("be brief") + [sp["<|end|>"], sp["<|user|>"]] + E("ping 3 <|end|>")
            + [sp["<|end|>"], sp["<|assistant|>"]] + E("pong 3") + [sp["<|end|>"], sp["<|user|>"]] + E("again")
            + [sp["<|end|>"], sp["<|assistant|>"]] + E("pong") + [sp["<|end|>"]])
    assert ids == want
    # 1 exactly on the assistant content and its <|end|>
    a1 = want.index(sp["<|assistant|>"])
    a2 = len(want) - 1 - len(E("pong")) - 1
    assert want[a2] == sp["<|assistant|>"]
    target = set(range(a1 + 1, a1 + 2 + len(E("pong 3")))) | set(range(a2 + 1, len(want)))
    assert [i for i, m in enumerate(mask) if m] == sorted(target)
    assert [ids[i] for i in sorted(target)] == E("pong 3") + [sp["<|end|>"]] + E("pong") + [sp["<|end|>"]]
    assert sp["<|end|>"] not in E("ping 3 <|end|>")  # special strings in text stay text
    prompt = render_prompt(tok, msgs[:2])
    assert prompt == want[:a1 + 1]  # history + <|assistant|>
    for bad, kind in [([{"role": "robot", "content": "x"}], "unknown_role"),
                      ([{"role": "user", "content": "x"}, {"role": "assistant", "content": " \n"}], "empty_assistant"),
                      ([{"role": "user"}], "malformed"), ("not a list", "malformed")]:
        with pytest.raises(chat.ChatFormatError) as e:
            chat.render_conversation(tok, bad)
        assert e.value.kind == kind


def expected_targets(tokens, sp):
    """Independent of the renderer: token i is a target iff it is assistant content or the <|end|> closing it."""
    roles = {sp[f"<|{r}|>"]: r for r in ("system", "user", "assistant")}
    out, role = [], None
    for t in tokens:
        if t in roles:
            role = roles[t]
            out.append(0)
        elif t == sp["<|end|>"]:
            out.append(int(role == "assistant"))
            role = None
        elif t == sp["<|bos|>"]:
            role = None
            out.append(0)
        else:
            out.append(int(role == "assistant"))
    return np.array(out, dtype=np.uint8)


def test_corpus_masks_and_token_stream(tok, corpus):
    out, _ = corpus
    index = shards.load_index(out)
    assert index["loss_mask"] and index["row_tokens"] == ROW and shards.verify_corpus(out) == []
    sp = tok.special_ids
    for split in ("train", "val"):
        for e in index["splits"][split]:
            toks = np.fromfile(out / e["file"], dtype="<u2")
            mask = np.fromfile(out / e["mask"], dtype=np.uint8)
            assert len(toks) % ROW == 0 and (toks[::ROW] == tok.bos_id).all()  # whole rows, each starts a conversation
            assert (mask == expected_targets(toks, sp)).all()
    # through TokenStream: y == -1 exactly where the target token is not assistant content / its <|end|>
    ts = shards.TokenStream(out, "train", vocab_size=MODEL["vocab_size"])
    stream = np.concatenate([np.fromfile(out / e["file"], dtype="<u2") for e in index["splits"]["train"]])
    want = expected_targets(stream, sp)
    B, pos, n_checked = 3, 0, 0
    while pos + B * ROW + 1 <= len(stream):
        x, y = ts.next_batch(B, ROW)
        span = stream[pos:pos + B * ROW + 1].astype(np.int64)
        assert (x.numpy().ravel() == span[:-1]).all()
        t = want[pos + 1:pos + B * ROW + 1].astype(bool)
        yy = y.numpy().ravel()
        assert (yy[~t] == -1).all() and (yy[t] == span[1:][t]).all()
        n_checked += int(t.sum())
        pos += B * ROW
    assert n_checked > 1000
    # a masked shard whose mask is corrupted is caught like a corrupt shard
    e = index["splits"]["val"][0]
    raw = bytearray((out / e["mask"]).read_bytes())
    raw[5] ^= 1
    bad = out.parent / "bad"
    shutil.copytree(out, bad)
    (bad / e["mask"]).write_bytes(bytes(raw))
    assert any("corrupt loss mask" in p for p in shards.verify_corpus(bad))
    raw = bytearray((bad / e["file"]).read_bytes())  # its hint re-runs prepare.py (a chat shard cannot be re-fetched)
    raw[3] ^= 1
    (bad / e["file"]).write_bytes(bytes(raw))
    hint = next(p for p in shards.verify_corpus(bad) if e["file"] in p and "mask" not in p.split(":")[0])
    assert "data/smoltalk/prepare.py" in hint and "refetch" not in hint, hint
    # each shard names where its rows came from; pieces and conversations are counted apart
    srcs = [x["source"] for x in index["splits"]["train"]]
    assert all(x["files"] == [str(out.parent / "chats.jsonl")] and x["conversations"] <= x["pieces"] for x in srcs)


def test_bad_rows_counted_and_long_conversations_split(corpus):
    out, r = corpus
    rep = shards.load_index(out)["source"]["report"]
    assert rep["bad_malformed_json"] == 1 and rep["bad_unknown_role"] == 1 and rep["bad_empty_assistant"] == 1
    assert rep["bad_no_assistant"] == 1 and rep["bad_malformed"] == 1
    assert "bad rows skipped: 5" in r.stdout and "Traceback" not in r.stderr
    n_val = len(shards.load_index(out)["splits"]["val"])  # each split's line counts its shards in English
    said = [x for x in r.stdout.splitlines() if x.startswith("val: ")]
    assert n_val == 1 and len(said) == 1 and said[0].endswith(", 1 shard"), r.stdout
    # 4 exchanges -> 2 pieces; the too-long user turn: none; the wordy system prompt's 2 exchanges: 1 piece without it
    assert rep["conversations_split"] == 3 and rep["split_pieces"] == 3
    assert rep["bad_malformed_json"] == 1 and rep["rows_read"] == 608  # the BOM line was read too
    assert rep["pieces_without_system_prompt"] == 1 and "without their system prompt" in r.stdout
    assert f"pieces with no assistant turn (nothing to train on: dropped): {rep.get('pieces_without_assistant', 0)}" in r.stdout
    assert rep["exchanges_dropped_too_long"] == 1 and rep["tokens_dropped_too_long"] > ROW
    assert "split at exchange boundaries" in r.stdout and "dropped" in r.stdout
    # nothing usable: a one-line error, no traceback
    bad = out.parent / "only_bad.jsonl"
    bad.write_text("{oops\n" + json.dumps([{"role": "robot", "content": "x"}]) + "\n")
    r2 = subprocess.run([sys.executable, "data/smoltalk/prepare.py", "--tokenizer", str(out / "tokenizer.json"),
                         "--jsonl", str(bad), "--out", str(out.parent / "empty")], cwd=REPO, capture_output=True, text=True)
    assert r2.returncode != 0 and "Traceback" not in r2.stderr and "no usable conversation" in r2.stderr
    assert "fix the bad rows, or give more conversations" in r2.stderr, r2.stderr
    r3 = subprocess.run([sys.executable, "data/smoltalk/prepare.py", "--tokenizer", str(out / "tokenizer.json"),
                         "--jsonl", str(bad), "--out", str(out.parent / "empty"), "--max-len", "4"], cwd=REPO,
                        capture_output=True, text=True)  # it said too short, not how long
    assert r3.returncode != 0 and "--max-len 4: too short for a conversation; pass --max-len 8 or more" in r3.stderr


def test_a_jsonl_line_that_is_not_utf8_is_a_bad_row_not_replacement_characters(tok, tmp_path, monkeypatch, capsys):
    """A conversation written in Latin-1 (or a line with one stray byte) was read with errors="replace": its corpus
    trained the model on U+FFFD for every accented letter, and the report said "bad rows skipped: 0"."""
    import runpy
    good = [json.dumps([{"role": "user", "content": f"ping {n}"}, {"role": "assistant", "content": f"pong {n}"}])
            for n in range(12)]
    latin1 = json.dumps([{"role": "user", "content": "caf\u00e9"}, {"role": "assistant", "content": "d\u00e9j\u00e0"}],
                        ensure_ascii=False).encode("latin-1")
    src = tmp_path / "c.jsonl"
    src.write_bytes(b"\n".join(g.encode() for g in good[:6]) + b"\n" + latin1 + b"\n" + b"\n".join(
        g.encode() for g in good[6:]) + b"\n")
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["prepare.py", "--tokenizer", tok.path, "--jsonl", str(src), "--max-len", str(ROW),
                                      "--val-conversations", "1", "--out", str(out)])
    runpy.run_path(os.path.join(REPO, "data/smoltalk/prepare.py"), run_name="__main__")
    captured = capsys.readouterr()
    rep = shards.load_index(out)["source"]["report"]
    assert rep.get("bad_not_utf8") == 1 and "bad rows skipped: 1" in captured.out, (rep, captured.out)
    assert f"{src}:7: not valid UTF-8" in captured.err and "iconv" in captured.err, captured.err
    text = "".join(tok.decode_generated(np.fromfile(out / e["file"], dtype="<u2").tolist())
                   for s in ("train", "val") for e in shards.load_index(out)["splits"][s])
    assert "\ufffd" not in text and "pong 11" in text


def test_sft_learns_the_pattern_and_chat_keeps_history_in_cache(tok, sft_run):
    model = load_checkpoint(sft_run)
    sp = tok.special_ids
    for n in range(10):
        prompt = render_prompt(tok, [{"role": "user", "content": f"ping {n}"}])
        out = model.generate(torch.tensor([prompt]), 6, temperature=0, eos_id=sp["<|end|>"])[0, len(prompt):].tolist()
        assert out == tok.encode(f"pong {n}") + [sp["<|end|>"]], (n, out)
    # a multi-turn conversation in the KV cache: turn 2 feeds only its own tokens, and answers exactly what a
    # full re-render of the history would
    conv = chat.Conversation(tok, chat.picaflor_backend(model))
    shown = []
    assert conv.reply("ping 3", 8, on_text=shown.append) == "pong 3" and "".join(shown) == "pong 3"
    fed_before = len(conv.fed_tokens)
    a2 = conv.reply("ping 7", 8)
    turn2 = [sp["<|end|>"]] + chat.render_turn(tok, "user", "ping 7")[0] + [sp["<|assistant|>"]]
    assert conv.fed_tokens[fed_before] == len(turn2)  # not the whole history
    assert all(n == 1 for n in conv.fed_tokens[fed_before + 1:])
    full = render_prompt(tok, [{"role": "user", "content": "ping 3"}, {"role": "assistant", "content": "pong 3"},
                                    {"role": "user", "content": "ping 7"}])
    ref = model.generate(torch.tensor([full]), 8, temperature=0, eos_id=sp["<|end|>"])[0, len(full):].tolist()
    assert a2 == tok.decode([t for t in ref if t != sp["<|end|>"]])
    assert conv.ids + [] == full + tok.encode(a2) + [sp["<|end|>"]]


def test_chat_loop_commands_and_exits(tok, sft_run):
    model = load_checkpoint(sft_run)
    backend = chat.picaflor_backend(model)

    def scripted(lines):
        it = iter(lines)

        def input_fn(prompt):
            v = next(it)
            if isinstance(v, BaseException):
                raise v
            return v
        return input_fn

    class Out:
        def __init__(self):
            self.text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    for ending in ["/exit", EOFError(), KeyboardInterrupt()]:
        o = Out()
        rc = chat.chat_loop(tok, backend, input_fn=scripted(["ping 2", "/reset", "/nope", "ping 5", ending]), out=o)
        assert rc == 0 and o.text.count("pong") == 2 and "[new conversation]" in o.text and "unknown command" in o.text
        assert o.text.endswith("bye\n")


def test_pick_scores_every_checkpoint(tok, corpus, sft_run):
    rep = chat.pick(sft_run, str(corpus[0]), prompts=["ping 4", "ping 8"], max_new_tokens=6, max_rows=16,
                    log=lambda *a: None)
    steps = [r["step"] for r in rep["checkpoints"]]
    assert steps == sorted(steps) and 200 in steps and len(steps) >= 2
    last = rep["checkpoints"][-1]
    assert [a["answer"] for a in last["answers"]] == ["pong 4", "pong 8"] and last["answers"][0]["stopped"] == "end"
    assert last["val_loss"] < rep["checkpoints"][0]["val_loss"] and last["val_targets"] > 0
    assert last["answers_ended"] == 2 and last["repetition"] == 0.0
    assert chat.repeated_ngrams([1, 2, 3, 1, 2, 3, 1, 2, 3]) == 4 / 7
    md = open(os.path.join(sft_run, "sft_pick.md")).read()
    assert "## 1. ping 4" in md and "pong 8" in md and "val assistant loss" in md
    assert json.load(open(os.path.join(sft_run, "sft_pick.json")))["lowest_val_loss"] == rep["lowest_val_loss"]


def test_pick_of_a_read_only_run_dir_is_one_line_before_any_scoring(corpus, sft_run, monkeypatch, capsys):
    """chat.py pick of a run dir on a read-only mount (another user's, an NFS export) scored its first checkpoint,
    then ended in an OSError traceback writing sft_pick.json, that score lost. Now refused first, in one line."""
    import errno
    import checkpoint
    import model
    real = checkpoint.write_atomic

    def read_only(path, data):
        if os.path.dirname(os.path.abspath(path)) == os.path.abspath(sft_run):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real(path, data)
    monkeypatch.setattr(checkpoint, "write_atomic", read_only)
    monkeypatch.setattr(model, "load_checkpoint", lambda *a, **k: pytest.fail("scored a checkpoint it cannot report"))
    assert chat.main(["pick", sft_run, "--data", str(corpus[0])]) == 1
    assert capsys.readouterr().err == (f"chat.py: error: {sft_run}: cannot write sft_pick.md there (Read-only file "
                                       f"system); copy the run dir to a disk you can write and pick there\n")


def test_pick_keeps_what_it_scored_names_what_it_skipped_and_refuses_a_long_prompt(corpus, sft_run, tmp_path,
                                                                                    capsys):
    """A corrupt checkpoint was left out without a word; a --prompt longer than the context was a ValueError
    traceback; the report was written only at the end (a late fault or Ctrl-C lost every score)."""
    run = tmp_path / "run"
    shutil.copytree(sft_run, run, ignore=shutil.ignore_patterns("sft_pick.*"))
    steps = checkpoint.list_checkpoints(str(run))
    with open(os.path.join(steps[0][1], "model.safetensors"), "ab") as f:
        f.write(b"x")
    calls = []
    real = chat.val_assistant_loss

    def fails_on_the_last(model, *a):  # a fault while scoring the last checkpoint
        calls.append(1)
        if len(calls) == len(steps) - 1:
            raise RuntimeError("disk went away")
        return real(model, *a)
    chat.val_assistant_loss, said = fails_on_the_last, []
    try:
        with pytest.raises(RuntimeError):
            chat.pick(str(run), str(corpus[0]), prompts=["ping 4"], max_new_tokens=4, max_rows=4, log=said.append)
    finally:
        chat.val_assistant_loss = real
    assert any(s.startswith(f"skipping {os.path.basename(steps[0][1])}") for s in said)
    report = json.load(open(run / "sft_pick.json"))
    assert not report["complete"] and len(report["checkpoints"]) == len(steps) - 2 >= 1
    assert report["skipped"][0]["checkpoint"] == os.path.basename(steps[0][1])
    assert "skipped:" in (run / "sft_pick.md").read_text()
    assert chat.main(["pick", str(run), "--data", str(corpus[0]), "--prompt", "ping " * 400]) == 1
    err = capsys.readouterr().err
    assert "--prompt 'ping ping" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.count("shorten it") == 1 and "--max-new-tokens" not in err, err  # (said twice; no limit helps here)
    for flag in ("--max-new-tokens", "--max-rows"):  # (-5 wrote a report that looked like a score)
        assert chat.main(["pick", str(run), "--data", str(corpus[0]), flag, "-5"]) == 1
        assert f"{flag} -5: at least 1" in capsys.readouterr().err


def test_pick_does_not_skip_a_step_a_killed_resave_left_aside(corpus, sft_run, tmp_path, monkeypatch):
    """pick scored every step_* dir but one a re-save killed between its renames left as step_N.old-PID (the newest,
    often): it was missed without a word. It goes through rundir.recover_for_reader now, which does not touch a run
    whose trainer is live (refused here: a trainer holds the lock)."""
    import rundir
    run = tmp_path / "run"
    shutil.copytree(sft_run, run, ignore=shutil.ignore_patterns("sft_pick.*", ".trainer.lock"))
    newest = checkpoint.list_checkpoints(str(run))[-1][1]
    os.replace(newest, newest + ".old-4242")
    monkeypatch.setattr(rundir, "RESAVE_WAIT_S", 0.0, raising=False)
    lock = rundir.hold_run_lock(str(run), 0, print)
    try:
        with pytest.raises(chat.ChatError, match="being re-saved by the trainer holding"):
            chat.pick(str(run), str(corpus[0]), prompts=["ping 4"], max_new_tokens=2, max_rows=2, log=print)
    finally:
        os.close(lock)
    assert rundir.recover_for_reader(str(run)) == [newest] and checkpoint.is_valid(newest)


def test_a_tokenizer_larger_than_the_model_is_one_line(tmp_path, capsys):
    """chat.py's own advice (copy the corpus's tokenizer.json into the checkpoint) with the wrong corpus's: an
    IndexError on the first message."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rng = random.Random(1)
    big = train_tokenizer([" ".join(rng.choice(words) for _ in range(30)) + f" {i} {i * 7}" for i in range(600)],
                          MODEL["vocab_size"] * 2)
    assert big.vocab_size > MODEL["vocab_size"]
    big_path = str(tmp_path / "big.json")
    big.save(big_path)
    torch.manual_seed(0)
    run = save_checkpoint(Picaflor(ModelConfig(**MODEL)), str(tmp_path / "run"), 1, tokenizer_file=big_path)
    assert chat.main([run]) == 1
    err = capsys.readouterr().err
    assert "tokenizer vocab" in err and "> model vocab" in err and len(err.strip().splitlines()) == 1, err


def test_pick_checks_every_tokenizer_first(corpus, sft_run, tmp_path):
    """A checkpoint without its tokenizer.json: one ChatError before any checkpoint is scored (a traceback after
    the earlier ones were scored, and nothing written, before)."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(sft_run, run, ignore=shutil.ignore_patterns("sft_pick.*"))
    newest = checkpoint.latest_valid(str(run))
    os.remove(os.path.join(newest, "tokenizer.json"))
    manifest = json.load(open(os.path.join(newest, "MANIFEST.json")))
    del manifest["files"]["tokenizer.json"]  # still a valid checkpoint, only without its tokenizer
    json.dump(manifest, open(os.path.join(newest, "MANIFEST.json"), "w"))
    scored = []
    with pytest.raises(chat.ChatError, match="tokenizer.json"):
        chat.pick(str(run), str(corpus[0]), prompts=["ping 4"], max_new_tokens=4, max_rows=4, log=scored.append)
    assert scored == []


def test_terminal_chat_in_tmux(sft_run, tmp_path):
    """A person at a terminal: python stream_infer.py MODEL --chat --ram-budget 4G (int4 container), two turns, then
    Ctrl-C at the prompt: a clean exit (status 0, no traceback)."""
    import export

    model_file = str(tmp_path / "m.pcf4")
    export.export_int4(export.Source(sft_run), model_file, progress=False)
    sess = f"pcf-chat-{os.getpid()}"
    done = tmp_path / "rc"
    cmd = (f"cd {shlex.quote(REPO)} && OMP_NUM_THREADS=1 {shlex.quote(sys.executable)} stream_infer.py "
           f"{shlex.quote(model_file)} --chat --ram-budget 4G --max-new-tokens 8 2>&1; echo $? > {shlex.quote(str(done))}; "
           f"sleep 60")
    subprocess.run(["tmux", "new-session", "-d", "-s", sess, "-x", "120", "-y", "40", cmd], check=True)

    def pane():
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", sess], capture_output=True, text=True).stdout

    def wait_for(pred, timeout=60):
        t0 = time.time()
        while time.time() - t0 < timeout:
            text = pane()
            if pred(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"timed out; the pane shows:\n{pane()}")

    try:
        wait_for(lambda t: t.rstrip().endswith(">>>"), timeout=180)  # python + torch start (slow on a busy box)
        subprocess.run(["tmux", "send-keys", "-t", sess, "ping 3", "Enter"], check=True)
        wait_for(lambda t: t.count(">>>") >= 2 and t.rstrip().endswith(">>>"))
        subprocess.run(["tmux", "send-keys", "-t", sess, "ping 6", "Enter"], check=True)
        text = wait_for(lambda t: t.count(">>>") >= 3 and t.rstrip().endswith(">>>"))
        answers = re.findall(r">>> ping \d\n(.*)\n", text)
        assert len(answers) == 2 and answers[0] == "pong 3" and re.fullmatch(r"pong\s+\d", answers[1]), text
        subprocess.run(["tmux", "send-keys", "-t", sess, "C-c"], check=True)  # Ctrl-C at the prompt: a clean exit
        wait_for(lambda t: done.exists() and done.read_text().strip() != "", timeout=30)
        text = pane()
        assert done.read_text().strip() == "0" and "bye" in text and "Traceback" not in text, text
    finally:
        subprocess.run(["tmux", "kill-session", "-t", sess], capture_output=True)


def test_stream_infer_chat_idles_without_spinning(sft_run, tmp_path):
    """stream_infer.py sets OMP_WAIT_POLICY=ACTIVE (decode's threads spin between GEMVs): under --chat with 2 or
    more threads (chat.py's default is half the cores: 4 on an 8-core laptop), each extra thread spun on a core
    while the chat waited for the person to type (3.8 CPU-seconds in 4 idle seconds here, at --threads 2)."""
    import export
    model_file = str(tmp_path / "m.pcf4")
    export.export_int4(export.Source(sft_run), model_file, progress=False)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    p = subprocess.Popen([sys.executable, "stream_infer.py", model_file, "--chat", "--threads", "2",
                          "--max-new-tokens", "4"], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, bufsize=0)
    try:
        p.stdin.write("ping 3\n")
        seen = ""
        while seen.count(">>>") < 2:  # the answer is out and the next prompt waits for input
            ch = p.stdout.read(1)
            assert ch, seen
            seen += ch

        def cpu_s():
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        time.sleep(0.5)  # (libgomp's own short spin after the last parallel region)
        before = cpu_s()
        time.sleep(1.5)
        assert cpu_s() - before < 0.3, "the chat's threads spun while it waited for input"
        p.stdin.write("/exit\n")
        p.wait(timeout=60)
    finally:
        p.kill()


def test_hf_export_chat_template_renders_the_same_ids(tok, sft_run, tmp_path):
    import export
    from transformers import AutoTokenizer

    out = str(tmp_path / "hf")
    export.export_hf(export.Source(sft_run), out, "float32", progress=False)
    ht = AutoTokenizer.from_pretrained(out)
    convs = [
        [{"role": "user", "content": "ping 3"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ping 3"},
         {"role": "assistant", "content": "pong 3"}, {"role": "user", "content": "hello world, what is your name?"}],
    ]

    def hf_ids(msgs, gen):
        ids = ht.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    for msgs in convs:
        assert hf_ids(msgs, True) == render_prompt(tok, msgs)
        full = msgs + [{"role": "assistant", "content": "pong 5"}]
        assert hf_ids(full, False) == chat.render_conversation(tok, full)[0]


def test_prepare_from_fake_hub(tok, tmp_path):
    """smol-smoltalk's layout (data/train-*.parquet, data/test-*.parquet, a "messages" column) from tests/hub_server.py,
    through the real huggingface_hub client; a 403 is reported as storage denied."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from hub_server import FakeHub

    repo = tmp_path / "hub" / "datasets" / "HuggingFaceTB" / "smol-smoltalk" / "data"
    repo.mkdir(parents=True)

    def conv(n):
        return [{"content": f"ping {n}", "role": "user"}, {"content": f"pong {n}", "role": "assistant"}]
    train = [conv(i % 10) for i in range(30)]
    train[4] = [{"content": "hi", "role": "user"}, {"content": "", "role": "assistant"}]
    pq.write_table(pa.table({"messages": train, "source": ["x"] * 30}), repo / "train-00000-of-00001.parquet",
                   row_group_size=8)
    pq.write_table(pa.table({"messages": [conv(i) for i in range(6)]}), repo / "test-00000-of-00001.parquet")
    pq.write_table(pa.table({"messages": [conv(8), conv(9)]}), repo / "contest-00000.parquet")  # train: "test" inside
    out = tmp_path / "st"
    save_checkpoint(Picaflor(ModelConfig(**MODEL)), str(tmp_path / "pre"), 0, tokenizer_file=tok.path)
    with FakeHub(tmp_path / "hub") as hub:
        env = dict(os.environ, **hub.client_env(tmp_path / "hf_home"))
        r = subprocess.run([sys.executable, "data/smoltalk/prepare.py", "--tokenizer", str(tmp_path / "pre"),
                            "--out", str(out)], cwd=REPO, capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        index = shards.load_index(out)
        assert index["row_tokens"] == MODEL["max_seq_len"] and index["tokenizer_sha256"] == tok.hash
        rep = index["source"]["report"]
        assert rep["val_conversations"] == 6 and rep["bad_empty_assistant"] == 1
        # a train conversation identical to a val one is left out (ping 0-5 are val's): val loss measured recall
        assert rep["train_conversations"] == 14 and rep["train_copies_of_val_left_out"] == 17
        assert "train copies of val conversations left out: 17" in r.stdout
        assert index["source"]["val_files"] == ["data/test-00000-of-00001.parquet"]
        assert len(index["source"]["revision"]) == 40 and shards.verify_corpus(out) == []
        hub.status_override = 403
        r = subprocess.run([sys.executable, "data/smoltalk/prepare.py", "--tokenizer", tok.path, "--out",
                            str(tmp_path / "st2")], cwd=REPO, capture_output=True, text=True,
                           env=dict(os.environ, **hub.client_env(tmp_path / "hf_home2")))
        assert r.returncode != 0 and "storage denied" in r.stderr and "Traceback" not in r.stderr


def test_chat_with_int4_container(tok, sft_run, tmp_path):
    """The same chat over stream_infer.py's engine (int4 container, experts streamed): history stays in its cache."""
    import export

    path = str(tmp_path / "m.pcf4")
    export.export_int4(export.Source(sft_run), path, progress=False)
    import container
    assert container.load_container(path).header["chat_tuned"] is True  # (an SFT run: chat says nothing)
    tok2, backend = chat.load_model(path)
    assert tok2.hash == tok.hash
    conv = chat.Conversation(tok2, backend)
    assert conv.reply("ping 3", 8) == "pong 3"
    n = len(conv.fed_tokens)
    assert conv.reply("ping 6", 8).startswith("pong")
    assert conv.fed_tokens[n] == 1 + len(chat.render_turn(tok, "user", "ping 6")[0]) + 1
    # Ctrl-C mid-answer drops the expert reads still queued (settle waited for every one); a finished answer settles
    import stream_infer
    backend = chat.engine_backend(stream_infer.load(path))
    cache, calls, seen, real_forward = backend["engine"].cache, {"n": 0}, [], backend["forward"]
    for name in ("cancel", "settle"):
        setattr(cache, name, (lambda f, n: lambda: (seen.append(n), f())[1])(getattr(cache, name), name))

    def flaky_forward(ids, kv):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_forward(ids, kv)
    conv = chat.Conversation(tok2, dict(backend, forward=flaky_forward))
    with pytest.raises(KeyboardInterrupt):
        conv.reply("ping 3", 8)
    assert seen == ["cancel"] and conv.reply("ping 4", 8) == "pong 4" and seen == ["cancel", "settle"], seen
    with pytest.raises(chat.ChatError):
        chat.load_model(str(tmp_path / "missing.pcf4"))
    with pytest.raises(chat.ChatError, match="--experts-per-token 99"):
        chat.load_model(path, experts_per_token=99)


def test_more_experts_per_token_than_trained_is_served_with_a_note(sft_run, tmp_path, capsys):
    """--experts-per-token above the trained top_k is an experiment, allowed, but was silent: one note on stderr, from
    a checkpoint and from an int4 container; the trained top_k or fewer say nothing."""
    import export

    path = str(tmp_path / "m.pcf4")
    export.export_int4(export.Source(sft_run), path, progress=False)
    own = MODEL["top_k"]
    for model in (sft_run, path):
        capsys.readouterr()
        chat.load_model(model, experts_per_token=own + 1)
        note = f"note: serving with {own + 1} experts per token, more than the {own} the model was trained with"
        assert capsys.readouterr().err.count(note) == 1, model
        chat.load_model(model, experts_per_token=own)
        assert "experts per token" not in capsys.readouterr().err, model


def test_interrupt_reset_and_full_context(tok, sft_run):
    """Ctrl-C mid-answer closes the turn (the cache stays consistent), /reset starts a fresh cache, and a full
    context drops the oldest exchanges instead of failing."""
    model = load_checkpoint(sft_run)
    sp = tok.special_ids
    backend = chat.picaflor_backend(model)
    calls = {"n": 0}

    def flaky_forward(ids, cache):
        calls["n"] += 1
        if calls["n"] == 3:  # during the answer's second token
            raise KeyboardInterrupt
        return chat.picaflor_backend(model)["forward"](ids, cache)

    conv = chat.Conversation(tok, dict(backend, forward=flaky_forward))
    with pytest.raises(KeyboardInterrupt):
        conv.reply("ping 3", 8)
    assert conv.last_stop == "interrupted" and conv.messages[-1]["role"] == "assistant"
    assert conv.ids[-1] == sp["<|end|>"] and conv.cache.pos < len(conv.ids)
    partial = conv.messages[-1]["content"]
    assert conv.reply("ping 5", 8) == "pong 5"
    want = chat.render_conversation(tok, [{"role": "user", "content": "ping 3"},
                                          {"role": "assistant", "content": partial or "x"},
                                          {"role": "user", "content": "ping 5"},
                                          {"role": "assistant", "content": "pong 5"}])[0]
    assert partial and conv.ids == want  # the cut answer stays in the history, closed by <|end|>
    conv.reset()
    conv.fed_tokens.clear()
    assert conv.reply("ping 4", 8) == "pong 4" and conv.fed_tokens[0] == 1 + 5 + 1  # <|bos|>, the user turn, <|assistant|>
    small = chat.Conversation(tok, backend, context=30)
    notes = []
    for n in (1, 2, 3, 4):
        assert small.reply(f"ping {n}", 6, on_text=notes.append) == f"pong {n}"
    assert any("context full" in s for s in notes) and small.messages[0]["content"] != "ping 1"


def test_a_kv_cache_past_the_memory_is_one_line(tok):
    """(found by fuzzing) a checkpoint whose max_seq_len is 2^40 (a state.json edited, or a long-context model on a
    small machine): chat allocated its whole KV cache, a RuntimeError traceback. Now a ChatError naming --context."""
    model = Picaflor(ModelConfig(**{**MODEL, "max_seq_len": 2 ** 40}))
    for n in (2 ** 40, 2 ** 63):  # past the memory; past torch's sizes (a TypeError)
        model.cfg.max_seq_len = n
        with pytest.raises(chat.ChatError, match=f"KV cache of {n} positions .* pass a smaller --context"):
            chat.Conversation(tok, chat.picaflor_backend(model))
    assert chat.Conversation(tok, chat.picaflor_backend(model), context=64).cache.max_len == 64


def test_chat_cli_with_checkpoint(sft_run, monkeypatch, capsys):
    """python chat.py CKPT (in-process): a person types two turns and Ctrl-D."""
    lines = iter(["ping 1", "ping 8"])

    def fake_input(prompt):
        print(prompt, end="")
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr("builtins.input", fake_input)
    assert chat.main([sft_run, "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert ">>> pong 1\n>>> pong" in out and out.endswith("bye\n")
    assert chat.main([sft_run + "/nope"]) == 1 and "no such file" in capsys.readouterr().err
    for flags, want in ((["--experts-per-token", "99"], "--experts-per-token 99"),  # a traceback
                        (["--experts-per-token", "0"], "at least 1"),  # silently the default
                        (["--max-new-tokens", "-3"], "--max-new-tokens -3"),  # reserved negative room
                        (["--threads", "0"], "--threads 0: at least 1"),  # one thread, silently
                        (["--temperature", "-1"], "--temperature -1.0"),  # sampled the least likely tokens
                        (["--temperature", "0.7", "--top-p", "1.5"], "--top-p 1.5"),
                        (["--temperature", "0.7", "--seed", str(10 ** 23)], "--seed 1"),  # a traceback
                        (["--seed", "3"], "decoding is greedy"),  # ignored, silently
                        (["--ram-budget", "1K"], "not a checkpoint's"),  # ignored: the fp32 model loaded
                        (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"], "--device")):
        assert chat.main([sft_run, *flags]) == 1
        err = capsys.readouterr().err
        assert want in err and len(err.strip().splitlines()) == 1, err


def test_an_undecodable_sampled_id_keeps_the_reply_and_the_history(tok, sft_run):
    """A model can sample an id its tokenizer maps to no text (0, the unused ids above the merges: an early
    checkpoint, a corpus smaller than the vocab). decode() raised on it: the reply was lost, the history got two
    user turns in a row, and `chat.py pick` died. It shows as U+FFFD now. A system prompt that leaves no room is
    its own one-line error (every message used to be refused as too long)."""
    import torch
    model = load_checkpoint(sft_run)
    backend = chat.picaflor_backend(model)
    unused = 0  # reserved: no text (as the unused ids above the merges of a smaller corpus)
    steps = {"n": 0}

    def forward(ids, cache):  # the real model, but its second answer token is forced to the unused id
        logits = backend["forward"](ids, cache)
        steps["n"] += 1
        if steps["n"] == 2:
            logits = torch.full_like(logits, -1e9)
            logits[..., unused] = 0.0
        return logits
    conv = chat.Conversation(tok, dict(backend, forward=forward))
    answer = conv.reply("ping 3", 6)
    assert "\ufffd" in answer and [m["role"] for m in conv.messages] == ["user", "assistant"]
    assert conv.reply("ping 5", 8)  # the conversation goes on
    with pytest.raises(chat.ChatError, match="system prompt"):
        chat.Conversation(tok, backend, system="be brief " * 100, context=64)
    chat.Conversation(tok, backend, context=16)  # the smallest --context, without a system prompt, is fine


def test_sft_gradient_weighs_every_target_token_alike_however_the_batch_is_split(tok, tmp_path):
    """Loss-masked rows hold different numbers of target tokens: each micro-step's mean weighed equally made the
    gradient depend on how batch_size x grad_accum split the step (transformers' 2024 gradient-accumulation bug).
    8 rows in one micro-step and the same 8 rows in two of 4 now train the same weights."""
    from safetensors.torch import load_file
    rng = random.Random(5)  # replies of 1 to 12 words: rows with few and with many target tokens
    lines = [json.dumps([{"role": "user", "content": f"ping {i % 10}"},
                         {"role": "assistant", "content": " ".join(["pong"] * rng.randrange(1, 13))}]) for i in range(300)]
    (tmp_path / "varied.jsonl").write_text("\n".join(lines) + "\n")
    r = subprocess.run([sys.executable, "data/smoltalk/prepare.py", "--tokenizer", tok.path, "--jsonl",
                        str(tmp_path / "varied.jsonl"), "--max-len", str(ROW), "--val-conversations", "20",
                        "--out", str(tmp_path / "data" / "varied")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    stream = shards.TokenStream(tmp_path / "data" / "varied")
    counts = [int((stream.next_batch(4, ROW)[1] != -1).sum()) for _ in range(6)]
    assert len(set(counts)) > 1, counts  # (the ping-pong corpus had 32 targets in every 4 rows: nothing to see)
    torch.manual_seed(0)
    save_checkpoint(Picaflor(ModelConfig(**MODEL)), str(tmp_path / "pre"), 0, tokenizer_file=tok.path)
    stages = [{"name": "flat", "steps": 3, "lr_phase": "stable"}]
    weights, losses = [], []
    for bs, ga in ((8, 1), (4, 2)):
        out = tmp_path / f"sft_{bs}x{ga}"
        r = forkserver.run(["train.py", "config/sft.py", f"--finetune_from={tmp_path / 'pre'}",
                            f"--data_root={tmp_path / 'data'}", "--dataset=varied", f"--out_dir={out}", f"--seq_len={ROW}",
                            f"--batch_size={bs}", f"--grad_accum={ga}", "--learning_rate=5e-3", f"--stages={json.dumps(stages)}",
                            "--eval_interval=100", "--log_interval=1", "--sample_tokens=0"], cwd=REPO,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        weights.append(load_file(str(out / "step_0000003" / "model.safetensors")))
        losses.append([json.loads(l)["loss"] for l in open(out / "metrics.jsonl")])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5), losses
    diff = max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0])
    assert diff < 2e-5, diff


def test_the_val_loss_of_masked_data_is_token_weighted(tok, tmp_path):
    """train.py's val loss was the mean of its batches' means: a batch with 4 target tokens weighed as one with 59
    (the BEST checkpoint and retention follow that number). Val here: 8 rows of long questions with one-word
    answers, then 8 of short questions with long answers, so its two batches hold very different target counts."""
    few = [[{"role": "user", "content": "hello world " * 6}, {"role": "assistant", "content": "pong"}]] * 8
    many = [[{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong world the " * 4}]] * 8
    rest = [[{"role": "user", "content": f"ping {n % 10}"}, {"role": "assistant", "content": f"pong {n % 10}"}]
            for n in range(200)]
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in few + many + rest))
    data = tmp_path / "data" / "qa"
    r = subprocess.run([sys.executable, "data/smoltalk/prepare.py", "--tokenizer", tok.path, "--jsonl", str(src),
                        "--max-len", str(ROW), "--val-conversations", "16", "--out", str(data)],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    torch.manual_seed(0)
    save_checkpoint(Picaflor(ModelConfig(**MODEL)), str(tmp_path / "pre"), 0, tokenizer_file=tok.path)
    out = tmp_path / "run"
    stages = [{"name": "all", "steps": 2, "lr_phase": "stable"}]
    r = forkserver.run(["train.py", "config/sft.py", f"--finetune_from={tmp_path / 'pre'}",
                        f"--data_root={data.parent}", "--dataset=qa", f"--out_dir={out}", f"--seq_len={ROW}",
                        "--batch_size=8", f"--stages={json.dumps(stages)}", "--eval_interval=2", "--eval_iters=2"],
                       cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    logged = [json.loads(line) for line in open(out / "metrics.jsonl")]
    logged = [rec["val_loss"] for rec in logged if rec.get("step") == 2 and rec.get("val_loss") is not None][-1]
    m = load_checkpoint(str(out / "step_0000002"))
    m.eval()
    val = shards.TokenStream(str(data), "val")
    total, n_all, means, counts = 0.0, 0, [], []
    with torch.no_grad():
        for _ in range(2):  # the run's eval_iters, batch_size and seq_len
            x, y = val.next_batch(8, ROW)
            # each packed conversation attends only to itself (train.py's doc_mask): documents start at <|bos|>
            _, loss = m(x, y, doc_ids=(x == tok.bos_id).cumsum(1))
            n = int((y != -1).sum())
            total, n_all = total + float(loss) * n, n_all + n
            means.append(float(loss))
            counts.append(n)
    assert max(counts) > 2 * min(counts)  # the data does what it is for
    assert abs(sum(means) / 2 - total / n_all) > 1e-3  # so the two averages differ
    assert abs(logged - total / n_all) < 1e-4, (logged, total / n_all, sum(means) / 2, counts)


def test_packed_conversations_attend_only_to_themselves(tok, corpus, tmp_path):
    """Packed SFT rows hold several conversations; each attended to those packed before it in its row, which it never
    sees when served. The first step's loss is the source model's on the first batch, with and without doc_mask."""
    torch.manual_seed(0)
    save_checkpoint(Picaflor(ModelConfig(**MODEL)), str(tmp_path / "pre"), 0, tokenizer_file=tok.path)
    m = load_checkpoint(str(tmp_path / "pre")).eval()
    x, y = shards.TokenStream(str(corpus[0]), "train").next_batch(8, ROW)
    assert ((x == tok.bos_id).sum(1) > 1).all()  # several conversations in every row
    with torch.no_grad():
        want = {True: float(m(x, y, doc_ids=(x == tok.bos_id).cumsum(1))[1]), False: float(m(x, y)[1])}
    assert abs(want[True] - want[False]) > 1e-3
    for doc_mask in (True, False):
        out = tmp_path / f"run_{doc_mask}"
        r = forkserver.run(["train.py", "config/sft.py", f"--finetune_from={tmp_path / 'pre'}",
                            f"--data_root={corpus[0].parent}", "--dataset=pp", f"--out_dir={out}", f"--seq_len={ROW}",
                            "--batch_size=8", f"--doc_mask={doc_mask}", "--max_iters=1", "--warmup_iters=0",
                            "--stages=[]", "--eval_interval=100", "--log_interval=1", "--sample_tokens=0"], cwd=REPO,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        logged = [json.loads(line) for line in open(out / "metrics.jsonl") if '"loss"' in line][0]["loss"]
        assert abs(logged - want[doc_mask]) < 1e-4, (doc_mask, logged, want)
    # a stage mixing it with plain text (replay): only the SFT rows are split by conversation, the text rows stay causal
    src = tmp_path / "text"
    src.mkdir()
    for i in range(40):
        (src / f"doc{i}.txt").write_text(f"hello world the quick fox {i % 7}")
    r = subprocess.run([sys.executable, "data/local/prepare.py", "--src", str(src), "--tokenizer", tok.path,
                        "--val-percent", "0", "--out", str(corpus[0].parent / "text")], cwd=REPO, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    xs, ys, ds = [], [], []
    for c, rows in sorted({"pp": 4, "text": 4}.items()):  # (train.py: each stream's rows in corpus order)
        x, y = shards.TokenStream(str(corpus[0].parent / c), "train").next_batch(rows, ROW)
        xs, ys, ds = xs + [x], ys + [y], ds + [(x == tok.bos_id).cumsum(1) if c == "pp" else torch.zeros_like(x)]
    x, y, d = torch.cat(xs), torch.cat(ys), torch.cat(ds)
    assert ((xs[1] == tok.bos_id).sum(1) > 1).any()  # a text row holds more than one document: the mask would matter
    with torch.no_grad():
        want = float(m(x, y, doc_ids=d)[1])
        assert abs(want - float(m(x, y, doc_ids=(x == tok.bos_id).cumsum(1))[1])) > 1e-4
    out = tmp_path / "run_mix"
    r = forkserver.run(["train.py", "config/sft.py", f"--finetune_from={tmp_path / 'pre'}",
                        f"--data_root={corpus[0].parent}", f"--out_dir={out}", f"--seq_len={ROW}", "--batch_size=8",
                        "--stages=" + json.dumps([{"name": "mix", "steps": 1, "lr_phase": "stable",
                                                   "mix": {"pp": 0.5, "text": 0.5}}]),
                        "--eval_interval=100", "--log_interval=1", "--sample_tokens=0"], cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    logged = [json.loads(line) for line in open(out / "metrics.jsonl") if '"loss"' in line][0]["loss"]
    assert abs(logged - want) < 1e-4, (logged, want)


def test_a_missing_or_short_loss_mask_is_found_when_the_stream_opens(corpus, tmp_path):
    """A shard's .bin sizes were checked when a stream opened, its loss mask only when its shard was first read:
    hours into an SFT run."""
    import shutil
    d = tmp_path / "pp"
    shutil.copytree(corpus[0], d)
    entries = json.load(open(d / "index.json"))["splits"]["train"]
    last = d / entries[-1]["mask"]
    assert len(entries) > 1 and entries[-1]["tokens"] > 0
    last.write_bytes(last.read_bytes()[:-1])
    with pytest.raises(shards.DataError, match="one per token"):
        shards.TokenStream(str(d), "train")
    os.remove(last)
    with pytest.raises(shards.DataError, match="loss mask missing"):
        shards.TokenStream(str(d), "train")


def test_review_round_a_long_system_prompt_a_cut_character_and_a_base_model(tok, sft_run, tmp_path, monkeypatch,
                                                                              capsys):
    """Review findings:
    - a system prompt of half the context passed the start-up check, then every message was refused: the answer's
      room was half the whole context, not half what the system prompt leaves;
    - an answer ending in a cut multi-byte character kept U+FFFD in the history but never showed it;
    - a base checkpoint (never fine-tuned) chatted without a word: noise, and no hint why;
    - a container without a tokenizer was refused only after the engine had loaded (seconds, a minute cold);
    - Ctrl-C while a model loads spoke of `pick`'s report."""
    import torch
    model = load_checkpoint(sft_run)
    backend = chat.picaflor_backend(model)
    system = "be brief " * 8
    system_len = 1 + len(chat.render_turn(tok, "system", system)[0])
    context = 2 * system_len + 8  # room for the turn and an answer, but not for half the whole context
    conv = chat.Conversation(tok, backend, system=system, context=context)
    assert len(chat.render_turn(tok, "user", "ping 3")[0]) + 1 + context // 2 + system_len > context
    assert conv.reply("ping 3", 256) is not None and conv.last_stop in ("end", "max_new_tokens")  # was: refused
    steps = {"n": 0}

    def forward(ids, cache):  # the second (last) answer token is forced to an id with no text
        logits = backend["forward"](ids, cache)
        steps["n"] += 1
        if steps["n"] == 2:
            logits = torch.full_like(logits, -1e9)
            logits[..., 0] = 0.0
        return logits
    shown = []
    answer = chat.Conversation(tok, dict(backend, forward=forward)).reply("ping 3", 2, on_text=shown.append)
    assert answer.endswith("\ufffd") and "".join(shown) == answer
    # a base checkpoint: one note on stderr; a fine-tuned one (also resumed): none
    for cfg, noted in (({"init_from": "scratch", "finetune_from": ""}, True),
                       ({"init_from": "resume", "finetune_from": ""}, True),
                       ({"init_from": "resume", "finetune_from": "out/base"}, False),
                       ({"init_from": "finetune", "finetune_from": "out/base"}, False)):
        (tmp_path / "state.json").write_text(json.dumps({"config": cfg}))
        chat.warn_if_not_chat_tuned(str(tmp_path))
        err = capsys.readouterr().err
        assert ("is a base model" in err) == noted, (cfg, err)
    chat.warn_if_not_chat_tuned(sft_run + "/nope")  # no state.json: no verdict, no error
    # a base model exported to int4: chat over the container said nothing (the checkpoint's note was lost in export)
    import export
    base = checkpoint.resolve(sft_run)
    state = json.load(open(os.path.join(base, "state.json")))
    assert checkpoint.chat_tuned(state) is True and checkpoint.chat_tuned({}) is None
    state["config"].update(init_from="scratch", finetune_from="")
    base_copy = tmp_path / "base" / os.path.basename(base)
    shutil.copytree(base, base_copy)
    (base_copy / "state.json").write_text(json.dumps(state))
    man = json.load(open(base_copy / "MANIFEST.json"))  # (it hashes state.json too)
    man["files"]["state.json"] = {"sha256": checkpoint.sha256_file(str(base_copy / "state.json")),
                                  "bytes": os.path.getsize(base_copy / "state.json")}
    (base_copy / "MANIFEST.json").write_text(json.dumps(man))
    base_pcf = str(tmp_path / "base.pcf4")
    export.export_int4(export.Source(str(base_copy)), base_pcf, progress=False)
    capsys.readouterr()
    chat.load_model(base_pcf)
    assert "base.pcf4 holds a base model (never fine-tuned on chats)" in capsys.readouterr().err
    # a container without a tokenizer: refused before the engine loads
    import container
    import stream_infer
    cfg_file = tmp_path / "m.py"
    cfg_file.write_text("".join(f"{k} = {v!r}\n" for k, v in MODEL.items()))
    assert container.main(["--random-config", str(cfg_file), "--out", str(tmp_path / "m.pcf4")]) == 0

    def no_load(*a, **kw):
        raise AssertionError("the engine loaded before the tokenizer was checked")
    monkeypatch.setattr(stream_infer, "load", no_load)
    with pytest.raises(chat.ChatError, match="carries no tokenizer"):
        chat.load_model(str(tmp_path / "m.pcf4"))

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(chat, "load_model", interrupted)
    capsys.readouterr()
    assert chat.main([sft_run]) == 130
    assert capsys.readouterr().err == "chat.py: interrupted\n"


def test_piped_chat_survives_bad_bytes_and_a_closed_reader(sft_run):
    """`printf 'caf\\xe9\\n' | chat.py` under a strict UTF-8 locale and `chat.py ... | head -1` gave tracebacks."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "chat.py", sft_run, "--max-new-tokens", "8", "--threads", "1"]
    bad = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    closed = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    closed.stdout.read(1)
    closed.stdout.close()  # the reader leaves after the first byte
    out, err = bad.communicate(b"caf\xe9\nping 1\n", timeout=120)
    assert bad.returncode == 0 and b"Traceback" not in err and b"pong 1" in out, err.decode()[-2000:]
    try:
        closed.stdin.write(b"ping 1\n" * 200)
        closed.stdin.close()
    except BrokenPipeError:  # it may have left already, at its first prompt
        pass
    closed.wait(timeout=120)
    err = closed.stderr.read()
    assert closed.returncode == 141 and b"Traceback" not in err and b"Error" not in err, err.decode()[-2000:]


def test_a_corrupt_expert_found_mid_answer_is_one_line(tok, sft_run, monkeypatch, capsys):
    """An int4 container's expert that fails its checksum when first streamed, mid-answer, gave a traceback."""
    import container
    model = load_checkpoint(sft_run)
    backend = chat.picaflor_backend(model)

    def corrupt(ids, cache):
        raise container.ContainerError("m.pcf4: checksum mismatch in layer 1 expert 3 (offset 4096); the file is "
                                       "corrupt, re-export it")
    monkeypatch.setattr(chat, "load_model", lambda *a, **kw: (tok, dict(backend, forward=corrupt)))
    monkeypatch.setattr("builtins.input", lambda prompt: "ping 1")
    assert chat.main([sft_run]) == 1
    err = capsys.readouterr().err
    assert err.startswith("chat.py: error: m.pcf4: checksum mismatch") and len(err.strip().splitlines()) == 1
    import expert_cache  # the expert cache's own refusal mid-answer was a traceback too

    def too_small(ids, cache):
        raise expert_cache.CacheError("m.pcf4: an expert cache of 0.5 MiB cannot hold one expert (1.0 MiB); raise "
                                      "--ram-budget")
    monkeypatch.setattr(chat, "load_model", lambda *a, **kw: (tok, dict(backend, forward=too_small)))
    assert chat.main([sft_run]) == 1
    err = capsys.readouterr().err
    assert err.startswith("chat.py: error: m.pcf4: an expert cache") and len(err.strip().splitlines()) == 1


def test_a_context_past_the_models_is_said_to_be_capped(tok, monkeypatch, capsys):
    """--context beyond the model's max_seq_len was capped without a word (the banner's figure only)."""
    import types
    backend = dict(forward=None, new_cache=lambda n: types.SimpleNamespace(pos=0, max_len=n), max_len=64,
                   device="cpu", after_reply=None)
    for context, said in ((4096, True), (64, False), (32, False)):
        assert chat.chat_loop(tok, backend, context=context, input_fn=lambda p: "/exit", out=io.StringIO()) == 0
        err = capsys.readouterr().err
        assert ("--context 4096 is capped at the model's 64 positions" in err) == said, err


def test_pick_val_loss_keeps_each_packed_conversation_to_itself(tok, corpus):
    """`chat.py pick`'s held-out loss ran the packed val rows without train.py's doc_mask: each conversation attended
    to those packed before it in its row (never seen when served), so the score differed from train.py's val loss."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    m = Picaflor(ModelConfig(**MODEL)).eval()
    x, y = shards.TokenStream(str(corpus[0]), "val").next_batch(4, ROW)
    assert ((x == tok.bos_id).sum(1) > 1).all()  # several conversations in every row
    with torch.no_grad():
        sums = {}
        for masked in (True, False):
            logits = m(x, doc_ids=(x == tok.bos_id).cumsum(1) if masked else None).float()
            sums[masked] = float(F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1,
                                                 reduction="sum"))
    n = int((y != -1).sum())
    assert abs(sums[True] - sums[False]) / n > 1e-3  # the mask matters here
    loss, count = chat.val_assistant_loss(m, str(corpus[0]), max_rows=4)
    assert count == n and abs(loss - sums[True] / n) < 1e-5, (loss, sums[True] / n, sums[False] / n)


def scripted_backend(script, fed=None):
    """A chat backend of a 64-token context whose model answers the ids in script, its last one from then on; the ids
    it is fed are appended to fed."""
    import types
    step = {"n": 0}

    def forward(ids, cache):
        if fed is not None:
            fed.extend(ids[0].tolist())
        cache.pos += ids.shape[1]
        logits = torch.full((1, MODEL["vocab_size"]), -1e9)
        logits[0, script[min(step["n"], len(script) - 1)]] = 0.0
        step["n"] += 1
        return logits
    return dict(forward=forward, new_cache=lambda n: types.SimpleNamespace(pos=0, max_len=n), max_len=64, device="cpu",
                after_reply=None)


def test_an_answer_the_terminal_cannot_encode_is_shown_whole(tok, monkeypatch):
    """A terminal (or a redirected stdout) whose encoding lacks a character of the answer (Latin-1, Windows' cp1252:
    an emoji, a euro sign in Latin-1): the UnicodeEncodeError, a ValueError, stopped the answer at that character and
    showed the codec's message instead. Such a character shows as '?' now, and the answer goes on."""
    backend = scripted_backend(tok.encode("\u20ac ok") + [tok.special_ids["<|end|>"]])  # a model answering "\u20ac ok"
    out = io.TextIOWrapper(io.BytesIO(), encoding="latin-1", write_through=True)
    monkeypatch.setattr(sys, "stdout", out)
    lines = iter(["ping 1"])

    def fake_input(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    assert chat.chat_loop(tok, backend, input_fn=fake_input) == 0
    text = out.buffer.getvalue().decode("latin-1")
    assert "? ok\n" in text and "codec" not in text, text


# what a model can write that drives a terminal: CSI (clear screen), OSC 52 (set the clipboard) ended by BEL, \r over
# the line, C1 CSI (U+009B), a lone byte (U+FFFD); one byte token each, so every sequence is cut across pieces
HOSTILE = "a\x1b[2J\x1b]52;c;cm0gLXJm\x07ok\rX\tY\nZ\u009b31m"


def hostile_ids(tok):
    return [b + 1 for b in HOSTILE.encode()] + [0xff + 1]  # ids 1..256 are the bytes


def test_an_answer_s_control_characters_are_escaped_on_a_terminal_and_exact_in_a_file(tok):
    """A model's answer went to the terminal raw: its ESC sequences cleared the screen, wrote the clipboard (OSC 52),
    overwrote the line. On a terminal every control character but \\n and \\t is shown as \\x1b now; piped, the
    answer is the exact text."""
    answer = HOSTILE + "\ufffd"
    for tty in (True, False):
        out = type("Out", (io.StringIO,), {"isatty": lambda self, tty=tty: tty})()
        backend = scripted_backend(hostile_ids(tok) + [tok.special_ids["<|end|>"]])
        lines = iter(["ping 1", "/exit"])
        assert chat.chat_loop(tok, backend, input_fn=lambda prompt: next(lines), out=out) == 0
        text = out.getvalue()
        if tty:
            assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", text), repr(text)
            assert ("a\\x1b[2J\\x1b]52;c;cm0gLXJm\\x07ok\\x0dX\tY\nZ\\x9b31m\ufffd\n") in text, repr(text)
        else:
            assert answer + "\n" in text, repr(text)


def test_a_message_too_long_for_the_context_names_the_fix_that_helps(tok):
    """Every refused message said "shorten it or lower --max-new-tokens": a message longer than the whole context no
    limit helps (it said so anyway), and one that fits with a smaller limit did not say which limit."""
    backend = scripted_backend([tok.special_ids["<|end|>"]])  # a model that ends its answer at once
    conv = chat.Conversation(tok, backend)
    with pytest.raises(ValueError) as e:
        conv.reply("hello " * 100, 256)
    assert str(e.value).endswith("does not fit the context of 64 tokens; shorten it"), e.value
    text = "ping pong " * 16
    room = 64 - 1 - len(chat.render_turn(tok, "user", text)[0]) - 1  # <|bos|>, the turn, <|assistant|>
    assert 1 <= room < 31  # it does not fit with the 31 new tokens reserved for a --max-new-tokens of 256
    with pytest.raises(ValueError, match=f"shorten it or lower --max-new-tokens to {room}$"):
        conv.reply(text, 256)
    assert conv.reply(text, room) == "" and conv.last_stop == "end"  # the limit it named fits


def test_a_piped_crlf_line_is_the_message_the_model_was_trained_on(tok):
    """`chat.py CKPT < prompts.txt` with Windows line ends: input() keeps the \\r, so every user turn ended "...\\r"
    before its <|end|>, a token no training conversation has there."""
    fed = []
    backend = scripted_backend([tok.special_ids["<|end|>"]], fed)  # a model that ends its answer at once
    lines = iter(["ping 1\r", "/exit\r"])
    assert chat.chat_loop(tok, backend, input_fn=lambda prompt: next(lines), out=io.StringIO()) == 0
    assert fed == render_prompt(tok, [{"role": "user", "content": "ping 1"}])


def test_a_ctrl_c_anywhere_in_a_reply_leaves_ids_cache_and_messages_agreeing(tok):
    """A Ctrl-C lands between any two statements, not only inside a forward. Between `out.append(t)` and
    `self.ids.append(t)` it kept a token in the text history that the cache never saw; between the user's tokens going
    into ids and its message into messages, it left an unclosed <|assistant|> (the next turn followed it) and a user
    turn missing from messages. At every line of reply before its finally: ids, messages and cache agree."""
    import inspect
    import types
    lines, first = inspect.getsourcelines(chat.Conversation.reply)
    end_line = first + next(i for i, s in enumerate(lines) if s.strip().startswith("finally:"))
    script = tok.encode("pong 3 pong") + [tok.special_ids["<|end|>"]]
    step = {"n": 0}

    def forward(ids, cache):  # a model that answers "pong 3 pong"; the cache records what it was fed
        cache.toks[cache.pos:] = ids[0].tolist()
        cache.pos += ids.shape[1]
        logits = torch.full((1, MODEL["vocab_size"]), -1e9)
        logits[0, script[min(step["n"], len(script) - 1)]] = 0.0
        step["n"] += 1
        return logits
    backend = dict(forward=forward, new_cache=lambda n: types.SimpleNamespace(pos=0, max_len=n, toks=[]), max_len=64,
                   device="cpu", after_reply=None)

    def rendered(conv):
        return [tok.bos_id] + [i for m in conv.messages for i in chat.render_turn(tok, m["role"], m["content"])[0]]
    k, hit = 0, True
    while hit:  # the k-th line run in reply (before its finally) gets the Ctrl-C, for every k until none is left
        conv, hit, seen = chat.Conversation(tok, backend), False, {"n": 0}  # (no system: messages start empty)
        step["n"] = 0

        def tracer(frame, event, arg):
            if frame.f_code is not chat.Conversation.reply.__code__:
                return None

            def local(frame, event, arg):
                nonlocal hit
                if event == "line" and frame.f_lineno < end_line:
                    seen["n"] += 1
                    if seen["n"] == k + 1:
                        hit = True
                        raise KeyboardInterrupt
                return local
            return local
        sys.settrace(tracer)
        try:
            conv.reply("ping 1", 8)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        assert conv.ids == rendered(conv), (k, conv.messages)
        assert conv.cache.toks[:conv.cache.pos] == conv.ids[:conv.cache.pos]
        roles = [m["role"] for m in conv.messages]
        assert roles in ([], ["user", "assistant"]), (k, roles)
        step["n"] = 0
        assert conv.reply("ping 4", 8) == "pong 3 pong" and conv.ids == rendered(conv), k
        k += 1
    assert k > 10  # every line of reply was tried


def test_two_picks_of_one_run_dir_at_once_both_score(corpus, sft_run, monkeypatch):
    """chat.py pick twice on one run dir (two terminals): the second to remove the shared write probe found it gone,
    "cannot write sft_pick.md there (No such file or directory)", a false refusal. Each pick goes on to score."""
    import model
    real = os.remove

    def the_other_pick_first(path):
        if os.path.basename(path) == ".writable" and os.path.exists(path):
            real(path)  # the other pick's remove of the same probe, just before this one's
        return real(path)
    monkeypatch.setattr(os, "remove", the_other_pick_first)

    def scored(*a, **k):
        raise KeyboardInterrupt  # (reached scoring: enough)
    monkeypatch.setattr(model, "load_checkpoint", scored)
    with pytest.raises(KeyboardInterrupt):
        chat.pick(sft_run, str(corpus[0]), prompts=["ping 4"], max_new_tokens=2, max_rows=2, log=lambda *a: None)


def test_pick_measures_every_checkpoint_on_the_same_windows(tok, corpus, tmp_path):
    """A resume may raise max_seq_len (train.py's RESUME_CONFIG_WINS): pick cut the val rows at each checkpoint's own
    max_seq_len, so one run's checkpoints were ranked by losses over windows of other lengths (here: the same weights
    scored 16- and 32-token windows, two losses); a diverged (NaN) first checkpoint was named the lowest loss."""
    torch.manual_seed(0)
    short = Picaflor(ModelConfig(**{**MODEL, "max_seq_len": 16}))
    run = str(tmp_path / "run")
    save_checkpoint(short, run, 1, tokenizer_file=tok.path)
    long = Picaflor(ModelConfig(**MODEL))
    long.load_state_dict(short.state_dict())
    save_checkpoint(long, run, 2, tokenizer_file=tok.path)
    rep = chat.pick(run, str(corpus[0]), prompts=["ping 4"], max_new_tokens=2, max_rows=8, log=lambda *a: None)
    a, b = rep["checkpoints"]
    assert a["val_targets"] == b["val_targets"] and abs(a["val_loss"] - b["val_loss"]) < 1e-5, (a["val_loss"],
                                                                                                b["val_loss"])
    results = [dict(a, checkpoint="step_0000001", val_loss=float("nan")), dict(b, checkpoint="step_0000002")]
    report = chat.write_pick_report(run, str(corpus[0]), ["ping 4"], 2, results, [], done=True)
    assert report["lowest_val_loss"] == "step_0000002"
    md = open(os.path.join(run, "sft_pick.md")).read()
    assert "| step_0000001 | nan |" in md and "| step_0000001 | nan | 0/1 | 0.00 | lowest loss |" not in md, md


def test_reset_and_a_full_context_never_hold_two_kv_caches(tok):
    """/reset and a full context made a new KV cache of the whole context while the old one was still held: two
    caches at once, where --ram-budget reserves one (a kv-heavy container at the budget its refusal named went from
    379 to 440 MiB of RSS against a 437M budget at the first dropped exchange, and again at /reset)."""
    import types
    import weakref
    end = tok.special_ids["<|end|>"]
    made, alive_at_new = [], []

    class Cache(types.SimpleNamespace):  # (a SimpleNamespace takes no weak reference)
        pass

    def forward(ids, cache):  # a model that answers "ping" tokens until told to stop
        cache.pos += ids.shape[1]
        logits = torch.full((1, MODEL["vocab_size"]), -1e9)
        logits[0, end if cache.pos >= cache.max_len - 1 else 5] = 0.0
        return logits

    def new_cache(n):
        alive_at_new.append(sum(r() is not None for r in made))
        c = Cache(pos=0, max_len=n)
        made.append(weakref.ref(c))
        return c

    conv = chat.Conversation(tok, dict(forward=forward, new_cache=new_cache, max_len=64, device="cpu",
                                       after_reply=None))
    notes = []
    for _ in range(4):
        conv.reply("ping pong ping", 20, on_text=notes.append)
    conv.reset()
    conv.reply("ping", 4)
    assert any("context full" in s for s in notes)
    assert alive_at_new and max(alive_at_new) == 0, alive_at_new


def test_the_engine_backend_keeps_only_the_last_hidden_state_of_a_turn(tok):
    """A turn's prefill asked stream_infer's engine for every position's hidden state (T x d_model floats, 32 MiB for
    a full 4096-token context on micro, outside the budget's working reserve) to use the last one."""
    import types
    rows = []

    def forward(ids, cache, last_only=False):
        cache.pos += ids.shape[1]
        h = torch.zeros(1, 1 if last_only else ids.shape[1], 8)
        rows.append(h.shape[1])
        return h

    end = tok.special_ids["<|end|>"]

    def logits(h):
        out = torch.full((h.shape[0], MODEL["vocab_size"]), -1e9)
        out[:, end if len(rows) > 2 else 5] = 0.0
        return out
    eng = types.SimpleNamespace(set_experts_per_token=lambda k: None, forward=forward, logits=logits, context=64,
                                device="cpu", cfg=None, stop_probes=lambda: None,
                                cache=types.SimpleNamespace(settle=lambda: None, cancel=lambda: None))
    backend = dict(chat.engine_backend(eng), new_cache=lambda n: types.SimpleNamespace(pos=0, max_len=n))
    conv = chat.Conversation(tok, backend)
    conv.reply("ping pong ping pong", 8)
    assert len(rows) == 3 and rows == [1, 1, 1], rows


def test_an_answer_cut_by_a_full_context_says_so(tok):
    """A reply ends at --max-new-tokens or where it fills the context: the second ended a 100-token answer at 20-odd
    tokens without a word, as if it were the limit. Said now; an answer that reached the limit itself is not."""
    import types

    def forward(ids, cache):  # a model that never ends its answer
        cache.pos += ids.shape[1]
        logits = torch.full((1, MODEL["vocab_size"]), -1e9)
        logits[0, tok.encode("a")[0]] = 0.0
        return logits
    backend = dict(forward=forward, new_cache=lambda n: types.SimpleNamespace(pos=0, max_len=n), max_len=64,
                   device="cpu", after_reply=None)
    for limit, said in ((100, True), (5, False)):
        out, lines = io.StringIO(), ["ping 1"]

        def typed(_):
            if not lines:
                raise EOFError
            return lines.pop()
        chat.chat_loop(tok, backend, max_new_tokens=limit, context=32, input_fn=typed, out=out)
        cut = re.search(r" \[cut at (\d+) tokens: the answer filled the context of 32 tokens; --context raises it",
                        out.getvalue())
        assert bool(cut) == said, out.getvalue()
        if said:
            assert 10 < int(cut.group(1)) < 32 and "aaaa" in out.getvalue()


def smoltalk_prepare():
    """data/smoltalk/prepare.py as a module (its pieces_of is what a test calls, no corpus built)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("smoltalk_prepare", os.path.join(REPO, "data/smoltalk/prepare.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_lone_surrogate_in_a_conversation_is_refused_not_trained_as_a_replacement_character(tok):
    """A JSON line's "\\ud83d" (half an emoji, cut by a scraper) parses to a lone surrogate, past the not-UTF-8 check on
    the raw line: tiktoken encodes it as U+FFFD, so the corpus trained the model on replacement characters, unsaid."""
    half = json.loads('"caf\\u00e9 \\ud83d"')
    U, A = {"role": "user", "content": "ping 1"}, {"role": "assistant", "content": "pong 1"}
    for msgs in ([dict(U, content=half), A], [U, dict(A, content=half)], [{"role": "system", "content": half}, U, A]):
        with pytest.raises(chat.ChatFormatError, match=r"lone surrogate \\ud83d") as e:
            chat.render_conversation(tok, msgs, need_assistant=True)
        assert e.value.kind == "not_utf8"  # prepare.py counts it as bad_not_utf8, with the other undecodable lines
    assert chat.render_conversation(tok, [{"role": "user", "content": "caf\u00e9 \U0001F600"},
                                          {"role": "assistant", "content": "ok"}])  # a whole emoji is text


def test_a_long_conversation_is_split_only_between_answers_and_keeps_every_system_message(tok):
    """Split at every user turn, a question asked in two user messages lost its first half (the answer trained as a
    reply to the second alone), and a second leading system message became an exchange of its own, left out of the
    pieces; turns after the last answer (nothing in them is trained) took row space in some pieces and not others."""
    prep = smoltalk_prepare()
    sp = tok.special_ids

    def pieces(msgs, max_len):
        stats = collections.Counter()
        out = prep.pieces_of(tok, msgs, [tok.encode(m["content"]) for m in msgs], max_len, stats)
        return [ids for ids, _ in out], stats
    U, A, S = ({"role": r, "content": t} for r, t in (("user", "ping 1"), ("assistant", "pong 1"), ("system", "be")))
    two_part = [U, A, {"role": "user", "content": "ping 2"}, {"role": "user", "content": "ping 3"}, A]
    whole = chat.render_conversation(tok, two_part[2:])[0]
    got, stats = pieces(two_part, len(whole))
    assert got == [chat.render_conversation(tok, two_part[:2])[0], whole], got  # both halves of the question, answered
    two_sys = [S, {"role": "system", "content": "brief"}, U, A, {"role": "user", "content": "ping 3"}, A]
    got, _ = pieces(two_sys, len(chat.render_conversation(tok, two_sys[:4])[0]))
    prefix = chat.render_conversation(tok, two_sys[:2])[0]  # <|bos|> and both system turns
    assert len(got) == 2 and all(p[:len(prefix)] == prefix for p in got), got
    trailing = [U, A, {"role": "user", "content": "ping 2"}, {"role": "system", "content": "x"}]
    got, stats = pieces(trailing, 64)
    assert got == [chat.render_conversation(tok, [U, A])[0]] and stats["trailing_turns_dropped"] == 2
    assert got[0][-1] == sp["<|end|>"]
