"""
Export a picaflor checkpoint for the tools people already use.

    python export.py CKPT --format int4 --out model.pcf4 [--group-size N] [--embed-bits 4|8]
    python export.py CKPT --format hf   --out DIR [--dtype bfloat16] [--max-shard-size 5GB]
    python export.py CKPT --format gguf --out model.gguf [--gguf-type f16|bf16|q8_0|q4_0]

CKPT is a checkpoint dir (step_NNNNNNN/) or a run dir (its LATEST); its MANIFEST.json is verified first (for
--format gguf also an int4 container: its dequantized weights). Output is written beside --out and renamed into
place; --out may not be, hold or lie inside the checkpoint, and an existing --out is replaced only when picaflor
exported it (an hf folder holding picaflor_export.json and only the files an export writes; a GGUF with the
picaflor.export key; a container). Weights holding NaN or Inf are refused. --tokenizer FILE (any format) must fit
the vocab, and is for a checkpoint without a tokenizer: one that differs from the checkpoint's own (by content: a copy
whose line endings or JSON layout differ is the same, and the checkpoint's own file is exported) is refused unless
--force-tokenizer.

- int4: the streaming container of stream_infer.py, written and read by container.py (one place only).
- hf: a directory transformers loads as HYV3ForCausalLM with no custom code: config.json, model.safetensors
  (sharded with model.safetensors.index.json above --max-shard-size), generation_config.json (greedy, no
  repetition or other sampling penalty), tokenizer.json + tokenizer_config.json for AutoTokenizer (with the
  chat template), and picaflor_tokenizer.json (our own tiktoken file, what tokenizer.Tokenizer.load reads).
  Where d_model or expert_ffn is not a multiple of 8, config.json sets experts_implementation "eager":
  transformers' default experts (torch._grouped_mm) need 16-byte row strides.
- gguf: one file for llama.cpp, arch `hy_v3`, tokenizer embedded.

Implementer's calls (DESIGN.md asks to record them here):
- Streaming: tensors are read one at a time with safetensors `safe_open` and written out at once; the
  safetensors and GGUF writers get every tensor's name/shape/dtype first (from the source header, no data
  read), then the data tensor by tensor. Peak RAM is about the largest source tensor (one layer's stacked
  experts) plus its converted copy, never the whole model.
- HF tensor names: the Hub form of Tencent's Hy3 checkpoints: experts per expert
  `mlp.experts.N.{gate,up,down}_proj.weight`, router `mlp.router.gate.weight`, selection bias
  `mlp.expert_bias`, shared expert `mlp.shared_mlp.*`. transformers' hy_v3 conversion mapping stacks and
  renames them on load (the in-memory names `experts.gate_up_proj` etc. load too; both give identical
  logits, measured), and llama.cpp's convert_hf_to_gguf.py (class HYV3Model) only understands the Hub form.
- Router weight and e_score_correction_bias stay float32 in every format (HF keeps them fp32 too).
- HF tokenizer: byte-level BPE for the `tokenizers` library built from our tiktoken ranks. tiktoken merges
  the adjacent pair whose concatenation has the lowest rank, so the merge list holds every split (a, b) of
  every token with a, b and a+b all in the vocab, ordered by the rank of a+b; with `ignore_merges` (a whole
  pre-token found in the vocab is taken as is, as tiktoken does) encodings are identical (tested). Id 0, the
  reserved id that is never emitted, becomes the special `<|pad|>`. One difference by design: HF parses
  special-token strings ("<|user|>") inside text as the special ids (chat templates need that); our
  Tokenizer.encode treats them as plain text.
- Chat template (simple, documented; the chat issue may refine it):
  `<|bos|>[<|system|>TEXT<|end|>]<|user|>TEXT<|end|><|assistant|>TEXT<|end|>...`, generation prompt
  `<|assistant|>`. AutoTokenizer(text) prepends <|bos|> like training documents; apply_chat_template adds it
  through the template. eos = <|end|> (end of a turn); generation also stops at <|bos|> (a new document) and at
  the turn openers (GGUF: as eom and the FIM pad/rep/sep ids, llama.cpp's other end-of-generation keys).
  `{% generation %}` marks an assistant's content and its <|end|> (chat.py's loss mask) for transformers'
  return_assistant_tokens_mask (TRL's assistant-only loss); it renders nothing, and the GGUF copy goes without it
  (a transformers-only tag other jinja engines do not parse).
- GGUF: names and keys from llama.cpp's hy_v3 loader (src/models/hy-v3.cpp, llama-arch.cpp). No Q/K
  permutation: hy_v3 uses NEOX RoPE, which is HF's rotate_half layout (the llama.cpp converter does not
  permute either). The selection bias is `blk.N.exp_probs_b` (the loader's name, no ".bias" suffix).
  Norms, router and bias stay F32; q8_0/q4_0 need rows divisible by 32 (others fall back to F16, warned with their
  share of the weights; "f16_fallback" in the printed JSON counts them); with
  q4_0 the token embedding and output matrices are Q8_0 (they are the most sensitive). Pre-tokenizer name
  "llama-bpe": its regex splits text the same way as our rustbpe (GPT-4 style) pattern (tested), with one known
  exception: our (?i:'s) also matches the long s (U+017F, Unicode case folding), llama.cpp's '[sS] does not.
"""

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import sys

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

import checkpoint
import container
from model import ModelConfig, hf_name, to_hf_config

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ST_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
PAD_TOKEN = "<|pad|>"  # id 0: reserved, never emitted by the tokenizer


class ExportError(Exception):
    """Bad input for an export; the message names the file and the fix."""


# ----------------------------------------------------------------------------------------------------------
# the source checkpoint, read one tensor at a time

def load_fitting_tokenizer(path, vocab_size):
    """The tokenizer at path (None for none), refused when it is larger than the model's vocab: its top ids would
    index past the embedding in every runtime."""
    import tokenizer as tokmod
    if path is None:
        return None
    tok = tokmod.Tokenizer.load(path)
    if tok.vocab_size > vocab_size:
        raise ExportError(f"{path}: tokenizer vocab {tok.vocab_size} > model vocab {vocab_size}; wrong tokenizer "
                          f"for this checkpoint: pass the one its corpus was prepared with (--tokenizer FILE)")
    return tok


