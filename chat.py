"""
Chat with a picaflor model: the chat format (one render function for training, inference and export), a
terminal chat that keeps the history in the KV cache, and checkpoint choice for an SFT run.

    python chat.py out/sft                          # chat with a checkpoint (run dir or step_* dir)
    python chat.py model.pcf4 --ram-budget 4G       # chat with an int4 container (stream_infer.py's engine)
    python chat.py pick out/sft --data data/smoltalk   # score every checkpoint of an SFT run -> sft_pick.md/.json

The format (tokenizer.py reserves the special tokens, so no tokenizer resize is ever needed):

    <|bos|>[<|system|>TEXT<|end|>]<|user|>TEXT<|end|><|assistant|>TEXT<|end|><|user|>...

Every turn is <|role|> + content + <|end|>, roles system / user / assistant, content encoded with
Tokenizer.encode (special-token strings inside text stay plain text). The loss mask is 1 exactly on the
assistant's content tokens and its closing <|end|> (the model learns to answer and to stop), 0 elsewhere.
A prompt for generation is the rendered history + <|assistant|>. export.py's jinja chat template renders the
same ids (tests/test_chat.py checks it with transformers' apply_chat_template).

Terminal chat (the implementer's calls):
- The KV cache holds the whole conversation; each new user turn appends only its own tokens (plus the
  <|end|> that closed the last reply) to the cache: the history is never re-prefilled. When the context is full,
  the oldest exchanges are dropped and what is left is prefilled once (said on screen).
- Output streams token by token, exact when piped; on a terminal the model's control characters (ESC sequences,
  carriage return, BEL, C1) are written escaped (tokenizer.terminal_text), so an answer cannot drive it. Stops at
  <|end|> (or any other special token), --max-new-tokens or a full context (said: it looked like the limit); a reply
  cut by the limit or by Ctrl-C is closed with <|end|> in the cache, as render_conversation would write it.
- /reset starts a new conversation (same system prompt), /exit or Ctrl-D quits, Ctrl-C at the prompt quits,
  Ctrl-C while the model is answering stops that answer. Greedy by default (--temperature 0); --temperature T
  with --top-p P samples. No repetition penalty, ever.
"""

import argparse
import json
import math
import os
import re
import sys
import time

ROLES = ("system", "user", "assistant")
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # in a str: never text (JSON's "\ud83d" escape gives one)


class ChatFormatError(ValueError):
    """A conversation that cannot be rendered. kind: 'unknown_role' | 'empty_assistant' | 'malformed' |
    'no_assistant' (a training conversation with nothing to learn) | 'not_utf8' (a lone surrogate)."""

    def __init__(self, message, kind):
        super().__init__(message)
        self.kind = kind