def file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def check_own_tokenizer(given, own_path, own_sha256, own_bytes, force):
    """A --tokenizer other than the one the checkpoint carries (its content, not its path) is refused: one of the same
    vocab replaced it without a word, and the export decoded every answer to other text. force: replace it anyway.
    True when given is the checkpoint's own: its bytes, or a copy of it whose line endings (a CRLF checkout) or JSON
    layout differ (refused as another tokenizer); own_bytes() reads the own file, only for such a copy."""
    import tokenizer as tokmod
    if not given or own_sha256 is None or force:
        return False
    theirs = checkpoint.sha256_file(given)
    if theirs == own_sha256:
        return True
    try:
        same = (tokmod.Tokenizer.from_file_bytes(own_bytes(), own_path).content_hash
                == tokmod.Tokenizer.load(given).content_hash)
    except ValueError:  # (either one corrupt: not the same tokenizer; a corrupt --tokenizer says so when exported)
        same = False
    if not same:
        raise ExportError(f"--tokenizer {given} (sha256 {theirs[:12]}) is not the tokenizer {own_path} carries "
                          f"({own_sha256[:12]}), the one its weights were trained with; drop --tokenizer, or pass "
                          f"--force-tokenizer to replace it anyway")
    return True


class Source:
    """A verified checkpoint dir: config, tokenizer path, and tensors read lazily from model.safetensors."""

    def __init__(self, path, tokenizer_path=None, force_tokenizer=False):
        self.dir = checkpoint.resolve(path)
        manifest = checkpoint.verify(self.dir)
        state_path = os.path.join(self.dir, "state.json")
        try:
            with open(state_path, encoding="utf-8") as f:
                self.state = json.load(f)
            self.cfg = ModelConfig.from_dict(self.state["model_config"], complete=True)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ExportError(f"{state_path}: no usable model_config ({e}); use a checkpoint written by train.py")
        self.weights = os.path.join(self.dir, "model.safetensors")
        self.f = container.open_safetensors(self.weights)  # (not a safetensors file: a traceback)
        # layers in numeric order (layers.2 before layers.10), so files read layer by layer
        self.names = sorted(self.f.keys(), key=lambda n: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", n)])
        self._cache = (None, None)
        self.check_against_config()
        if tokenizer_path and os.path.isdir(tokenizer_path):  # a corpus or checkpoint folder: the file it holds
            tokenizer_path = os.path.join(tokenizer_path, "tokenizer.json")
        own = os.path.join(self.dir, "tokenizer.json")
        tp = tokenizer_path or own
        self.tokenizer_path = tp if os.path.isfile(tp) else None
        if tokenizer_path and not self.tokenizer_path:
            raise ExportError(f"{tokenizer_path}: no such tokenizer file; pass the corpus's tokenizer file")
        # (its hash as the manifest just verified it: no second read; a payload file is always listed)
        if check_own_tokenizer(tokenizer_path, own, manifest["files"].get("tokenizer.json", {}).get("sha256"),
                               lambda: file_bytes(own), force_tokenizer):
            self.tokenizer_path = own  # (the same tokenizer: the checkpoint's bytes, those its manifest hashed)

    def shape(self, name):
        return list(self.f.get_slice(name).get_shape())

    def check_against_config(self):
        """Every tensor the config implies, with its shape, and nothing else (else exports would be broken)."""
        try:
            container.check_tensors_match_config(self.f, self.cfg, self.weights)
        except container.ContainerError as e:
            raise ExportError(str(e)) from None

    def get(self, name):
        """One tensor; the last one read is kept so slicing experts out of a stacked tensor reads it once."""
        if self._cache[0] != name:
            self._cache = (None, None)  # drop the previous tensor before reading the next
            # a fresh safe_open per read: its mmap is unmapped again right after, so the pages already read
            # do not stay in this process's memory (the header parse costs well under a millisecond)
            with safe_open(self.weights, framework="pt") as f:
                self._cache = (name, container.check_finite(f.get_tensor(name), f"{self.weights}: {name}"))
        return self._cache[1]

    def tokenizer(self):
        return load_fitting_tokenizer(self.tokenizer_path, self.cfg.vocab_size)


class ContainerSource:
    """An int4 container read as a source for GGUF: every tensor dequantized to fp32 on demand, so a model
    that only ever existed quantized (config/micro.py's random benchmark weights) can go to llama.cpp too."""

    def __init__(self, path, tokenizer_path=None, force_tokenizer=False):
        import container
        try:
            self.cont = container.load_container(path)
        except container.ContainerError as e:
            raise ExportError(str(e)) from None
        self.dir, self.cfg = str(path), self.cont.config
        self.state = {"model_config": self.cont.header["model_config"],
                      "from_container": str(path), "random_weights": self.cont.header.get("random_weights")}
        expert_names = [f"layers.{i}.mlp.experts.{p}" for i in map(int, self.cont.header["experts"])
                        for p in ("gate_up_proj", "down_proj")]
        key = lambda n: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", n)]  # noqa: E731
        self.names = sorted(list(self.cont.header["tensors"]) + expert_names, key=key)
        self._cache = (None, None)
        self._tmp_tok = None
        if tokenizer_path and os.path.isdir(tokenizer_path):  # a corpus or checkpoint folder: the file it holds
            tokenizer_path = os.path.join(tokenizer_path, "tokenizer.json")
        self.tokenizer_path = tokenizer_path
        if tokenizer_path and not os.path.isfile(tokenizer_path):
            raise ExportError(f"{tokenizer_path}: no such tokenizer file; pass the corpus's tokenizer file")
        own = self.cont.tokenizer_json  # (the checkpoint's tokenizer.json as text; before CRLF was kept, with LF)
        if check_own_tokenizer(tokenizer_path, path, hashlib.sha256(own.encode()).hexdigest() if own else None,
                               lambda: own.encode(), force_tokenizer):  # (own.encode: an AttributeError on None)
            self.tokenizer_path = tokenizer_path = None  # the same tokenizer: the one the container carries
        if not tokenizer_path and self.cont.tokenizer_json:
            import tempfile
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                f.write(self.cont.tokenizer_json)
            self.tokenizer_path = self._tmp_tok = f.name

    def __del__(self):
        if getattr(self, "_tmp_tok", None) and os.path.exists(self._tmp_tok):
            os.remove(self._tmp_tok)

    def shape(self, name):
        if ".mlp.experts." in name:
            part = next(p for p in self.cont.layout["parts"] if name.endswith(p["name"]))
            return [self.cfg.n_experts] + list(part["shape"])
        return list(self.cont.header["tensors"][name]["shape"])

    def get(self, name):
        if self._cache[0] != name:
            self._cache = (None, None)
            if ".mlp.experts." in name:
                layer, pname = int(name.split(".")[1]), name.rsplit(".", 1)[1]
                t = torch.stack([self.cont.expert_weights(layer, e)[pname] for e in range(self.cfg.n_experts)])
            else:
                t = self.cont.tensor(name)
            self._cache = (name, t)
        return self._cache[1]

    def tokenizer(self):
        return load_fitting_tokenizer(self.tokenizer_path, self.cfg.vocab_size)


def is_container(path):
    import container
    try:
        with open(path, "rb") as f:
            return os.path.isfile(path) and f.read(len(container.MAGIC)) == container.MAGIC
    except OSError:
        return False


def expert_part(t, part, e):
    """Slice expert e's gate / up / down matrix out of stacked gate_up_proj [E, 2F, D] or down_proj [E, D, F]."""
    if part == "down":
        return t[e]
    half = t.shape[1] // 2
    return t[e, :half] if part == "gate" else t[e, half:]


def keep_fp32(name):
    return name.endswith("mlp.gate.weight") or name.endswith("e_score_correction_bias")


# ----------------------------------------------------------------------------------------------------------
# safetensors written tensor by tensor (format: 8-byte little-endian header size, JSON header, raw data)

def write_safetensors(path, entries, fetch, metadata=None, progress=None):
    """entries: [(name, shape, torch dtype)]; fetch(i) returns entry i's tensor. Written in entry order."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, shape, dt in entries:
        n = int(np.prod(shape)) * torch.tensor([], dtype=dt).element_size()
        header[name] = {"dtype": ST_DTYPE_NAMES[dt], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for i, (name, shape, dt) in enumerate(entries):
            t = fetch(i).to(dt).contiguous()
            if dt == torch.float16 and not torch.isfinite(t).all():  # the source was checked finite: float16 overflowed
                raise ExportError(f"{name}: values beyond float16's range (+-65504) became Inf; export with "
                                  f"--dtype bfloat16 (or float32)")
            if list(t.shape) != list(shape):
                raise ExportError(f"{name}: shape {list(t.shape)} but planned {list(shape)}")
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            if progress is not None:
                progress.update(t.numel() * t.element_size())
        f.flush()
        os.fsync(f.fileno())


def parse_size(s):
    """5GB = 5e9 bytes (as transformers counts), 5GiB = 5 * 2**30; at least one byte."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(i?)B?|B?)\s*", str(s), re.I)
    size = m and float(m.group(1)) * ((1024 if m.group(3) else 1000) ** " KMGT".index((m.group(2) or " ").upper()))
    if not m or size < 1:
        raise ExportError(f"--max-shard-size {s!r}: give a size like 5GB, 500MB, 2GiB or a byte count")
    if not (m.group(2) or re.search(r"B\s*$", str(s), re.I)) and size < 1 << 20:  # "2" wrote 196 shards of ~2 bytes
        raise ExportError(f"--max-shard-size {s!r}: a number without a unit is bytes; give a size like 5GB or 500MB")
    return int(size)


# ----------------------------------------------------------------------------------------------------------
# tokenizer conversion: our tiktoken ranks -> byte-level BPE strings, merges (HF tokenizers and GGUF "gpt2")

def byte_to_unicode():
    """GPT-2's reversible byte -> printable character table (openai/gpt-2 encoder.py): printable latin-1
    bytes stand for themselves, the others are shifted to code points 256 and up, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def bpe_vocab_and_merges(tok):
    """(vocab {string: id}, merges [(left, right)]) equivalent to the tiktoken ranks (see the header)."""
    table = byte_to_unicode()
    to_str = lambda b: "".join(table[x] for x in b)
    ids = {b: i + 1 for i, b in enumerate(tok.token_bytes)}  # id = rank (+1 for the reserved id 0)
    merges = []
    for b, i in ids.items():
        for cut in range(1, len(b)):
            left, right = b[:cut], b[cut:]
            if left in ids and right in ids:
                merges.append((i, ids[left], ids[right], left, right))
    merges.sort()
    return {to_str(b): i for b, i in ids.items()}, [(to_str(l), to_str(r)) for *_, l, r in merges]


CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('roles must be system, user or assistant, got ' + message['role']) }}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|assistant|>' }}{% generation %}{{- message['content'] + '<|end|>' }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)
# {% generation %} (transformers' return_assistant_tokens_mask, TRL's assistant-only loss) marks what chat.py trains
# on: an assistant's content and its <|end|>. It is a transformers-only tag, so llama.cpp gets the template without it
GGUF_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def hf_tokenizer_files(tok, max_len):
    """tokenizer.json (HF `tokenizers`) and tokenizer_config.json contents for a picaflor Tokenizer."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors
    vocab, merges = bpe_vocab_and_merges(tok)
    # id 0 in the model's vocab too: as an added token only, `tokenizers` gave <|pad|> the next free id, a real token's
    vocab[PAD_TOKEN] = 0
    hft = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False))
    hft.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tok.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hft.decoder = decoders.ByteLevel()
    bos = "<|bos|>"
    hft.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.bos_id)])
    doc = json.loads(hft.to_str())
    specials = [(0, PAD_TOKEN)] + sorted((i, s) for s, i in tok.special_ids.items())
    doc["added_tokens"] = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for i, s in specials]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": "<|end|>", "pad_token": PAD_TOKEN,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": max_len, "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, s in specials},
    }
    return doc, config