def check_messages(messages, need_assistant=False):
    """Raise ChatFormatError unless messages is a list of {"role": system|user|assistant, "content": str} with no
    empty assistant turn (and, with need_assistant, at least one assistant turn)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatFormatError("a conversation must be a non-empty list of {role, content} messages", "malformed")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatFormatError(f"message {i} is not a {{role, content}} object", "malformed")
        if not isinstance(m["content"], str) or not isinstance(m["role"], str):
            raise ChatFormatError(f"message {i}: role and content must be strings", "malformed")
        if m["role"] not in ROLES:
            raise ChatFormatError(f"message {i}: unknown role {m['role']!r} (roles: {', '.join(ROLES)})", "unknown_role")
        if bad := LONE_SURROGATE.search(m["content"]):  # (tiktoken encoded it as U+FFFD: trained on, unsaid)
            raise ChatFormatError(f"message {i}: a lone surrogate \\u{ord(bad.group()):04x} in its content (half a "
                                  f"character, e.g. a JSON escape of half an emoji); fix the text", "not_utf8")
        if m["role"] == "assistant" and not m["content"].strip():
            raise ChatFormatError(f"message {i}: empty assistant turn", "empty_assistant")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ChatFormatError("no assistant turn (nothing to learn)", "no_assistant")


def render_turn(tok, role, content, body=None):
    """(ids, mask) of one turn: <|role|> content <|end|>; mask 1 on an assistant's content and its <|end|>.
    body: tok.encode(content) when the caller already has it (corpus builders encode in batches)."""
    sp = tok.special_ids
    body = tok.encode(content) if body is None else list(body)
    ids = [sp[f"<|{role}|>"]] + body + [sp["<|end|>"]]
    target = 1 if role == "assistant" else 0
    return ids, [0] + [target] * (len(body) + 1)


def render_conversation(tok, messages, need_assistant=False, bodies=None):
    """(ids, mask) of a whole conversation: <|bos|> then every turn. The one place the chat format is written.
    bodies: per-message content ids already encoded (optional)."""
    check_messages(messages, need_assistant)
    ids, mask = [tok.bos_id], [0]
    for j, m in enumerate(messages):
        i, k = render_turn(tok, m["role"], m["content"], None if bodies is None else bodies[j])
        ids += i
        mask += k
    return ids, mask


# ----------------------------------------------------------------------------------------------------------
# a conversation held in the KV cache (model.py's KVCache; any backend that appends to it)

def picaflor_backend(model):
    """forward(ids (1, T), cache) -> logits (1, V) of the last position, new_cache(n), max_len for a Picaflor."""
    import torch
    from model import KVCache

    w = model.embed_tokens.weight

    def forward(ids, cache):
        with torch.no_grad():
            return model(ids, cache=cache)[:, -1].float()

    return dict(forward=forward, new_cache=lambda n: KVCache(model.cfg, 1, n, w.device, w.dtype),
                max_len=model.cfg.max_seq_len, device=w.device, after_reply=None)


def engine_backend(eng, experts_per_token=None):
    """The same for stream_infer.py's Engine (int4 container, routed experts streamed under a RAM budget)."""
    import torch
    from model import KVCache

    eng.set_experts_per_token(experts_per_token)

    def after_reply(interrupted=False):
        eng.stop_probes()  # --prefetch auto probes decode tokens only (Engine.forward judges each)
        if interrupted:  # Ctrl-C: the reads still queued are dropped (settle waited for every one: seconds)
            eng.cache.cancel()
        else:
            eng.cache.settle()

    # the last position's hidden state only: a turn's every one was T x d_model floats outside the working reserve
    return dict(forward=lambda ids, cache: eng.logits(eng.forward(ids, cache, last_only=True)[:, -1]),
                new_cache=lambda n: KVCache(eng.cfg, 1, n, eng.device, torch.float32),
                max_len=eng.context, device=eng.device, after_reply=after_reply, engine=eng)