# ----------------------------------------------------------------------------------------------------------
# Hugging Face HYV3ForCausalLM

# what the HF export's generation stops at (generation_config.json, said in its model card): the end of a turn, a new
# document, or a turn the model starts on its own (chat.py stops at every special token: generation ran on into an
# invented <|user|> turn)
GENERATION_STOPS = ("<|end|>", "<|bos|>", "<|user|>", "<|assistant|>", "<|system|>")


def model_card(src, dtype_name, with_tokenizer):
    """README.md for the Hub: what the model is, its size, how to load it, the chat format."""
    c = src.cfg
    total = sum(int(np.prod(src.shape(n))) for n in src.names if not n.endswith("e_score_correction_bias"))
    n_moe = c.n_layer - c.n_dense_layers
    active = total - n_moe * (c.n_experts - c.top_k) * 3 * c.d_model * c.expert_ffn
    step, tokens = src.state.get("step"), src.state.get("tokens") or src.state.get("tokens_seen")
    trained = f"step {step}" + (f", {tokens:,} tokens seen" if isinstance(tokens, int) else "")
    tok_use = ("tok = AutoTokenizer.from_pretrained(path)\n"
               "ids = tok(\"The history of\", return_tensors=\"pt\").input_ids  # starts with <|bos|>\n"
               if with_tokenizer else "ids = torch.tensor([[...token ids...]])\n")
    stops = (f"Generation stops at any of {', '.join(f'`{t}`' for t in GENERATION_STOPS)} (its `eos_token_id` "
             f"list): the end of a turn, a new document, or a turn the model starts on its own." if with_tokenizer
             else "It names no stop token (exported without a tokenizer): pass `eos_token_id` to `generate`.")
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [picaflor, hy_v3, mixture-of-experts]
---
# {os.path.basename(os.path.dirname(os.path.abspath(src.dir)))} (picaflor, {os.path.basename(os.path.normpath(src.dir))})

A fine-grained Mixture-of-Experts language model trained with picaflor ({trained}), exported as Hugging Face
`HYV3ForCausalLM` (model_type `hy_v3`): transformers loads it with no custom code.

| | |
|---|---|
| parameters | {total / 1e6:.1f}M total, {active / 1e6:.1f}M active per token (top-{c.top_k}) |
| layers | {c.n_layer} ({c.n_dense_layers} dense, {n_moe} MoE), d_model {c.d_model}, {c.n_head} heads / {c.n_kv_head} kv heads |
| experts | {c.n_experts} routed of width {c.expert_ffn}, top-{c.top_k}, sigmoid router with selection bias, shared width {c.n_shared * c.expert_ffn} |
| context | {c.max_seq_len} tokens, RoPE theta {c.rope_theta:g} |
| vocab | {c.vocab_size} (byte-level BPE) |
| weights | {dtype_name} (router and its bias float32); Hub tensor names (`mlp.experts.N.*_proj.weight`, `mlp.router.gate.weight`, `mlp.expert_bias`, `mlp.shared_mlp.*`) |

```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = "."
model = AutoModelForCausalLM.from_pretrained(path)
{tok_use}out = model.generate(ids, max_new_tokens=50)
```

`generation_config.json` is greedy with no repetition penalty or any other sampling penalty: scoring and
evaluation must see the model's own distribution.
{stops}

Tokenizer: `tokenizer.json` (for AutoTokenizer) encodes exactly like `picaflor_tokenizer.json`, the
tiktoken-based file picaflor trains and serves with (`tokenizer.Tokenizer.load`). Id 0 (`<|pad|>`) is
reserved and never produced. AutoTokenizer parses special-token strings such as `<|user|>` in text as the
special tokens; picaflor's own encode treats them as plain text.

Chat format (`tokenizer.apply_chat_template`):
`<|bos|><|system|>SYSTEM<|end|><|user|>TEXT<|end|><|assistant|>TEXT<|end|>...`; the generation prompt is
`<|assistant|>`.
"""


# Hub (Tencent Hy3) names for the MoE tensors that transformers renames on load (its hy_v3 conversion mapping)
# and that llama.cpp's convert_hf_to_gguf.py (class HYV3Model) expects
HUB_RENAMES = [(".mlp.gate.weight", ".mlp.router.gate.weight"), (".mlp.e_score_correction_bias", ".mlp.expert_bias"),
               (".mlp.shared_experts.", ".mlp.shared_mlp.")]


def hub_name(name):
    """picaflor parameter name -> its name in a Hub checkpoint of HYV3ForCausalLM."""
    out = hf_name(name)
    for a, b in HUB_RENAMES:
        out = out.replace(a, b)
    return out


def hf_plan(src, dtype):
    """[(hf name, source name, expert part or None, expert index, shape, dtype)] in file order."""
    plan = []
    for name in src.names:
        if name.endswith("load_accum"):
            continue
        shape = src.shape(name)
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            base = hf_name(name).rsplit(".", 1)[0]  # model.layers.N.mlp.experts
            E = shape[0]
            parts = ["down"] if name.endswith("down_proj") else ["gate", "up"]
            for e in range(E):
                for part in parts:
                    sh = shape[1:] if part == "down" else [shape[1] // 2, shape[2]]
                    plan.append((f"{base}.{e}.{part}_proj.weight", name, part, e, sh, dtype))
        else:
            plan.append((hub_name(name), name, None, None, shape, torch.float32 if keep_fp32(name) else dtype))
    return plan


@contextlib.contextmanager
def swap_turn(out):
    """One export at a time swaps its folder in for out: an flock on the folder that holds out, for two renames
    (a filesystem without flock: unguarded, as before)."""
    fd = os.open(os.path.dirname(os.path.abspath(out)), os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)  # (dropped when fd closes, or this process dies)
        yield
    finally:
        os.close(fd)


def export_hf(src, out, dtype_name="bfloat16", max_shard_size="5GB", progress=True):
    check_out(src.dir, out, "hf")
    cfg, dtype = src.cfg, TORCH_DTYPES[dtype_name]
    tok = src.tokenizer()
    limit = parse_size(max_shard_size)
    plan = hf_plan(src, dtype)
    nbytes = lambda p: int(np.prod(p[4])) * torch.tensor([], dtype=p[5]).element_size()
    shards, cur, cur_size = [], [], 0
    for p in plan:  # greedy: a tensor larger than the limit gets a shard of its own
        if cur and cur_size + nbytes(p) > limit:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(p)
        cur_size += nbytes(p)
    shards.append(cur)
    total = sum(nbytes(p) for p in plan)

    tmp = out.rstrip("/") + f".tmp-{container.writer_tag()}"  # (host and pid: clean_stale_outputs)
    old = out.rstrip("/") + f".old-{container.writer_tag()}"  # an earlier export stays whole until the new one is in
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="hf weights", disable=not progress)
        weight_map = {}
        for si, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"

            def fetch(i, shard=shard):
                _, sname, part, e, _, _ = shard[i]
                t = src.get(sname)
                return t if part is None else expert_part(t, part, e)

            write_safetensors(os.path.join(tmp, fname), [(p[0], p[4], p[5]) for p in shard], fetch,
                              metadata={"format": "pt"}, progress=bar)
            weight_map.update({p[0]: fname for p in shard})
        bar.close()
        if len(shards) > 1:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)

        special = {}
        if tok is not None:
            special = dict(bos_token_id=tok.bos_id, eos_token_id=tok.special_ids["<|end|>"], pad_token_id=0)
        hf_cfg = to_hf_config(cfg, dtype=dtype_name, torch_dtype=dtype_name, **special)
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_cfg, f, indent=1)
        gen = {"do_sample": False, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
        if tok is not None:
            stops = [tok.special_ids[t] for t in GENERATION_STOPS]
            gen.update(bos_token_id=tok.bos_id, eos_token_id=stops, pad_token_id=0)
        with open(os.path.join(tmp, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(gen, f, indent=1)
        if tok is not None:
            tj, tc = hf_tokenizer_files(tok, cfg.max_seq_len)
            with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
                json.dump(tj, f, ensure_ascii=False)
            with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
                json.dump(tc, f, indent=1)
            with open(os.path.join(tmp, "special_tokens_map.json"), "w", encoding="utf-8") as f:
                json.dump({"bos_token": "<|bos|>", "eos_token": "<|end|>", "pad_token": PAD_TOKEN}, f, indent=1)
            shutil.copyfile(src.tokenizer_path, os.path.join(tmp, "picaflor_tokenizer.json"))
        else:
            print(f"warning: {src.dir} has no tokenizer.json; the export has no tokenizer (pass --tokenizer FILE)",
                  file=sys.stderr)
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(model_card(src, dtype_name, tok is not None))
        with open(os.path.join(tmp, HF_MARKER), "w", encoding="utf-8") as f:  # what a later --out may replace
            json.dump({"format": "hf", "source": os.path.abspath(src.dir), "dtype": dtype_name}, f, indent=1)
        checkpoint.fsync_tree(tmp)  # on disk before the dir takes the name
        with swap_turn(out):  # another export of out renaming between these two failed (ENOTEMPTY) after its work
            if os.path.exists(out):
                os.replace(out, old)
            os.replace(tmp, out)
        checkpoint.fsync_dir(os.path.dirname(os.path.abspath(out)))
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(old) and not os.path.exists(out):  # (a Ctrl-C between the renames: it was left hidden)
            os.replace(old, out)
        raise
    return {"format": "hf", "out": out, "shards": len(shards), "bytes": total, "tensors": len(plan)}


# ----------------------------------------------------------------------------------------------------------
# GGUF for llama.cpp (arch hy_v3)

def gguf_name(name):
    """picaflor parameter name -> llama.cpp hy_v3 tensor name(s) as [(gguf name, expert part or None)]."""
    fixed = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return [(fixed[name], None)]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if not m:
        raise ExportError(f"{name}: unknown tensor in the checkpoint; it does not belong to a picaflor model: "
                          f"export a checkpoint train.py wrote")
    i, rest = m.groups()
    if rest == "mlp.experts.gate_up_proj":
        return [(f"blk.{i}.ffn_gate_exps.weight", "gate"), (f"blk.{i}.ffn_up_exps.weight", "up")]
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.e_score_correction_bias": "exp_probs_b",
        "mlp.experts.down_proj": "ffn_down_exps.weight",
        "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    }
    if rest not in per_layer:
        raise ExportError(f"{name}: unknown tensor in the checkpoint; it does not belong to a picaflor model: "
                          f"export a checkpoint train.py wrote")
    return [(f"blk.{i}.{per_layer[rest]}", None)]


def gguf_tensor_type(gname, shape, gguf_type):
    import gguf
    T = gguf.GGMLQuantizationType
    if len(shape) == 1 or "ffn_gate_inp" in gname:
        return T.F32
    want = {"f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}[gguf_type]
    if want == T.Q4_0 and gname in ("token_embd.weight", "output.weight"):
        want = T.Q8_0
    if want in (T.Q8_0, T.Q4_0) and shape[-1] % 32:
        want = T.F16  # quant blocks are 32 values along a row
    return want


def gguf_vocab(tok, vocab_size):
    """tokens, token types, merges for tokenizer.ggml.model "gpt2"; padded to the model's vocab_size."""
    import gguf
    TT = gguf.TokenType
    vocab, merges = bpe_vocab_and_merges(tok)
    by_id = {i: s for s, i in vocab.items()}
    specials = {i: s for s, i in tok.special_ids.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i]); types.append(TT.NORMAL)
        elif i in specials:
            tokens.append(specials[i]); types.append(TT.CONTROL)
        elif i == 0:
            tokens.append(PAD_TOKEN); types.append(TT.CONTROL)
        else:
            tokens.append(f"[PAD{i}]"); types.append(TT.UNUSED)
    return tokens, types, [f"{l} {r}" for l, r in merges]