class Conversation:
    """Messages so far and their tokens; the cache holds ids[:cache.pos], each call feeds only ids[cache.pos:]."""

    def __init__(self, tok, backend, system=None, context=None):
        self.tok, self.b, self.system = tok, backend, system
        self.max_len = min(context or backend["max_len"], backend["max_len"])
        self.stop_ids = set(tok.special_ids.values())  # <|end|> ends a reply; any other special one does too
        self.fed_tokens = []  # tokens fed per forward call (tests check the history is never re-prefilled)
        self.reset()

    def reset(self):
        # the cache is reused from position 0 (it then holds ids[:0] of any history): a new one made while the old
        # was held was two KV caches at once, where --ram-budget reserves one
        if getattr(self, "cache", None) is not None:
            self.cache.pos = 0
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.ids = [self.tok.bos_id] + (render_turn(self.tok, "system", self.system)[0] if self.system else [])
        if self.system and len(self.ids) + 16 > self.max_len:  # else every message was refused as too long
            raise ChatError(f"the system prompt ({len(self.ids)} tokens) leaves no room in the context of "
                            f"{self.max_len} tokens; shorten --system or raise --context")
        if getattr(self, "cache", None) is None:
            self.cache = self.new_cache()

    def new_cache(self):
        """An empty KV cache of max_len positions; one past this machine's memory (a long-context model, or a saved
        max_seq_len of 10^12) is a one-line error, not torch's allocation traceback."""
        try:
            return self.b["new_cache"](self.max_len)
        except (RuntimeError, MemoryError, ValueError, OverflowError, TypeError) as e:  # (2^63: a TypeError)
            raise ChatError(f"a KV cache of {self.max_len} positions (the model's max_seq_len, or --context) cannot be "
                            f"allocated ({(str(e).splitlines() or [type(e).__name__])[0][:100]}); pass a smaller "
                            f"--context") from None

    def _feed(self):
        import torch
        new = self.ids[self.cache.pos:]
        self.fed_tokens.append(len(new))
        return self.b["forward"](torch.tensor([new], device=self.b["device"]), self.cache)

    def _fit(self, user_ids, max_new_tokens):
        """Make room for this turn: drop the oldest exchanges and prefill what is left once. Returns a note or None.
        Room is kept for min(max_new_tokens, half the context the system prompt leaves) new tokens; the answer may
        use all that is left. (Half the whole context refused every message after a long --system.)"""
        system_len = 1 + (len(render_turn(self.tok, "system", self.system)[0]) if self.system else 0)
        max_new_tokens = min(max_new_tokens, (self.max_len - system_len) // 2)
        if len(self.ids) + len(user_ids) + max_new_tokens <= self.max_len:
            return None
        system = self.messages[:1] if self.system else []
        turns = self.messages[len(system):]

        def history_ids(msgs):  # what render_conversation writes; no validation (a Ctrl-C'd answer may be empty)
            return [self.tok.bos_id] + [i for m in msgs for i in render_turn(self.tok, m["role"], m["content"])[0]]

        dropped = 0
        while turns:
            turns = turns[1:]
            while turns and turns[0]["role"] != "user":
                turns = turns[1:]
            dropped += 1
            if len(history_ids(system + turns)) + len(user_ids) + max_new_tokens <= self.max_len:
                break
        ids = history_ids(system + turns)
        if len(ids) + len(user_ids) + max_new_tokens > self.max_len:
            room = self.max_len - len(ids) - len(user_ids)  # new tokens it leaves (a lower limit helped only then)
            raise ValueError(f"this message ({len(user_ids)} tokens) + {max_new_tokens} new tokens does not fit the "
                             f"context of {self.max_len} tokens; shorten it" +
                             (f" or lower --max-new-tokens to {room}" if room >= 1 else ""))
        # the one cache re-prefilled from position 0 (a new one beside it went a KV cache over --ram-budget); first:
        # a Ctrl-C after it leaves a cache that holds ids[:0] of either history
        self.cache.pos = 0
        self.messages, self.ids = system + turns, ids
        return f"[context full: dropped the {dropped} oldest exchange(s)]"

    def reply(self, text, max_new_tokens=256, temperature=0.0, top_p=None, generator=None, on_text=None):
        """Append the user's turn, generate the assistant's (streamed to on_text), return its text."""
        from model import sample_next

        user_ids = render_turn(self.tok, "user", text)[0] + [self.tok.special_ids["<|assistant|>"]]
        note = self._fit(user_ids, max_new_tokens)
        if note and on_text:
            on_text(note + "\n")
        user = {"role": "user", "content": text}
        start = len(self.ids) + len(user_ids)  # the answer is self.ids[start:]: one list, no token in one but not the other
        max_new_tokens = min(max_new_tokens, self.max_len - start)
        shown = ""
        self.last_stop = "interrupted"  # how the last reply ended: end (a stop token), max_new_tokens, interrupted
        try:  # (a Ctrl-C lands between any two statements: the history changes from here on, under the finally)
            self.ids += user_ids
            self.messages.append(user)
            logits = self._feed()
            while True:
                t = int(sample_next(logits, temperature, None, top_p, generator).item())
                if t in self.stop_ids:
                    self.last_stop = "end"
                    break
                self.ids.append(t)
                text_now = self.tok.decode_generated(self.ids[start:])  # decode() raised on an id with no text
                if on_text and not text_now.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                    on_text(text_now[len(shown):])
                    shown = text_now
                if len(self.ids) - start >= max_new_tokens:
                    self.last_stop = "max_new_tokens"
                    break
                logits = self._feed()
        finally:  # also on Ctrl-C: close the turn as render_conversation would, keep the cache consistent
            if len(self.ids) >= start:  # the user's turn is in ids (else the history is as it was)
                if self.messages[-1:] != [user]:
                    self.messages.append(user)
                out = self.ids[start:]
                self.ids.append(self.tok.special_ids["<|end|>"])
                answer = self.tok.decode_generated(out)
                if on_text and answer[len(shown):]:  # a multi-byte character cut short: show what the history keeps
                    on_text(answer[len(shown):])
                self.last_tokens = len(out)
                self.messages.append({"role": "assistant", "content": answer})
            if self.b["after_reply"]:
                self.b["after_reply"](self.last_stop == "interrupted")
        return answer


def chat_loop(tok, backend, system=None, max_new_tokens=256, temperature=0.0, top_p=None, seed=None,
              context=None, input_fn=None, out=None):
    """The terminal chat. Returns 0 (a clean exit) on /exit, Ctrl-D or Ctrl-C at the prompt."""
    import torch

    out = out or sys.stdout
    if input_fn is None and hasattr(sys.stdin, "reconfigure"):  # a Latin-1 byte in a UTF-8 locale: a traceback
        sys.stdin.reconfigure(errors="replace")
    if out is sys.stdout and hasattr(out, "reconfigure"):  # a character its encoding lacks (Latin-1, cp1252) raised
        out.reconfigure(errors="replace")  # UnicodeEncodeError, a ValueError: the answer stopped there, unseen
    input_fn = input_fn or input
    try:
        import readline  # noqa: F401  (line editing and history for input(), where available)
    except ImportError:
        pass
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    conv = Conversation(tok, backend, system, context)
    if context and context > conv.max_len:  # (capped without a word: the user believed in the context they asked for)
        print(f"chat.py: note: --context {context} is capped at the model's {conv.max_len} positions (max_seq_len)",
              file=sys.stderr)
    mode = "greedy" if temperature == 0 else f"temperature {temperature}" + (f", top-p {top_p}" if top_p else "")
    out.write(f"chat ({mode}, context {conv.max_len} tokens): /reset starts over, /exit or Ctrl-D quits, "
              f"Ctrl-C stops an answer\n")
    out.flush()

    # a model's ESC sequences (random weights, a hostile fine-tune) drove the terminal: escaped there, exact in a file
    from tokenizer import terminal_text
    escape = terminal_text if getattr(out, "isatty", lambda: False)() else str

    def show(s):
        out.write(escape(s))
        out.flush()

    while True:
        try:
            line = input_fn(">>> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            break
        line = line.removesuffix("\r")  # a piped file's Windows line ends: input() kept the \r, unlike any trained turn
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            break
        if cmd == "/reset":
            conv.reset()
            show("[new conversation]\n")
            continue
        if cmd.startswith("/") and " " not in cmd:
            show(f"unknown command {cmd}: /reset, /exit\n")
            continue
        try:
            conv.reply(line, max_new_tokens, temperature, top_p, generator, on_text=show)
            if conv.last_stop == "max_new_tokens" and conv.last_tokens < max_new_tokens:  # (it looked like the limit)
                show(f" [cut at {conv.last_tokens} tokens: the answer filled the context of {conv.max_len} tokens; "
                     f"--context raises it, up to the model's max_seq_len]")
            show("\n")
        except KeyboardInterrupt:
            show(" [stopped]\n")
        except ValueError as e:
            show(f"[{e}]\n")
    show("bye\n")
    return 0


# ----------------------------------------------------------------------------------------------------------
# loading a model: a checkpoint (run dir / step dir) or an int4 container

class ChatError(Exception):
    """Bad input; a one-line message naming the file and the fix."""


def warn_if_not_chat_tuned(ck):
    """One line on stderr for a checkpoint that train.py did not fine-tune (a base model answers with noise)."""
    import checkpoint
    try:
        with open(os.path.join(ck, "state.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return  # no verdict without the saved config
    if checkpoint.chat_tuned(state) is False:
        print(f"chat.py: note: {ck} is a base model (trained from {state['config']['init_from']!r}, never fine-tuned on "
              f"chats); its answers will not follow the chat template (fine-tune it with config/sft.py)", file=sys.stderr)


def load_model(path, ram_budget=None, device="cpu", experts_per_token=None, context=None):
    """(tokenizer, backend) for a checkpoint dir or an int4 container file."""
    import checkpoint
    from model import more_experts_note
    from tokenizer import Tokenizer

    if not os.path.exists(path):
        raise ChatError(f"{path}: no such file or directory; pass a checkpoint (run dir or step_* dir) or an int4 "
                        f"container (python export.py CKPT --format int4 --out model.pcf4)")
    if os.path.isdir(path):
        from model import load_checkpoint
        if ram_budget is not None:  # it was ignored: the whole fp32 model loaded
            raise ChatError(f"--ram-budget {ram_budget}: bounds an int4 container's memory, not a checkpoint's; "
                            f"export one (python export.py {path} --format int4 --out model.pcf4) or leave it out")
        try:
            ck = checkpoint.resolve(path)
            model = load_checkpoint(ck, device=device)
        except checkpoint.CheckpointError as e:
            raise ChatError(str(e)) from None
        tok_path = os.path.join(ck, "tokenizer.json")
        if not os.path.exists(tok_path):
            raise ChatError(f"{ck}: no tokenizer.json in the checkpoint; copy the corpus's tokenizer.json into it")
        try:
            tok = Tokenizer.load(tok_path)
        except ValueError as e:
            raise ChatError(str(e)) from None
        if tok.vocab_size > model.cfg.vocab_size:  # its top ids index past the embedding: an IndexError mid-chat
            raise ChatError(f"{tok_path}: tokenizer vocab {tok.vocab_size} > model vocab {model.cfg.vocab_size}; "
                            f"wrong tokenizer for this checkpoint (copy the one of the corpus it trained on)")
        warn_if_not_chat_tuned(ck)
        if experts_per_token:
            try:
                model.set_top_k(experts_per_token)
            except ValueError as e:
                raise ChatError(f"--experts-per-token {experts_per_token}: {e}") from None
            if note := more_experts_note(experts_per_token, model.cfg.top_k if model.moe_layers() else None):
                print(f"chat.py: {note}", file=sys.stderr)
        return tok, picaflor_backend(model)
    import container
    import stream_infer
    try:
        header = container.load_container(path).header
        if not header.get("tokenizer_json"):  # before the engine's seconds of loading
            raise ChatError(f"{path}: the container carries no tokenizer; re-export it from a checkpoint with "
                            f"tokenizer.json")
        if header.get("chat_tuned") is False:  # (containers exported before this was recorded: no verdict)
            print(f"chat.py: note: {path} holds a base model (never fine-tuned on chats); its answers will not follow "
                  f"the chat template (fine-tune it with config/sft.py, then export it again)", file=sys.stderr)
        eng = stream_infer.load(path, ram_budget, device, context=context)
    except (stream_infer.StreamError, container.ContainerError) as e:
        raise ChatError(str(e)) from None
    tok = eng.tokenizer
    try:
        backend = engine_backend(eng, experts_per_token)
    except stream_infer.StreamError as e:
        raise ChatError(str(e)) from None
    if note := more_experts_note(experts_per_token, eng.cfg.top_k if eng.moes else None):
        print(f"chat.py: {note}", file=sys.stderr)
    return tok, backend


# ----------------------------------------------------------------------------------------------------------
# checkpoint choice for an SFT run: held-out assistant loss and greedy answers to fixed prompts, per checkpoint

PICK_PROMPTS = [
    "Hi! Who are you?",
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about a hummingbird.",
    "What is 12 + 7?",
    "Give me three tips for sleeping better.",
]


def val_assistant_loss(model, corpus_dir, max_rows=256, batch_rows=8, seq_len=None):
    """Mean cross-entropy over the assistant tokens (mask 1) of the val split, whole rows, each packed conversation
    attending only to itself (as train.py's val loss and as served); (loss, n targets). seq_len: a cap on the
    windows (pick's, the same for every checkpoint it compares)."""
    import torch
    import torch.nn.functional as F
    import shards

    ts = shards.TokenStream(corpus_dir, "val", vocab_size=model.cfg.vocab_size)
    if not ts.has_mask:
        raise ChatError(f"{corpus_dir}/index.json: not a chat corpus (no loss masks); run data/smoltalk/prepare.py")
    bos = shards.load_corpus_tokenizer(corpus_dir, ts.index).bos_id  # each packed conversation starts at <|bos|>
    cap = min(seq_len or model.cfg.max_seq_len, model.cfg.max_seq_len)
    T = min(ts.row_tokens or cap, cap)
    rows = max(1, min(max_rows, ts.total_tokens // T))
    dev = model.embed_tokens.weight.device
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, rows, batch_rows):
            x, y = ts.next_batch(min(batch_rows, rows - start), T)
            # as train.py's doc_mask: a conversation attends only to itself, not to those packed before it in its row
            logits = model(x.to(dev), doc_ids=(x == bos).cumsum(1).to(dev)).float()
            total += F.cross_entropy(logits.view(-1, logits.size(-1)), y.to(dev).view(-1), ignore_index=-1,
                                     reduction="sum").item()
            count += int((y != -1).sum())
    return (total / count if count else float("nan")), count


def saved_max_seq_len(ckpt_dir):
    """A checkpoint's model max_seq_len from its state.json, or None where it does not say."""
    try:
        with open(os.path.join(ckpt_dir, "state.json")) as f:
            n = json.load(f)["model_config"]["max_seq_len"]
        return n if isinstance(n, int) and n > 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def repeated_ngrams(ids, n=3):
    """Share of the n-grams of ids that already occurred earlier in ids (0 = no repetition)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def pick(run_dir, data_dir, prompts=None, max_new_tokens=128, max_rows=256, device="cpu", dtype=None, log=print):
    """Score every valid checkpoint of run_dir; write run_dir/sft_pick.json and sft_pick.md. Returns the report."""
    import checkpoint
    import rundir
    import shards
    from model import load_checkpoint
    from tokenizer import Tokenizer

    prompts = prompts or PICK_PROMPTS
    try:  # a step a killed re-save left as step_N.old-PID: scored too (it was missed without a word)
        rundir.recover_for_reader(run_dir)
    except checkpoint.CheckpointError as e:
        raise ChatError(str(e)) from None
    ckpts, skipped = [], []
    for s, p in checkpoint.list_checkpoints(run_dir):
        try:
            checkpoint.verify(p)
            ckpts.append((s, p))
        except checkpoint.CheckpointError as e:  # said and listed in the report (it was left out silently)
            log(f"skipping {os.path.basename(p)}: {e}")
            skipped.append({"checkpoint": os.path.basename(p), "why": str(e)})
    if not ckpts:
        raise ChatError(f"{run_dir}: no valid checkpoint (step_* dir with an intact MANIFEST.json); train first "
                        f"(python train.py config/sft.py)")
    try:  # before a checkpoint is scored: a read-only run dir failed at the first report, a traceback, its score lost
        checkpoint.check_writable(run_dir)
    except OSError as e:
        raise ChatError(f"{run_dir}: cannot write sft_pick.md there ({e.strerror}); copy the run dir to a disk you "
                        f"can write and pick there") from None
    try:
        index = shards.load_index(data_dir)
    except shards.DataError as e:
        raise ChatError(str(e)) from None
    toks = {}
    for _, path in ckpts:  # every checkpoint's tokenizer before the first is scored (a late mismatch lost them all)
        try:
            toks[path] = Tokenizer.load(os.path.join(path, "tokenizer.json"))
        except ValueError as e:
            raise ChatError(f"{e}; each checkpoint of an SFT run carries its tokenizer.json") from None
        if toks[path].hash != index.get("tokenizer_sha256"):
            raise ChatError(f"{path}/tokenizer.json differs from {data_dir}'s tokenizer; pass the --data corpus "
                            f"prepared with this model's tokenizer")
    # one window length for all: a resume may raise max_seq_len, and each checkpoint's own cut the rows elsewhere
    # (losses over other windows ranked as one); load_checkpoint says what is wrong with a state.json this cannot read
    seq_len = min([n for n in map(saved_max_seq_len, (p for _, p in ckpts)) if n] or [None])
    results = []
    for step, path in ckpts:
        t0 = time.time()
        model = load_checkpoint(path, device=device, dtype=dtype)
        tok = toks[path]
        loss, n = val_assistant_loss(model, data_dir, max_rows, 8, seq_len)
        answers = []
        for p in prompts:
            conv = Conversation(tok, picaflor_backend(model))
            try:
                a = conv.reply(p, max_new_tokens, temperature=0.0)
            except ValueError as e:  # a --prompt longer than the context: a traceback, and nothing written
                raise ChatError(f"--prompt {p[:40]!r}...: {e}") from None  # (e says the fix: it was said twice)
            answers.append({"prompt": p, "answer": a, "tokens": conv.last_tokens, "stopped": conv.last_stop})
        ended = sum(a["stopped"] == "end" for a in answers)
        rep = sum(repeated_ngrams(tok.encode(a["answer"])) for a in answers) / len(answers)
        results.append({"step": step, "checkpoint": os.path.basename(path), "val_loss": loss, "val_targets": n,
                        "answers_ended": ended, "repetition": rep, "answers": answers})
        log(f"{os.path.basename(path)}: val assistant loss {loss:.4f} over {n:,} tokens ({time.time() - t0:.1f}s)")
        # after every checkpoint: a fault or a Ctrl-C later keeps what was scored (it was written at the end only)
        report = write_pick_report(run_dir, data_dir, prompts, max_new_tokens, results, skipped,
                                   done=len(results) == len(ckpts))
    log(f"wrote {os.path.join(run_dir, 'sft_pick.md')} and sft_pick.json; lowest val loss: {report['lowest_val_loss']}")
    return report


def write_pick_report(run_dir, data_dir, prompts, max_new_tokens, results, skipped, done):
    import checkpoint
    scored = [r for r in results if not math.isnan(r["val_loss"])]  # (a NaN first compared below nothing: "lowest")
    lowest = min(scored, key=lambda r: r["val_loss"])["checkpoint"] if scored else None
    best_file = os.path.join(run_dir, "BEST")
    report = {"run_dir": os.path.abspath(run_dir), "data": os.path.abspath(data_dir), "greedy": True,
              "max_new_tokens": max_new_tokens, "lowest_val_loss": lowest,
              "train_best": open(best_file).read().strip() if os.path.exists(best_file) else None,
              "complete": done, "skipped": skipped, "prompts": prompts, "checkpoints": results}
    checkpoint.write_atomic_text(os.path.join(run_dir, "sft_pick.json"), json.dumps(report, indent=1))
    lines = [f"# Checkpoint choice for {run_dir}", "",
             f"Held-out chat set: {data_dir} (val split, loss on assistant tokens only). Answers are greedy, at most "
             f"{max_new_tokens} tokens. The lowest loss is not always the best chat model: read the answers.", "",
             "Answers ended: how many answers closed their turn (<|end|>) within the limit. Repetition: mean share of "
             "repeated 3-grams of tokens in an answer (looping shows up here).", "",
             "| checkpoint | val assistant loss | answers ended | repetition | |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['checkpoint']} | {r['val_loss']:.4f} | {r['answers_ended']}/{len(prompts)} | "
                     f"{r['repetition']:.2f} | {'lowest loss' if r['checkpoint'] == lowest else ''} |")
    for s in skipped:
        lines.append(f"| {s['checkpoint']} | skipped: {s['why']} | | | |")
    if not done:
        lines += ["", "(still scoring: the checkpoints above are those done so far)"]
    for i, p in enumerate(prompts):
        lines += ["", f"## {i + 1}. {p}", ""]
        for r in results:
            a = r["answers"][i]["answer"].strip().replace("\n", "\n> ")
            lines += [f"**{r['checkpoint']}** (loss {r['val_loss']:.4f})", "", f"> {a}" if a else "> (empty)", ""]
    checkpoint.write_atomic_text(os.path.join(run_dir, "sft_pick.md"), "\n".join(lines) + "\n")
    return report


# ----------------------------------------------------------------------------------------------------------
# command line

def check_device(device):
    from model import device_problem
    if problem := device_problem(device):
        raise ChatError(f"--device {device}: {problem}")


def add_sampling_args(ap):
    ap.add_argument("--system", default=None, help="system prompt (kept across /reset)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="longest answer, in tokens")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=None, help="nucleus sampling with --temperature > 0")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--context", type=int, default=None,
                    help="KV cache positions: older turns leave the history beyond it (default: the model's max; 512 "
                         "for an int4 container with --ram-budget, whose KV cache is reserved in the budget)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["pick"]:
            ap = argparse.ArgumentParser(prog="chat.py pick", description="Score every checkpoint of an SFT run on "
                                         "the held-out chat set and fixed prompts; write RUN_DIR/sft_pick.md/.json")
            ap.add_argument("run_dir")
            ap.add_argument("--data", default="data/smoltalk", help="chat corpus (its val split is the held-out set)")
            ap.add_argument("--prompt", action="append", default=None, help="a fixed prompt (repeat; default: 6 built in)")
            ap.add_argument("--max-new-tokens", type=int, default=128)
            ap.add_argument("--max-rows", type=int, default=256, help="val rows scored per checkpoint")
            ap.add_argument("--device", default="cpu")
            ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                            help="weights dtype (default: as saved; bfloat16 halves memory on a GPU)")
            a = ap.parse_args(argv[1:])
            for flag, v in (("--max-new-tokens", a.max_new_tokens), ("--max-rows", a.max_rows)):
                if v < 1:  # (-5 wrote a report of one-token answers and a loss over no rows, looking like a score)
                    raise ChatError(f"{flag} {v}: at least 1")
            import torch
            check_device(a.device)
            pick(a.run_dir, a.data, a.prompt, a.max_new_tokens, a.max_rows, a.device,
                 getattr(torch, a.dtype) if a.dtype else None)
            return 0
        ap = argparse.ArgumentParser(description="Chat with a picaflor model at the terminal (or: chat.py pick ...).",
                                     epilog="python chat.py pick RUN_DIR --data data/smoltalk: choose a checkpoint")
        ap.add_argument("model", help="checkpoint (run dir or step_* dir) or int4 container")
        ap.add_argument("--ram-budget", default=None, help="int4 container: bound for the whole process, e.g. 4G")
        ap.add_argument("--experts-per-token", type=int, default=None, help="default: the model's top_k")
        ap.add_argument("--device", default="cpu")
        ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="torch threads (default: half the cores)")
        add_sampling_args(ap)
        a = ap.parse_args(argv)
        if a.context is not None and a.context < 16:
            raise ChatError(f"--context {a.context}: at least 16 positions (a turn's own tokens need room)")
        if a.max_new_tokens < 1:
            raise ChatError(f"--max-new-tokens {a.max_new_tokens}: at least 1")
        if a.threads < 1:  # (0 ran on one thread, silently)
            raise ChatError(f"--threads {a.threads}: at least 1")
        if a.experts_per_token is not None and a.experts_per_token < 1:  # 0 meant the default, silently
            raise ChatError(f"--experts-per-token {a.experts_per_token}: at least 1 (leave it out for the model's "
                            f"top_k)")
        import stream_infer  # its sampling checks: a negative temperature sampled the least likely tokens
        try:
            a.temperature = stream_infer.check_sampling(a.temperature, a.top_p, "--", a.seed)
        except stream_infer.StreamError as e:
            raise ChatError(str(e)) from None
        import torch
        check_device(a.device)
        torch.set_num_threads(max(1, a.threads))
        tok, backend = load_model(a.model, a.ram_budget, a.device, a.experts_per_token, a.context)
        return chat_loop(tok, backend, a.system, a.max_new_tokens, a.temperature, a.top_p, a.seed, a.context)
    except ChatError as e:
        print(f"chat.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # (chat_loop handles its own; this is pick or loading)
        print("chat.py: interrupted" + (" (sft_pick.md holds the checkpoints scored so far)" if argv[:1] == ["pick"]
                                        else ""), file=sys.stderr)
        return 130
    except BrokenPipeError:  # `| head`: the reader left; Python's flush at exit would print a second error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # data, checkpoint and container faults of the files given: one line, no traceback
        import checkpoint
        import container
        import shards
        import stream_infer
        import expert_cache
        if not isinstance(e, (shards.DataError, shards.StorageError, checkpoint.CheckpointError, container.ContainerError,
                              stream_infer.StreamError, expert_cache.CacheError)):  # (a corrupt expert found mid-answer: a traceback)
            raise
        print(f"chat.py: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    # as stream_infer.py (kernels.openmp_kernels()): torch's OpenMP threads sleep at once where the int4 kernels run on their
    # own pool (macOS; PICAFLOR_OPENMP=0), not spin on its cores; read at torch's import, which main() makes lazily
    if sys.platform == "darwin" or os.environ.get("PICAFLOR_OPENMP", "1") == "0":
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