def export_gguf(src, out, gguf_type="f16", progress=True):
    import gguf
    check_out(src.dir, out, "gguf")
    cfg = src.cfg
    tok = src.tokenizer()
    if tok is None:
        raise ExportError(f"{src.dir}: no tokenizer.json in the checkpoint, and GGUF embeds the tokenizer; "
                          f"pass --tokenizer FILE")
    plan = []  # (gguf name, source name, expert part, ggml type, numpy-order shape)
    for name in src.names:
        if name.endswith("load_accum"):
            continue
        shape = src.shape(name)
        for gname, part in gguf_name(name):
            sh = [shape[0], shape[1] // 2, shape[2]] if part else shape
            plan.append((gname, name, part, gguf_tensor_type(gname, sh, gguf_type), sh))

    T = gguf.GGMLQuantizationType
    asked = {"q8_0": T.Q8_0, "q4_0": T.Q4_0}.get(gguf_type)
    kept = [(g, sh) for g, _, _, qtype, sh in plan if asked is not None and qtype == T.F16]
    if kept:  # (d_model 200 at q4_0: 31 of 38 matrices stayed f16, the file f16's size, and the report said q4_0)
        share = sum(int(np.prod(sh)) for _, sh in kept) / sum(int(np.prod(sh)) for *_, sh in plan)
        print(f"WARNING: --gguf-type {gguf_type}: {len(kept)} weight tensors ({share:.0%} of the weights) stay f16: "
              f"their rows ({', '.join(map(str, sorted({sh[-1] for _, sh in kept})))} wide) are no multiple of "
              f"32, the quant block; d_model, dense_ffn and expert_ffn multiples of 32 avoid it", file=sys.stderr)
    if not 1 <= cfg.n_experts <= 512 or cfg.top_k > cfg.n_experts:  # llama.cpp's loader asserts these, and aborts
        raise ExportError(f"{src.dir}: n_experts={cfg.n_experts}, top_k={cfg.top_k}: llama.cpp's hy_v3 loads 1-512 "
                          f"experts with top_k <= n_experts; export --format hf for this model")
    if cfg.max_seq_len >= 2 ** 32:  # (a struct.error traceback half-way through the header)
        raise ExportError(f"{src.dir}: max_seq_len={cfg.max_seq_len} does not fit GGUF's 32-bit context_length; "
                          f"export --format hf for this model")
    tmp = f"{out}.tmp-{container.writer_tag()}"
    w = gguf.GGUFWriter(tmp, arch="hy_v3")
    try:
        w.add_name(os.path.basename(os.path.normpath(out)).rsplit(".", 1)[0])
        w.add_string(GGUF_MARKER, os.path.abspath(src.dir))  # a later --out may replace this file, not another GGUF
        w.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                         "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[gguf_type])
        w.add_vocab_size(cfg.vocab_size)
        w.add_context_length(cfg.max_seq_len)
        w.add_embedding_length(cfg.d_model)
        w.add_block_count(cfg.n_layer)
        w.add_feed_forward_length(cfg.dense_ffn)
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(cfg.n_kv_head)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(cfg.head_dim)  # hy_v3 needs n_rot == head_dim (full NEOX RoPE)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_expert_count(cfg.n_experts)
        w.add_expert_used_count(cfg.top_k)
        w.add_expert_shared_count(cfg.n_shared)
        w.add_expert_feed_forward_length(cfg.expert_ffn)
        w.add_expert_shared_feed_forward_length(cfg.n_shared * cfg.expert_ffn)
        w.add_leading_dense_block_count(cfg.n_dense_layers)
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(float(cfg.route_scale))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        tokens, types, merges = gguf_vocab(tok, cfg.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tok.bos_id)
        w.add_eos_token_id(tok.special_ids["<|end|>"])
        w.add_eot_token_id(tok.special_ids["<|end|>"])
        # every special ends generation, as in the HF export's generation_config and chat.py. llama.cpp's
        # end-of-generation set is eos, eot, eom and the three FIM ids pad/rep/sep (llama-vocab.cpp), so bos rides
        # as eom and the turn openers as FIM ids: without fim_pre/suf/mid no infill uses them
        w.add_eom_token_id(tok.bos_id)
        for key, name in ((gguf.Keys.Tokenizer.FIM_PAD_ID, "<|user|>"), (gguf.Keys.Tokenizer.FIM_REP_ID, "<|assistant|>"),
                          (gguf.Keys.Tokenizer.FIM_SEP_ID, "<|system|>")):
            w.add_uint32(key, tok.special_ids[name])
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_chat_template(GGUF_CHAT_TEMPLATE)

        total = 0
        for gname, _, _, qtype, sh in plan:  # pass 1: tensor infos only, no data read
            bshape = gguf.quant_shape_to_byte_shape(tuple(sh), qtype)
            nb = int(np.prod(bshape))
            w.add_tensor_info(gname, bshape, np.dtype(np.uint8), nb, raw_dtype=qtype)
            total += nb
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"gguf {gguf_type}", disable=not progress)
        for gname, sname, part, qtype, sh in plan:  # pass 2: data, one tensor at a time
            t = src.get(sname)
            if part:
                half = t.shape[1] // 2
                t = t[:, :half] if part == "gate" else t[:, half:]
            # f16 holds each value, q8_0 / q4_0 a float16 scale per block (absmax / 127, absmax / 8): an Inf scale
            # made the block Inf and NaN, silently
            limit = {T.F16: 65504, T.Q8_0: 65504 * 127, T.Q4_0: 65504 * 8}.get(qtype)
            if limit and t.numel() and t.float().abs().max() > limit:
                what = "float16's range" if qtype == T.F16 else f"{qtype.name.lower()}'s float16 block scales"
                raise ExportError(f"{sname}: values beyond {what} (+-{limit}) would be Inf in the GGUF; export "
                                  f"with --gguf-type bf16" + (" (or q8_0)" if qtype == T.F16 else ""))
            data = gguf.quants.quantize(t.float().contiguous().numpy(), qtype)
            data = np.ascontiguousarray(data).view(np.uint8)
            w.write_tensor_data(data)
            bar.update(data.nbytes)
        bar.close()
        w.close()
        fd = os.open(tmp, os.O_RDONLY)  # on disk before it takes the name: GGUF has no checksum to catch a torn file
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out)
        checkpoint.fsync_dir(os.path.dirname(os.path.abspath(out)))
    except BaseException:
        try:
            w.close()
        except Exception:
            pass
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return {"format": "gguf", "out": out, "type": gguf_type, "bytes": os.path.getsize(out), "tensors": len(plan),
            "f16_fallback": len(kept)}


# ----------------------------------------------------------------------------------------------------------
# int4 streaming container (format and reader: container.py)

def export_int4(src, out, group_size=None, embed_bits=8, progress=True):
    check_out(src.dir, out, "int4")
    kw = {} if group_size is None else {"group_size": group_size}
    try:
        source = container.CheckpointSource(src.dir)
        src.tokenizer()  # checks it fits the model
        # the tokenizer the container embeds: --tokenizer when given (it was ignored), else the checkpoint's
        # (newline="": its exact text, so its sha256 is the manifest's; CRLF became LF, and the checkpoint's own
        # tokenizer.json no longer matched the container's)
        source.tokenizer_json = (open(src.tokenizer_path, encoding="utf-8", newline="").read() if src.tokenizer_path
                                 else None)
        if source.tokenizer_json is None:  # (as the HF export warns; stream_infer then takes prompts as token ids)
            print(f"warning: {src.dir} has no tokenizer.json; the container has no tokenizer (pass --tokenizer FILE)",
                  file=sys.stderr)
        report = container.write_container(src.dir, out, embed_bits=embed_bits, progress=progress, source=source, **kw)
    except container.ContainerError as e:
        raise ExportError(str(e))
    return {"format": "int4", "out": out, **(report or {})}


HF_MARKER = "picaflor_export.json"
HF_FILES = re.compile(r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|picaflor_tokenizer|"
                      r"picaflor_export)\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
                      r"README\.md")
GGUF_MARKER = "picaflor.export"


def foreign_files(path):
    """Why the folder at path is not an earlier export_hf (its marker file, and only files it writes), or None.
    A downloaded HYV3 model has the same names (config.json, model-0000N-of-...): the marker tells them apart."""
    try:
        names = os.listdir(path)
    except OSError as e:
        return f"cannot be listed ({e.strerror})"
    if HF_MARKER not in names:
        return f"has no {HF_MARKER}, so it is not an earlier picaflor export"
    other = sorted(n for n in names if not HF_FILES.fullmatch(n))
    return f"holds files an export does not write ({', '.join(other[:3])})" if other else None


def is_hf_export(path):
    return os.path.isdir(path) and foreign_files(path) is None


def is_gguf_export(path):
    """A GGUF file export_gguf wrote (its picaflor.export key); any other GGUF (someone's 70B model) is not."""
    import gguf
    try:
        return GGUF_MARKER in gguf.GGUFReader(path, "r").fields
    except Exception:  # not parseable as GGUF at all
        return False


def clean_stale_outputs(out):
    """What a killed export of out left beside it (OUT.tmp-HOST-PID, OUT.old-HOST-PID, container.writer_tag's names,
    of this host whose process is gone): temp output is removed (GBs at nano size, silently), and an earlier export
    set aside just before the kill is put back when out is missing. Another host's (a shared filesystem) is left,
    with a note: its pid says nothing here, and its export may be running. Nothing else is touched: a user's own
    OUT.tmp123 or OUT.tmp-2 (the tag-less names of older exports too) is no proof of a writer of ours."""
    parent, base = os.path.dirname(os.path.abspath(out)), os.path.basename(os.path.abspath(out))
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return
    here = container.writer_tag().rsplit("-", 1)[0]
    for name in names:
        m = re.fullmatch(re.escape(base) + r"\.(tmp-|old-)([A-Za-z0-9._-]+)-(\d+)", name)
        if not m:
            continue
        path = os.path.join(parent, name)
        if m.group(2) != here:
            print(f"warning: {path}: left by an export on host {m.group(2)}, or still being written there; remove it "
                  f"once no export of {out} runs there", file=sys.stderr)
            continue
        if checkpoint.pid_alive(int(m.group(3))):
            continue
        if m.group(1) == "old-" and not os.path.exists(out):
            os.replace(path, out)
            print(f"warning: {path}: an earlier export set aside by a killed export; put back as {out}", file=sys.stderr)
        else:
            (shutil.rmtree if os.path.isdir(path) else os.remove)(path)
            print(f"warning: {path}: left by a killed export; removed", file=sys.stderr)


def check_out(src_dir, out, fmt):
    """--out never overwrites the source or anything but an earlier export of the same format: `--format hf
    --out RUN_DIR` used to delete the run, checkpoints and all (a folder is replaced whole)."""
    clean_stale_outputs(out)
    o, s = os.path.realpath(out), os.path.realpath(src_dir)
    if o == s or s.startswith(o.rstrip(os.sep) + os.sep) or o.startswith(s + os.sep):
        raise ExportError(f"{out}: is, holds or lies inside the source {src_dir}; pass an --out elsewhere")
    if fmt == "hf" and os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)) and not is_hf_export(out):
        why = foreign_files(out) if os.path.isdir(out) else "is a file"
        raise ExportError(f"{out}: exists and {why} (only an earlier export is replaced, whole); pass a new --out, "
                          f"or move it yourself")
    if fmt != "hf" and os.path.isdir(out):
        raise ExportError(f"{out}: is a folder; --format {fmt} writes one file (e.g. --out {os.path.join(out, 'model.' + ('gguf' if fmt == 'gguf' else 'pcf4'))})")
    magic = container.MAGIC if fmt == "int4" else b"GGUF"
    if fmt != "hf" and os.path.exists(out):  # a run's LATEST, another checkpoint's weights: not ours to replace
        try:
            head = open(out, "rb").read(len(magic))
        except OSError as e:
            raise ExportError(f"{out}: cannot be read ({e.strerror}); pass another --out")
        if head != magic or (fmt == "gguf" and not is_gguf_export(out)):
            raise ExportError(f"{out}: exists and is not an earlier picaflor {fmt} export (only such a file is "
                              f"replaced); pass a new --out, or move it yourself")


def main(argv=None):
    ap = argparse.ArgumentParser(description="Export a picaflor checkpoint: int4 streaming container, Hugging Face "
                                             "HYV3ForCausalLM directory, or llama.cpp GGUF (hy_v3).")
    ap.add_argument("ckpt", help="checkpoint dir (step_NNNNNNN/) or run dir (uses its LATEST); for --format gguf "
                                 "also an int4 container (its dequantized weights)")
    ap.add_argument("--format", required=True, choices=["int4", "hf", "gguf"])
    ap.add_argument("--out", required=True, help="output file (int4, gguf) or directory (hf)")
    ap.add_argument("--dtype", default=None, choices=list(TORCH_DTYPES), help="hf: weight dtype (bfloat16)")
    ap.add_argument("--max-shard-size", default=None, help="hf: split model.safetensors above this size (5GB)")
    ap.add_argument("--gguf-type", default=None, choices=["f16", "bf16", "q8_0", "q4_0"], help="gguf: weight type (f16)")
    ap.add_argument("--group-size", type=int, default=None, help="int4: quantization group size (container default)")
    ap.add_argument("--embed-bits", type=int, default=None, choices=[4, 8], help="int4: embeddings / lm_head bits (8)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer file (or a corpus / checkpoint folder holding one) for a checkpoint that has none")
    ap.add_argument("--force-tokenizer", action="store_true",
                    help="let --tokenizer replace a different tokenizer the checkpoint carries (its answers then "
                         "decode with the new one)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    for flag, fmt in (("dtype", "hf"), ("max_shard_size", "hf"), ("gguf_type", "gguf"), ("group_size", "int4"),
                      ("embed_bits", "int4")):  # (ignored without a word: --format hf --gguf-type q4_0 wrote bf16)
        if getattr(args, flag) is not None and args.format != fmt:
            ap.error(f"--{flag.replace('_', '-')} is for --format {fmt}, not {args.format}")
    if args.force_tokenizer and not args.tokenizer:  # (nothing to force: the checkpoint's own was exported)
        ap.error("--force-tokenizer goes with --tokenizer FILE (the tokenizer to export instead of the checkpoint's)")
    if args.group_size is not None and (args.group_size < 2 or args.group_size % 2):  # (it named the output file)
        ap.error(f"--group-size {args.group_size}: an even count of at least 2 (the container's default is 64)")
    args.dtype, args.max_shard_size = args.dtype or "bfloat16", args.max_shard_size or "5GB"
    args.gguf_type, args.embed_bits = args.gguf_type or "f16", args.embed_bits or 8
    args.out = args.out.rstrip("/") or "/"  # x.pcf4/: the temp file went inside a folder that does not exist
    progress = not args.no_progress
    try:
        parent = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(parent):
            raise ExportError(f"{args.out}: directory {parent} does not exist; create it or choose another --out")
        if is_container(args.ckpt):  # re-export of an int4 container: GGUF only (values are the int4 ones)
            if args.format != "gguf":
                raise ExportError(f"{args.ckpt}: an int4 container can only be re-exported as --format gguf; "
                                  f"export --format {args.format} from the training checkpoint")
            src = ContainerSource(args.ckpt, args.tokenizer, args.force_tokenizer)
        else:
            src = Source(args.ckpt, args.tokenizer, args.force_tokenizer)
        if args.format == "hf":
            rep = export_hf(src, args.out, args.dtype, args.max_shard_size, progress)
        elif args.format == "gguf":
            rep = export_gguf(src, args.out, args.gguf_type, progress)
        else:
            rep = export_int4(src, args.out, args.group_size, args.embed_bits, progress)
    except (checkpoint.CheckpointError, ExportError, container.ContainerError) as e:
        sys.exit(f"error: {e}")
    except ValueError as e:  # tokenizer files and configs report bad input as ValueError, one line
        sys.exit(f"error: {str(e).splitlines()[0]}")
    except ImportError as e:
        sys.exit(f"error: {e}; --format {args.format} needs it (pip install -r requirements.txt)")
    except OSError as e:  # a read-only or another user's --out: its line said no fix
        denied_out = e.errno in checkpoint.DENIED_ERRNOS and str(e.filename or args.out).startswith(
            args.out)  # (a checkpoint it cannot read: another --out is no fix)
        fix = "; pass an --out you can write" if denied_out else ""
        sys.exit(f"error: {checkpoint.os_error_line(e, args.out)}{fix}")
    except KeyboardInterrupt:  # the temp output is removed by each writer; --out is as it was
        print(f"interrupted; {args.out} is as it was before this export", file=sys.stderr)
        sys.exit(130)  # (as every other script's Ctrl-C; sys.exit(text) exited 1, as an error does)
    print(json.dumps(rep, default=str))
    print(next_step(args.format, args.out), file=sys.stderr)  # (stderr: stdout stays the JSON a pipe parses)


def next_step(fmt, out):
    """The line naming how to run what was written (the report alone left a new user to find it in the README)."""
    q = shlex.quote(out)
    if fmt == "int4":
        return (f"next: python stream_infer.py {q} --prompt 'Once upon a time' --max-new-tokens 64 "
                f"(--ram-budget 1G bounds its memory; --chat for a chat fine-tune)")
    if fmt == "hf":
        return f"next: transformers' AutoModelForCausalLM.from_pretrained({out!r}) and AutoTokenizer load it"
    return f"next: llama-cli -m {q} --jinja (llama.cpp; --jinja applies the GGUF's own chat template)"


if __name__ == "__main__":
    main()
