"""
Evaluation with lm-evaluation-harness's task definitions and default shots (gsm8k 5-shot, the others zero-shot), one
scoring path for every model kind.

    python eval.py MODEL --tasks lambada_openai,piqa,winogrande,arc_easy,arc_challenge,openbookqa,hellaswag
    python eval.py MODEL --tasks piqa --limit 200 --out results/mymodel
    python eval.py MODEL --tasks counting,gsm8k,passkey            # generation tasks (greedy; gsm8k 5-shot)
    python eval.py MODEL --tasks gsm8k --num-fewshot 0             # gsm8k zero-shot (eval.py before --num-fewshot)
    python eval.py --compare results/a/summary.json results/b/summary.json
    python eval.py MODEL --tasks piqa --experts-per-token 1 --out results/top1   # routed as top-1 serving routes

--experts-per-token K scores an MoE model with K routed experts per token (stream_infer.py's and chat.py's serve-time
setting; default: the model's own top_k); summary.json and --compare's columns say the K each was scored at.

MODEL is one of
- a picaflor checkpoint dir `step_NNNNNNN/` or a run dir (its LATEST); tokenizer = the checkpoint's tokenizer.json
  (or --tokenizer). Every encoded text starts with <|bos|> (picaflor documents start with it in training;
  the harness's equivalent is HFLM's add_bos_token=True); an empty context is the <|bos|> token alone.
- an int4 container file (container.py): its dequantised weights in model.Picaflor, batched like a checkpoint
  (int4 -> float is exact, so this scores the int4 model), or with --int4-engine through stream_infer.load's
  Engine (the served kernels and expert streaming, one request at a time; --ram-budget bounds it, as
  stream_infer.py's, for a container larger than the memory);
- a Hugging Face transformers model dir or Hub repo id (the baselines: EleutherAI/pythia-410m,
  cerebras/Cerebras-GPT-256M, HuggingFaceTB/SmolLM2-360M), tokenised as lm-eval's HFLM does (the tokenizer's
  own special-token default, no BOS added when the text already starts with it; empty context = BOS, else EOS;
  which of these a model got is said on stderr and in summary.json: bos_added, empty_context_token).

Tasks (lm-evaluation-harness v0.4.x definitions, checked against the installed lm-eval 0.4.13 task YAMLs):
  lambada_openai (acc = greedy match, perplexity), piqa, winogrande (acc), arc_easy, arc_challenge, openbookqa,
  hellaswag (acc, acc_norm); generation (greedy): gsm8k (5-shot, strict-match and flexible-extract
  exact_match), counting (synthetic, seeded), passkey (synthetic retrieval at 4K, 8K, ... up to the model's
  context, reported per length as task "passkey@LEN").
Scoring as the harness: request (context, " " + choice); continuation tokens = enc(ctx + cont)[len(enc(ctx)):],
with the context's trailing spaces moved into the continuation; inputs longer than the model's context are cut
on the left (a note on stderr counts them per task, as the harness warns); acc = argmax of summed log-likelihood
(first index on ties; a choice repeated within a question is scored once, as the harness does, so it ties exactly),
acc_norm = argmax of log-likelihood / len(choice in characters, not bytes: the harness's acc_bytes is another
metric); stderr of a mean = sample std / sqrt(n) (none below two
examples; still given at --bootstrap-iters 0, where the harness gives none); lambada perplexity = exp(-mean ll) with
the harness's bootstrap stderr (100000 resamples, chunk i drawn by random.Random(i), reproduced here with numpy).
Shots (--num-fewshot N, default the harness's per task: its gsm8k YAML's 5, 0 for every other task here): the prompt
strings the harness builds for the same split, seed and N. Its default sampler draws, for each scored example in order,
random.Random(--seed, the harness's fewshot_random_seed 1234).sample(the train split, N); each shot is
"Question: ...\nAnswer:" + " " + its answer + "\n\n" (target and fewshot delimiters), then the example's own prompt
(gsm8k has no description). N > 0 is refused for the other tasks (eval.py builds only their zero-shot prompts).

Speed (the scoring is exact, these only change what is computed together):
- requests sorted by length and batched under a token budget, right-padded (causal models: padding after a
  sequence cannot change it);
- a question's choices that share one context run the context once; its KV cache is repeated per choice and
  only the continuations run on it (HF models: contexts of similar length left-padded with an attention mask
  and position ids; picaflor, whose forward takes no mask: contexts of one token length per batch);
- the output head and the fp32 log-softmax run only on positions whose log-likelihood is read (the harness
  runs them on every position, in the model's dtype).
bench/eval_speed.py measures this against lm-eval's HFLM on the same model and data, with identical metrics.

Data: downloaded from the Hub with huggingface_hub (the dataset's auto-converted parquet branch
`refs/convert/parquet`, else parquet/jsonl files on main) into --cache-dir, read from there when the Hub cannot be
reached later (offline, with a warning; one quick request finds that out, as it does for a Hub model id, which then
loads from the Hugging Face cache); or --data-dir DIR with one file per task in the Hub dataset's own schema:
DIR/<task>.jsonl (one JSON object per line), DIR/<task>.json (a list), DIR/<task>.parquet, or a folder DIR/<task>/
of such files (read in name order; where their names name splits, as a Hub snapshot's train-*, validation-*,
test-* do, only the files of the split the task scores on the Hub). Few-shot examples come from the train split:
downloaded likewise, or DIR/<task>/ files whose names name it (DIR/gsm8k/train.jsonl; the Hub's 7473 rows).
A choices / endings field that is not a list of strings (a list written as text) is refused as not the schema.

Generation never inherits sampling settings from a model: decoding is greedy with no repetition / presence /
frequency penalty, by eval.py's own loop; if the model ships such settings they are printed as a loud warning
and recorded in summary.json as ignored. A stop string (the task's `until`) is looked for in the text decoded with
special tokens kept, as the harness's stop check does: "<|im_end|>" stops an HF model whose tokenizer has it.

Outputs (--out DIR): <task>.jsonl per example (requests, per-choice log-likelihoods, prediction, gold, scores),
summary.json {"results": {task: {metric, metric_stderr, "n"}}, "model", "harness_version", "seed", "dtype",
"num_fewshot": {task: N}, "examples": {task: sha256 of its prompts}, "sampling", "tasks_done", ...} and results.md (a
markdown table), both rewritten after every task so a failure later keeps the finished ones. An --out that already
holds a summary of the same model scored the same way keeps its other tasks' results (rerun a failed task alone), and
a task asked again keeps its own until it is scored; one of another model or settings is refused. "The same model":
model_source (a run dir's step scored, a Hub id's commit), model_weights (a checkpoint's MANIFEST.json hashes, else
its files' sizes and times: a rollback's new step_N or an export over the same path is another model) and the
tokenizer's sha256 (--tokenizer).
A task says how far it is on stderr once a minute (PROGRESS_EVERY_S) until it is done.
A diverged model's perplexity is inf, not an overflow (a NaN log-likelihood: nan, as the harness's), with no
stderr (the harness's nan or a crash). --compare prints several summaries side by side and marks
each difference from the first column as within noise (~, |diff| <= 2 * sqrt(se_a^2 + se_b^2)) or not (*), and not
at all (!) between other numbers of examples, other examples (summary.json's "examples"), shots or generation caps
(--max-gen-toks).
"""

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import random
import re
import sys
import time

# As stream_infer.py (kernels.openmp_kernels()): where the int4 kernels run on their own pool (macOS; PICAFLOR_OPENMP=0),
# torch's OpenMP threads must sleep at once, not spin on the cores the pool needs. libomp/libgomp read it at import.
if __name__ == "__main__" and (sys.platform == "darwin" or os.environ.get("PICAFLOR_OPENMP", "1") == "0"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import checkpoint
import container as C
import eval_tasks as ET
import model as picaflor
from eval_tasks import EvalError

HARNESS_VERSION = "lm-evaluation-harness v0.4.x task definitions (checked against lm-eval 0.4.13)"
BOOTSTRAP_ITERS = 100000  # the harness's default for bootstrapped stderrs (perplexity)
# a task says how far it is this often on stderr (hellaswag's 10k examples on a CPU, an int4 engine's one request
# at a time: hours that printed nothing)
PROGRESS_EVERY_S = 60
# generation settings a model may ship that change greedy outputs, with their neutral values
NEUTRAL_SETTINGS = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "length_penalty": 1.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0, "no_repeat_ngram_size": 0, "do_sample": False}


# ----------------------------------------------------------------------------------------------------------
# models: each kind gives encode/decode, prefix/stop ids, max_length and either run/head (batched forward
# returning hidden states, output head on chosen positions, KV caches) or an engine's loglikelihood/generate

class PicaflorModel:
    kind = "picaflor"
    pad_mask = False  # its forward takes no attention mask: batches of shared contexts have one length

    def __init__(self, model, tok, name, device):
        self.model, self.tok, self.name, self.device = model, tok, name, device
        self.dtype = str(model.embed_tokens.weight.dtype).replace("torch.", "")
        self.max_length = model.cfg.max_seq_len
        self.prefix_id = tok.bos_id
        # every special, as the HF export's generation_config and chat.py (bos and <|end|> alone glued a turn the
        # model went on into, <|user|> ..., onto its answer, and scored it otherwise than its export)
        self.stop_ids = set(tok.special_ids.values())
        self.generation_settings = {}

    def encode(self, text, add_special_tokens=None):
        ids = self.tok.encode(text)
        return ids if add_special_tokens is False else [self.tok.bos_id] + ids

    def decode(self, ids):
        """Specials and ids no text maps to (reserved 0, unused top ids) are dropped and the rest decoded as one byte
        string, as the HF export's tokenizer decodes (skip_special_tokens; ids outside its vocab are skipped): a
        U+FFFD for them (chat.py's and stream_infer's decode_generated) split "12<0>13" in two, and counting scored
        the checkpoint and its int4 container otherwise than their export."""
        return self.tok.decode([i for i in ids if 0 < i < self.tok.bos_id])  # (ids 1..bos_id - 1: bytes and merges)

    def run(self, ids, cache=None):
        """Hidden states (B, T, D) after the final norm: the model's forward with its lm_head set aside."""
        head, self.model.lm_head = self.model.lm_head, nn.Identity()
        try:
            return self.model(ids, cache=cache)
        finally:
            self.model.lm_head = head

    def head(self, h):
        return self.model.lm_head(h)

    def new_cache(self, batch, max_len):
        return picaflor.KVCache(self.model.cfg, batch, max_len, self.device, self.model.embed_tokens.weight.dtype)

    def repeat_cache(self, cache, index):
        cache.k = [k.index_select(0, index) for k in cache.k]
        cache.v = [v.index_select(0, index) for v in cache.v]
        return cache


# HF model types whose CausalLM logits are exactly lm_head(base_model(...)); others run the full forward
HF_SPLIT_HEAD_TYPES = {"gpt2", "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "hy_v3", "olmo", "olmo2", "phi3",
                       "gptj", "opt"}


class HFModel:
    kind = "hf"
    pad_mask = True  # takes attention_mask and position_ids: contexts of different lengths batch left-padded

    def __init__(self, model, tok, name, device):
        self.model, self.tok, self.name, self.device = model, tok, name, device
        self.dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        cfg = model.config
        seq_cfg = getattr(cfg, "text_config", None) or cfg  # Gemma3-like composite: the text model's (lm-eval)
        self.max_length = next((int(getattr(seq_cfg, a)) for a in ("n_positions", "max_position_embeddings", "n_ctx")
                                if getattr(seq_cfg, a, None) is not None), None)
        if self.max_length is None:  # the harness's resolve_max_length order, then its default 2048
            mml = getattr(tok, "model_max_length", None)
            self.max_length = int(mml) if mml is not None and mml < 1e29 else 2048
        self.prefix_id = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        self.bos_text = tok.decode(self.prefix_id) if self.prefix_id is not None else None
        # the tokenizer's eos and the generation config's (export.py lists every special, GENERATION_STOPS; HF's
        # generate stops at each)
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        gen_eos = gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]
        self.stop_ids = ({tok.eos_token_id} | set(gen_eos)) - {None}
        self.split_head = getattr(cfg, "model_type", None) in HF_SPLIT_HEAD_TYPES
        self.generation_settings = shipped_penalties(getattr(model, "generation_config", None))

    def encode(self, text, add_special_tokens=None):
        # lm-eval HFLM.tok_encode: the tokenizer's default, except no specials when text starts with BOS
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and self.bos_text and text.startswith(self.bos_text):
            kw = {"add_special_tokens": False}
        return self.tok.encode(text, **kw)

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def stop_text(self, ids):
        # the harness's stop check (MultiTokenEOSCriteria) keeps special tokens: a stop string "<|im_end|>" stops
        return self.tok.decode(ids, skip_special_tokens=False)

    def run(self, ids, cache=None, mask=None, positions=None):
        kw = dict(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=cache is not None)
        return self.model.base_model(**kw).last_hidden_state if self.split_head else self.model(**kw).logits

    def head(self, h):
        return self.model.get_output_embeddings()(h) if self.split_head else h

    def new_cache(self, batch, max_len):
        from transformers import DynamicCache
        return DynamicCache()

    def repeat_cache(self, cache, index):
        cache.reorder_cache(index)
        return cache


class EngineModel:
    """An int4 container served by stream_infer's Engine: per-request loglikelihood and greedy generate."""
    kind = "int4 (stream_infer engine)"

    def __init__(self, engine, tok, name):
        self.engine, self.tok, self.name = engine, tok, name
        self.dtype = "int4"
        self.max_length = int(getattr(engine, "context", None) or engine.max_seq_len)
        self.prefix_id = tok.bos_id
        self.stop_ids = set(tok.special_ids.values())  # as PicaflorModel's
        self.generation_settings = {}

    encode = PicaflorModel.encode
    decode = PicaflorModel.decode


def shipped_penalties(gen_cfg):
    """Sampling settings a model ships (generation_config) that would change greedy scores if inherited."""
    if gen_cfg is None:
        return {}
    d = gen_cfg if isinstance(gen_cfg, dict) else gen_cfg.to_dict()
    return {k: d[k] for k, v in NEUTRAL_SETTINGS.items() if d.get(k) is not None and d[k] != v}


def warn_shipped_settings(lm):
    if lm.generation_settings:
        bar = "!" * 100
        print(f"{bar}\nWARNING: {lm.name} ships generation settings {lm.generation_settings}.\n"
              f"eval.py IGNORES them: generation is greedy with no repetition/presence/frequency penalty, the same "
              f"for every model.\nA model exported with these settings will generate differently elsewhere "
              f"(e.g. in lm-eval with model defaults): remove them from its generation_config.json.\n{bar}",
              file=sys.stderr, flush=True)


def bos_convention(lm):
    """Whether BOS goes before every encoded text and the token an empty context is: scores move with both, and
    published numbers differ in them (for HF models, lm-eval HFLM's defaults: the tokenizer's own; BOS, else EOS)."""
    pid = lm.prefix_id
    token = "<|bos|>" if lm.kind != "hf" else lm.tok.convert_ids_to_tokens(pid) if pid is not None else None
    return {"bos_added": lm.encode("a")[:1] == [pid], "empty_context_token": token}


def resolve_dtype(name, device):
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_picaflor_tokenizer(path, fallback_dir):
    import tokenizer
    path = path or os.path.join(fallback_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise EvalError(f"{path}: no tokenizer file; pass --tokenizer PATH (the corpus's tokenizer.json)")
    try:
        return tokenizer.Tokenizer.load(path)
    except ValueError as e:  # its message already names the file and the fix
        raise EvalError(str(e)) from None


def check_vocab(tok, model_vocab, where):
    """Its top ids would index past the embedding: an IndexError traceback (int4), or an error mid-scoring."""
    if tok.vocab_size > model_vocab:
        raise EvalError(f"{where}: tokenizer vocab {tok.vocab_size} > model vocab {model_vocab}; wrong tokenizer for "
                        f"this model (pass the one it was trained with: --tokenizer)")


def sha256_text(text):
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def weights_identity(path):
    """Which weights a local model path held when it was scored: a picaflor checkpoint's MANIFEST.json file hashes,
    else its files' sizes and modification times (an int4 container or HF dir exported again over the same path).
    A run dir's rollback trains a new step_NNNNNNN under an old name: the path alone mixed two models' results."""
    man = os.path.join(path, "MANIFEST.json")
    if os.path.isfile(man):
        with open(man) as f:
            files = json.load(f)["files"]  # (verified by the load that precedes this)
        return "manifest " + sha256_text(json.dumps({n: m["sha256"] for n, m in files.items()}, sort_keys=True))
    names = [path] if os.path.isfile(path) else sorted(os.path.join(path, n) for n in os.listdir(path))
    own = ("summary.json", "results.md", ".writable")  # (an --out inside the model dir: its own files are not weights)
    stats = [(os.path.basename(n), st.st_size, st.st_mtime_ns) for n in names
             if os.path.isfile(n) and not n.endswith(own + (".jsonl",)) and (st := os.stat(n))]
    return "files " + sha256_text(json.dumps(stats))


def load_model(spec, device, dtype_name, tokenizer_path=None, int4_engine=False, ram_budget=None,
               experts_per_token=None):
    """MODEL string -> one of the LM kinds above. One-line EvalError when it is none of them. lm.weights: which
    weights a local path held (weights_identity); a Hub id's commit is in lm.source. experts_per_token: routed
    experts per token (None: the model's own top_k); lm.experts_per_token / lm.own_experts_per_token: the k it routes
    with and its own (both None for a model without MoE layers)."""
    lm = load_model_kind(spec, device, dtype_name, tokenizer_path, int4_engine, ram_budget, experts_per_token)
    local = getattr(lm, "source", None) if getattr(lm, "kind", "") == "picaflor" else spec
    lm.weights = weights_identity(local) if local and os.path.exists(local) else None
    return lm


def load_model_kind(spec, device, dtype_name, tokenizer_path=None, int4_engine=False, ram_budget=None,
                    experts_per_token=None):
    dtype, k = resolve_dtype(dtype_name, device), experts_per_token
    if os.path.isdir(spec):
        if os.path.isfile(os.path.join(spec, "config.json")):
            return load_hf(spec, device, dtype, k)
        try:
            ckpt_dir = checkpoint.resolve(spec)
        except checkpoint.CheckpointError as e:
            try:
                run_dir = bool(checkpoint.list_checkpoints(spec))
            except OSError:  # (a dir it may not read: resolve's error says so)
                run_dir = True
            if run_dir:  # a run dir whose every step is damaged: resolve names each cause
                raise EvalError(str(e)) from None
            raise EvalError(f"{spec}: neither a Hugging Face model dir (no config.json) nor a picaflor checkpoint "
                            f"({e}); pass a run dir, step_* dir, int4 container or transformers model dir") from None
        if k is not None:
            try:  # a k above its experts refused before the weights are verified and read (a bad state.json: below)
                with open(os.path.join(ckpt_dir, "state.json")) as f:
                    cfg = picaflor.ModelConfig.from_dict(json.load(f)["model_config"], complete=True)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                cfg = None
            if cfg is not None:
                routed_experts(k, cfg, ckpt_dir)
        tok = load_picaflor_tokenizer(tokenizer_path, ckpt_dir)
        m = picaflor.load_checkpoint(ckpt_dir, device=device, dtype=dtype)
        check_vocab(tok, m.cfg.vocab_size, tokenizer_path or os.path.join(ckpt_dir, "tokenizer.json"))
        lm = PicaflorModel(m, tok, spec, device)
        lm.experts_per_token, lm.own_experts_per_token = routed_experts(k, m.cfg, ckpt_dir)
        if k is not None:
            m.set_top_k(k)
        lm.source = os.path.abspath(ckpt_dir)  # a run dir's LATEST moves on: the step scored, not the run's name
        gc_path = os.path.join(ckpt_dir, "generation_config.json")
        if os.path.isfile(gc_path):
            with open(gc_path) as f:
                lm.generation_settings = shipped_penalties(json.load(f))
        return lm
    if os.path.isfile(spec):
        return load_int4(spec, device, dtype, tokenizer_path, int4_engine, ram_budget, k)
    # owner/name is a Hub repo id, unless its owner is a folder here (out/nope: a mistyped local path, tried on
    # the Hub for ~50 s of retries, then "cannot connect")
    if (re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", spec) and not spec.startswith((".", "/"))
            and not os.path.isdir(spec.split("/")[0])):
        return load_hf(spec, device, dtype, k)
    raise EvalError(f"{spec}: no such file or directory, and not a Hub repo id (owner/name); give a picaflor "
                    f"checkpoint or run dir, an int4 container or a transformers model dir")


def routed_experts(k, cfg, where):
    """(the routed experts per token a picaflor config's model is scored at, its own top_k): k, refused above its
    n_experts, else its own; (None, None) for a model without MoE layers (it routes nothing: any k is that model)."""
    return experts_in_range(k, cfg.n_experts if cfg.n_dense_layers < cfg.n_layer else 0, cfg.top_k, where)


def experts_in_range(k, n_experts, own, where):
    if not n_experts:
        return None, None
    if k is not None and k > n_experts:
        raise EvalError(f"--experts-per-token {k}: {where} has {n_experts} experts per MoE layer; pass 1..{n_experts} "
                        f"(leave it out for its own {own})")
    return (own if k is None else k), own


def hf_experts(cfg):
    """(routed experts per MoE layer, experts per token) of a transformers config; 0 experts without MoE layers. HYV3
    (export.py's) names them num_experts / num_experts_per_tok, and mlp_layer_types says which layers are sparse."""
    n = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    if "sparse" not in (getattr(cfg, "mlp_layer_types", None) or ["sparse"]):
        n = 0
    return n, getattr(cfg, "num_experts_per_tok", None)


def load_hf(spec, device, dtype, experts_per_token=None):
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # keep stderr for our own messages
    # a Hub id offline: transformers retried ~55 s before failing; from the HF cache at once, or one line (its
    # adapter_config.json lookup does not take local_files_only from the model's arguments: ~30 s more)
    offline = not os.path.isdir(spec) and ET.hub_unreachable()
    local = {"local_files_only": bool(offline)}
    k, config, own = experts_per_token, None, None
    try:
        if k is not None:  # set on its config before the weights load (each MoE block reads it when it is built)
            config = AutoConfig.from_pretrained(spec, **local)
            n, own = hf_experts(config)
            if n and own is None:
                raise EvalError(f"--experts-per-token {k}: {spec}'s config.json names no num_experts_per_tok, the "
                                f"setting eval.py changes; leave --experts-per-token out for this model")
            experts_in_range(k, n, own, spec)
            if n:
                config.num_experts_per_tok = k
        tok = AutoTokenizer.from_pretrained(spec, **local)
        model = AutoModelForCausalLM.from_pretrained(spec, config=config, dtype=dtype, adapter_kwargs=local,
                                                     **local).to(device).eval()
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:  # a truncated weights file; shapes
        if offline and isinstance(e, OSError):  # (a file missing from the cache)
            raise EvalError(f"{spec}: cannot reach the Hub ({offline}) and the model is not in the Hugging Face cache; "
                            f"check the network, or give a local transformers model dir") from None
        raise EvalError(f"{spec}: cannot load as a transformers model ({(str(e).splitlines() or [''])[0]}); if its "
                        f"files are damaged, download or export it again, or point at another model") from None
    lm = HFModel(model, tok, spec, device)
    n, k_now = hf_experts(model.config)  # (k itself where it was set)
    lm.experts_per_token, lm.own_experts_per_token = (k_now, own or k_now) if n and k_now else (None, None)
    commit = getattr(model.config, "_commit_hash", None)  # set by transformers for a model from the Hub
    lm.source = os.path.abspath(spec) if os.path.isdir(spec) else f"{spec}@{commit}" if commit else spec
    return lm


def available_memory():
    """MemAvailable in bytes, or None where there is no /proc/meminfo (macOS)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_int4(path, device, dtype, tokenizer_path, use_engine=False, ram_budget=None, experts_per_token=None):
    """An int4 container: its weights dequantised into model.Picaflor (batched, the same path as checkpoints;
    int4 -> float is exact, so this scores the int4 model) or, with use_engine, stream_infer's Engine (the
    kernels and expert streaming a laptop runs; one request at a time)."""
    try:
        import container
    except ImportError:
        raise EvalError(f"{path}: a file, so an int4 container, but this checkout has no container.py to read it; "
                        f"evaluate the checkpoint dir instead") from None
    try:
        c = container.load_container(path)
    except container.ContainerError as e:
        raise EvalError(f"{path}: not a picaflor checkpoint, HF model dir or readable int4 container ({e}); "
                        f"else evaluate its checkpoint dir") from None
    k = experts_per_token
    routed = routed_experts(k, c.config, path)  # (before the weights are dequantised or the engine reads them)
    if tokenizer_path or not getattr(c, "tokenizer_json", None):
        tok = load_picaflor_tokenizer(tokenizer_path, os.path.dirname(os.path.abspath(path)))
    else:
        import tempfile
        with tempfile.TemporaryDirectory() as d:  # the container carries the checkpoint's tokenizer.json
            with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
                f.write(c.tokenizer_json)
            tok = load_picaflor_tokenizer(None, d)
    check_vocab(tok, c.config.vocab_size, tokenizer_path or f"{path}'s tokenizer")  # (a traceback, or a late error)
    if use_engine:
        import stream_infer
        try:
            engine = stream_infer.load(path, ram_budget=ram_budget, device=device, context=c.config.max_seq_len)
        except stream_infer.StreamError as e:
            raise EvalError(str(e)) from None
        if k is not None:  # generation routes with this setting; each loglikelihood request gets lm.experts_per_token
            engine.set_experts_per_token(k)
        lm = EngineModel(engine, tok, path)
        lm.experts_per_token, lm.own_experts_per_token = routed
        return lm
    cfg = c.config
    m = picaflor.meta_model(cfg)
    # the model's fp32 copy and the dequantised state dict are both held while loading: micro's 4 GB container
    # asked for ~58 GB and the OOM killer ended it, without a word, on a laptop the container streams on
    need, avail = 2 * 4 * m.num_params(), available_memory() if str(device) == "cpu" else None
    if avail is not None and need > avail:
        raise EvalError(f"{path}: its weights dequantised take {need / 2**30:.1f} GiB while loading, more than the "
                        f"{avail / 2**30:.1f} GiB available; pass --int4-engine --ram-budget SIZE to score it on "
                        f"stream_infer's int4 kernels, experts streamed")
    m.to_empty(device=device)
    sd = c.dequantized_state_dict()
    missing, unexpected = m.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("load_accum")]
    if missing or unexpected:
        raise EvalError(f"{path}: container tensors do not match its model_config (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}); re-export it from its checkpoint")
    if cfg.tie_embeddings:
        m.lm_head.weight = m.embed_tokens.weight
    for moe in m.moe_layers():
        moe.load_accum.zero_()
    picaflor.to_dtype_keeping_router(m, dtype, sd).eval()
    if k is not None:
        m.set_top_k(k)
    lm = PicaflorModel(m, tok, path, device)
    lm.kind = "int4 (dequantized)"
    lm.experts_per_token, lm.own_experts_per_token = routed
    return lm


# ----------------------------------------------------------------------------------------------------------
# scoring: (context, continuation) strings -> token ids -> (sum log-prob, is_greedy)

def encode_pair(lm, context, continuation, cache):
    """lm-eval TemplateLM.loglikelihood/_encode_pair: trailing spaces move into the continuation; an empty
    context is the prefix token (BOS/EOS) alone, and so is a whitespace-only one (its spaces moved: the harness
    encodes "" to no tokens where the tokenizer adds no BOS (GPT-2's), leaving the first target no position)."""
    if not context.strip():
        cont = lm.encode(context + continuation, add_special_tokens=False)
        return ([lm.prefix_id], cont) if not cont or lm.prefix_id != cont[0] else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    if context not in cache:
        cache[context] = lm.encode(context)
    ctx = cache[context]
    whole = lm.encode(context + continuation)
    return ctx, whole[len(ctx):]


def token_logprobs(lm, h, targets):
    """Output head on the chosen hidden states (N, D) only; (log-prob of each target, is it the argmax)."""
    lps, greedy = [], []
    for s in range(0, h.shape[0], 2048):  # bounded (chunk x vocab) logits
        logits = lm.head(h[s:s + 2048]).float()
        lp = F.log_softmax(logits, dim=-1)
        t = targets[s:s + 2048]
        lps.append(lp.gather(1, t[:, None])[:, 0])
        greedy.append(logits.argmax(dim=-1) == t)
    return torch.cat(lps).double().cpu(), torch.cat(greedy).cpu()


def progress_printer(task, total, unit):
    """A callable(n) that counts n more of total done and, at most every PROGRESS_EVERY_S, says so on stderr."""
    t0 = last = time.time()
    done = 0

    def tick(n=1):
        nonlocal done, last
        done += n
        now = time.time()
        if done < total and now - last >= PROGRESS_EVERY_S:
            last = now
            left = (now - t0) * (total - done) / done
            print(f"{task}: {done:,}/{total:,} {unit} ({100 * done // total}%), {(now - t0) / 60:.1f} min so far, "
                  f"~{left / 60:.1f} min left", file=sys.stderr, flush=True)
    return tick


def score_flat(lm, reqs, out, batch_size, max_batch_tokens, tick=None):
    """reqs: [(index, ctx_ids, cont_ids)]; the harness's input: (ctx + cont)[-(max_length+1):][:-1]."""
    reqs = sorted(reqs, key=lambda r: -(len(r[1]) + len(r[2])))  # longest first, like the harness
    i = 0
    while i < len(reqs):
        width = min(len(reqs[i][1]) + len(reqs[i][2]) - 1, lm.max_length)
        n = max(1, min(batch_size, max_batch_tokens // max(1, width)))
        batch = reqs[i:i + n]
        i += n
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        rows, cols, tgts, counts = [], [], [], []
        for b, (_, ctx, cont) in enumerate(batch):
            inp = (ctx + cont)[-(lm.max_length + 1):][:-1]
            ids[b, :len(inp)] = torch.tensor(inp)
            L = len(cont)
            rows += [b] * L
            cols += range(len(inp) - L, len(inp))
            tgts += cont
            counts.append(L)
        with torch.inference_mode():
            h = lm.run(ids.to(lm.device))
            lp, gr = token_logprobs(lm, h[torch.tensor(rows, device=h.device), torch.tensor(cols, device=h.device)],
                                    torch.tensor(tgts, device=h.device))
        for (idx, _, _), seg_lp, seg_gr in zip(batch, lp.split(counts), gr.split(counts)):
            out[idx] = (float(seg_lp.sum()), bool(seg_gr.all()))
        if tick:
            tick(len(batch))


def shared_prefix_batches(lm, groups, batch_size, max_batch_tokens):
    """Batches of question groups. Models that take a padding mask (HF) get contexts of similar length, left-
    padded; picaflor's forward has no mask, so its batches hold contexts of exactly one length."""
    groups = sorted(groups, key=lambda g: (len(g[0]), max(len(c) for _, c in g[1])))
    batch, rows, width = [], 0, 0
    for g in groups:
        n, w = len(g[1]), len(g[0]) + max(len(c) for _, c in g[1])
        new_len = batch and not lm.pad_mask and len(batch[0][0]) != len(g[0])
        # batch_size counts questions here (their choices share one context row); the token budget bounds the
        # continuation pass, whose KV cache holds every choice's copy of its context
        if batch and (new_len or len(batch) + 1 > batch_size or (rows + n) * max(width, w) > max_batch_tokens):
            yield batch
            batch, rows, width = [], 0, 0
        batch.append(g)
        rows, width = rows + n, max(width, w)
    if batch:
        yield batch


def score_shared_prefix(lm, groups, out, batch_size, max_batch_tokens, tick=None):
    """groups: [(ctx_ids, [(index, cont_ids), ...])] with 2+ continuations of one context. A batch of contexts
    runs once with a KV cache; the cache is repeated per choice and only the continuations (right-padded) run
    on it. The last context position predicts every choice's first token."""
    for batch in shared_prefix_batches(lm, groups, batch_size, max_batch_tokens):
        C = max(len(g[0]) for g in batch)
        Lmax = max(len(c) for _, conts in batch for _, c in conts)
        ctx = torch.zeros(len(batch), C, dtype=torch.long)
        mask = torch.zeros(len(batch), C, dtype=torch.long)
        for b, (c_ids, _) in enumerate(batch):  # left padding: every context ends at position C - 1
            ctx[b, C - len(c_ids):] = torch.tensor(c_ids)
            mask[b, C - len(c_ids):] = 1
        rep = [g for g, (_, conts) in enumerate(batch) for _ in conts]
        flat = [(idx, c) for _, conts in batch for idx, c in conts]
        dev = lm.device
        with torch.inference_mode():
            cache = lm.new_cache(len(batch), C + Lmax - 1)
            kw = {}
            if lm.pad_mask:
                kw = dict(mask=mask.to(dev), positions=(mask.cumsum(1) - 1).clamp(min=0).to(dev))
            h_last = lm.run(ctx.to(dev), cache, **kw)[:, -1]  # (G, D)
            first_lp, first_gr = token_logprobs(lm, h_last[torch.tensor(rep, device=dev)],
                                                torch.tensor([c[0] for _, c in flat], device=dev))
            lp_sum, all_greedy = first_lp.tolist(), first_gr.tolist()
            if Lmax > 1:
                cache = lm.repeat_cache(cache, torch.tensor(rep, device=dev))
                ids = torch.zeros(len(flat), Lmax - 1, dtype=torch.long)
                rows, cols, tgts, counts = [], [], [], []
                for r, (_, c) in enumerate(flat):
                    ids[r, :len(c) - 1] = torch.tensor(c[:-1], dtype=torch.long)
                    rows += [r] * (len(c) - 1)
                    cols += range(len(c) - 1)
                    tgts += c[1:]
                    counts.append(len(c) - 1)
                if lm.pad_mask:
                    ctx_len = mask.sum(1)[rep]
                    # a long context's padding columns (after its short continuation) ran past the last position:
                    # learned position tables (GPT-2, Cerebras-GPT) raised IndexError; padding is never read: clamp
                    pos = (ctx_len[:, None] + torch.arange(Lmax - 1)[None]).clamp(max=lm.max_length - 1)
                    kw = dict(mask=torch.cat([mask[rep], torch.ones(len(flat), Lmax - 1, dtype=torch.long)], 1).to(dev),
                              positions=pos.to(dev))
                h = lm.run(ids.to(dev), cache, **kw)
                lp, gr = token_logprobs(lm, h[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)],
                                        torch.tensor(tgts, device=dev))
                for r, (seg_lp, seg_gr) in enumerate(zip(lp.split(counts), gr.split(counts))):
                    lp_sum[r] += float(seg_lp.sum())
                    all_greedy[r] = all_greedy[r] and bool(seg_gr.all())
        for r, (idx, _) in enumerate(flat):
            out[idx] = (lp_sum[r], all_greedy[r])
        if tick:
            tick(len(flat))


def loglikelihoods(lm, docs, batch_size=32, max_batch_tokens=32768, task=None):
    """Fill doc["lls"], doc["greedy"] for every request of every doc (the one scoring path of every kind). A doc's
    request whose tokens repeat an earlier one of it is scored once, as the harness's HFLM scores repeats: a repeated
    choice (a dataset's duplicate answer) ties exactly and argmax takes the first (scored twice, float noise picked either)."""
    enc_cache, groups, flat = {}, [], []
    same = {}  # (doc, request) -> the doc's earlier request of identical tokens
    for d_i, d in enumerate(docs):
        pairs = [encode_pair(lm, c, x, enc_cache) for c, x in d["requests"]]
        reqs, first = [], {}
        for r_i, (ctx, cont) in enumerate(pairs):
            where = f"task {task}: example {d_i}: " if task else ""  # (neither named the task nor the fix)
            if not cont:
                raise EvalError(f"{where}request {d['requests'][r_i]!r} has an empty continuation after tokenisation; "
                                f"fix or drop that example in the task's data file")
            if len(cont) > lm.max_length:  # (the harness asserts it: cutting the context cannot make it fit)
                raise EvalError(f"{where}a continuation of {len(cont)} tokens exceeds the model's context of "
                                f"{lm.max_length} tokens; leave {task or 'this task'} out, or evaluate a model with "
                                f"a longer context")
            key = (tuple(ctx), tuple(cont))
            if key in first:
                same[(d_i, r_i)] = first[key]
            else:
                first[key] = (d_i, r_i)
                reqs.append(((d_i, r_i), ctx, cont))
        shared = (len(reqs) > 1 and all(p[0] == pairs[0][0] for p in pairs)
                  and len(pairs[0][0]) + max(len(p[1]) for p in pairs) - 1 <= lm.max_length)
        if shared and hasattr(lm, "new_cache"):
            groups.append((pairs[0][0], [(idx, cont) for idx, _, cont in reqs]))
        else:
            flat += reqs
    out = {}
    n_scored = len(flat) + sum(len(members) for _, members in groups)
    # cut on the left as the harness's (ctx + cont)[-(max_length + 1):], which warns; it went unsaid here
    say_cut(task, [len(ctx) + len(cont) - lm.max_length - 1 for _, ctx, cont in flat], n_scored, "requests", lm)
    tick = progress_printer(task, n_scored, "requests") if task else None
    if hasattr(lm, "run"):
        score_flat(lm, flat, out, batch_size, max_batch_tokens, tick)
        score_shared_prefix(lm, groups, out, batch_size, max_batch_tokens, tick)
    else:  # an engine that scores one request at a time
        for idx, ctx, cont in flat:
            inp = (ctx + cont)[-(lm.max_length + 1):]
            k = getattr(lm, "experts_per_token", None)  # (None: its own top_k, or no MoE layer)
            ll, greedy = lm.engine.loglikelihood(inp[:len(inp) - len(cont)], cont,
                                                 **({} if k is None else {"experts_per_token": k}))
            out[idx] = (float(ll), bool(greedy))
            if tick:
                tick()
    for idx, earlier in same.items():
        out[idx] = out[earlier]
    for d_i, d in enumerate(docs):
        d["lls"] = [out[(d_i, r)][0] for r in range(len(d["requests"]))]
        d["greedy"] = [out[(d_i, r)][1] for r in range(len(d["requests"]))]


def say_cut(task, excess, n, what, lm):
    """One line on stderr when inputs were cut on the left to fit the model's context (excess: tokens over it, per
    input; > 0 were cut), as lm-eval-harness warns: a short-context model's score was silently one of cut prompts."""
    cut = [e for e in excess if e > 0]
    if cut:
        print(f"note: {task or 'loglikelihood'}: {len(cut)} of {n} {what} longer than the model's context "
              f"({lm.max_length} tokens) cut on the left, as lm-eval-harness does (up to {max(cut)} tokens dropped)",
              file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------
# generation: eval.py's own greedy loop (nothing inherited from any generation config)

@torch.inference_mode()
def greedy_generate(lm, prompt, until, max_gen_toks):
    """Greedy continuation of prompt, cut at the first stop string (the harness's `until`) or a stop token."""
    max_gen_toks = min(max_gen_toks, lm.max_length - 1)  # (run_task refuses a cap that leaves the prompt no room)
    ids = lm.encode(prompt)[-(lm.max_length - max_gen_toks):]  # the harness's left truncation

    def batched_greedy():  # eval.py's own loop on the batched path's model
        cache = lm.new_cache(1, len(ids) + max_gen_toks)
        step = torch.tensor([ids], device=lm.device)
        for _ in range(max_gen_toks):
            nxt = int(lm.head(lm.run(step, cache)[:, -1]).float().argmax(dim=-1)[0])
            yield nxt
            step = torch.tensor([[nxt]], device=lm.device)
    # the int4 engine streams its own tokens (its generate knows one eos id); both stop alike
    tokens = lm.engine.stream(ids, max_gen_toks, temperature=0) if not hasattr(lm, "run") else batched_greedy()
    new, stop_text = [], getattr(lm, "stop_text", lm.decode)
    with contextlib.closing(tokens):
        for nxt in tokens:
            if nxt in lm.stop_ids:
                break
            new.append(nxt)
            if any(u in stop_text(new) for u in until):
                break
    new = [t for t in new if t not in lm.stop_ids]
    text = lm.decode(new)
    for u in until:
        text = text.split(u)[0]
    return text


# ----------------------------------------------------------------------------------------------------------
# metrics and standard errors (lm-eval api/metrics.py: mean_stderr; bootstrap_stderr for perplexity)

def mean_stderr(xs):
    """Sample standard deviation / sqrt(n) (the harness's mean_stderr); None below two examples."""
    n = len(xs)
    if n < 2:
        return None
    mu = sum(xs) / n
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1)) / math.sqrt(n)


def python_random_uniforms(seed, n):
    """random.Random(seed).random() x n, via numpy: CPython's seeded Mersenne Twister state loaded into numpy's
    legacy MT19937, which makes doubles the same way ((a >> 5) * 2^26 + (b >> 6)) / 2^53."""
    state = random.Random(seed).getstate()[1]
    rs = np.random.RandomState()
    rs.set_state(("MT19937", np.array(state[:624], dtype=np.uint32), state[624]))
    return rs.random_sample(n)


def bootstrap_perplexity_stderr(lls, iters=BOOTSTRAP_ITERS):
    """The harness's bootstrap_stderr(perplexity, lls, iters): chunks of 1000 resamples, chunk i drawn by
    random.Random(i).choices(lls, k=n) (index floor(random() * n)); sample stddev of exp(-mean)."""
    if len(lls) < 2 or iters < 2:  # (one resample has no standard deviation: the harness divides by zero)
        return None
    xs = np.asarray(lls, dtype=np.float64)
    n, chunk = len(xs), min(1000, iters)
    stats = []
    with np.errstate(over="ignore", invalid="ignore"):  # a resample past float range: no stderr (harness: a crash)
        for i in range(iters // chunk):
            idx = np.floor(python_random_uniforms(i, chunk * n) * n).astype(np.int64).reshape(chunk, n)
            stats.append(np.exp(-xs[idx].mean(axis=1)))
        se = float(np.std(np.concatenate(stats), ddof=1))
    return se if math.isfinite(se) else None


def doc_scores(task, d):
    kind = ET.TASKS[task][0]
    if kind == "loglikelihood":
        return {"acc": float(d["greedy"][0]), "perplexity": d["lls"][0]}
    lls = np.array(d["lls"])
    d["pred"] = int(np.argmax(lls))
    d["pred_norm"] = int(np.argmax(lls / np.array([float(len(c)) for c in d["choices"]])))
    return {"acc": float(d["pred"] == d["gold"]), "acc_norm": float(d["pred_norm"] == d["gold"])}


def aggregate(task, docs, bootstrap_iters):
    metrics = ET.TASKS[task][3]
    res = {}
    for m in metrics:
        xs = [d["scores"][m] for d in docs]
        if m == "perplexity":
            try:  # the harness's exp(-mean); a NaN log-likelihood (NaN logits) gives nan there and here
                res[m] = math.exp(-(sum(xs) / len(xs)))
            except OverflowError:  # below -709.78 (a diverged model) it ended the run (the harness's too): inf
                res[m] = float("inf")
            res[m + "_stderr"] = bootstrap_perplexity_stderr(xs, bootstrap_iters) if math.isfinite(res[m]) else None
        else:
            res[m] = sum(xs) / len(xs)
            res[m + "_stderr"] = mean_stderr(xs)
    res["n"] = len(docs)
    return res


# ----------------------------------------------------------------------------------------------------------
# one task, end to end

def run_task(lm, task, args):
    kind, _, _, metrics = ET.TASKS[task]
    docs = ET.task_docs(task, lm, args)
    if not docs:
        cache = getattr(args, "cache_dir", "--cache-dir")
        fix = ("put its rows in the task's file under --data-dir, or drop --data-dir to download them" if args.data_dir
               else f"delete its cached copy under {cache} and run again to download it")
        raise EvalError(f"task {task}: no examples (an empty data file); {fix}")
    t0 = time.time()
    if kind == "generate_until":
        caps = [min(args.max_gen_toks, d["max_gen_toks"]) if args.max_gen_toks else d["max_gen_toks"] for d in docs]
        if max(caps) >= lm.max_length:  # (the prompt was cut to its last token: scores of nothing; the harness asserts)
            raise EvalError(f"task {task}: generates up to {max(caps)} tokens, but the model's context is "
                            f"{lm.max_length}, which leaves no room for the prompt; pass --max-gen-toks below "
                            f"{lm.max_length} (e.g. {lm.max_length // 4})")
        tick = progress_printer(task, len(docs), "examples")
        # the prompts greedy_generate cuts on the left (to the room its cap leaves), said before they run
        say_cut(task, [len(lm.encode(d["prompt"])) - lm.max_length + cap for d, cap in zip(docs, caps)], len(docs),
                "prompts", lm)
        for d, cap in zip(docs, caps):
            # a cap, not a replacement: a larger one raised passkey's 10 and its left truncation cut the needle out
            d["generation"] = greedy_generate(lm, d["prompt"], d["until"], cap)
            d["scores"] = ET.SCORERS[task](d["generation"], d["target"])
            tick()
    else:
        loglikelihoods(lm, docs, args.batch_size, args.max_batch_tokens, task)
        for d in docs:
            d["scores"] = doc_scores(task, d)
    seconds = time.time() - t0
    if task == "passkey":  # reported per length
        results = {}
        for length in sorted({d["length"] for d in docs}):
            results[f"passkey@{length}"] = aggregate(task, [d for d in docs if d["length"] == length],
                                                     args.bootstrap_iters)
    else:
        results = {task: aggregate(task, docs, args.bootstrap_iters)}
    return docs, results, seconds


def examples_fingerprints(task, docs):
    """{result name: sha256 of the examples it scored, as prompted} (--compare: another data copy, --limit, seed or
    shots of the same n scored other questions)."""
    def sha(ds):
        return sha256_text(json.dumps([[d["requests"], d.get("gold")] if "requests" in d else
                                       [d["prompt"], d["target"], d.get("until")] for d in ds], default=str))
    if task == "passkey":
        lengths = sorted({d["length"] for d in docs})
        return {f"passkey@{n}": sha([d for d in docs if d["length"] == n]) for n in lengths}
    return {task: sha(docs)}


def example_record(i, d):
    rec = {"doc_id": i}
    if "requests" in d:
        rec.update(requests=[list(r) for r in d["requests"]], loglikelihoods=d["lls"], is_greedy=d["greedy"])
        for k in ("pred", "pred_norm", "gold"):
            if k in d:
                rec[k] = d[k]
    else:
        rec.update(prompt=d["prompt"], generation=d["generation"], target=d["target"])
        if "length" in d:
            rec.update(length=d["length"], depth=d["depth"])
    rec["scores"] = d["scores"]
    return rec


def fmt(v, like=None):
    """v with 4 decimals, or 1 from 1000 on; like: another value whose decimals it takes (a stderr beside its value)."""
    if v is None:
        return "n/a"
    return f"{v:.4f}" if abs(v if like is None else like) < 1000 else f"{v:.1f}"


def markdown_table(summary):
    lines = ["| task | metric | value | stderr | n |", "|---|---|---|---|---|"]
    for task, res in summary["results"].items():
        for m, v in res.items():
            if m.endswith("_stderr") or m == "n":
                continue
            lines.append(f"| {task} | {m} | {fmt(v)} | {fmt(res.get(m + '_stderr'), like=v)} | {res['n']} |")
    return "\n".join(lines) + "\n"


def compare(paths):
    """Side-by-side table; each value after the first column is marked ~ (within noise: |diff| < 2 x combined
    stderr) or * (outside it) against the first column."""
    sums = []
    for p in paths:
        try:
            with open(p) as f:
                sums.append(json.load(f))
            sums[-1]["results"].items()
        except FileNotFoundError:
            raise EvalError(f"{p}: no such file; pass summary.json files written by eval.py --out") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise EvalError(f"{p}: not an eval.py summary.json ({type(e).__name__}); pass files written by --out")
    for s, p in zip(sums, paths):  # values that are not numbers made a TypeError deep in the table
        for task, res in s["results"].items():
            if not isinstance(res, dict):  # (a bare number made a TypeError in the table)
                raise EvalError(f"{p}: results[{task!r}] is not a dict of metrics; pass files written by --out")
            bad = [m for m, v in res.items()
                   if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))]
            if bad:
                raise EvalError(f"{p}: results[{task!r}][{bad[0]!r}] is not a number; pass files written by --out")
    # (one model scored at top-1 and at top-2: the columns say which is which)
    names = [str(s.get("model", p)) + (f" top-{s['experts_per_token']}" if s.get("experts_per_token") else "")
             for s, p in zip(sums, paths)]
    # two evaluations of one run dir (its LATEST moved on): columns told apart
    names = [f"{n} [{i + 1}]" if names.count(n) > 1 else n for i, n in enumerate(names)]
    rows = []
    for s in sums:
        for task, res in s["results"].items():
            for m in res:
                if not m.endswith("_stderr") and m != "n" and (task, m) not in rows:
                    rows.append((task, m))
    lines = ["| task | metric | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for task, m in rows:
        cells, ref = [], None
        for col, s in enumerate(sums):
            res = s["results"].get(task, {})
            v, se = res.get(m), res.get(m + "_stderr")
            if v is None:
                cells.append("-")
                continue
            cell = f"{fmt(v)} ± {fmt(se, like=v)}" if se is not None else fmt(v)  # (1281.5 ± 40.0000 read as precise)
            cap = s.get("max_gen_toks") if ET.TASKS.get(task.split("@")[0], ("",))[0] == "generate_until" else None
            examples = (s.get("examples") or {}).get(task)  # (None in summaries before it was recorded)
            if col == 0:  # the first column is the reference: a row it lacks is compared against nothing
                ref = (v, se, res.get("n"), summary_fewshot(s, task), cap, examples)
            elif ref is not None and res.get("n") != ref[2]:  # other examples (--limit, other data): no verdict
                cell += f" (n={res.get('n')} vs {ref[2]} !)"
            elif ref is not None and summary_fewshot(s, task) != ref[3]:  # other prompts (0- vs 5-shot gsm8k): none
                cell += f" ({summary_fewshot(s, task)}-shot vs {ref[3]}-shot !)"
            elif ref is not None and cap != ref[4]:  # generations cut at another length (--max-gen-toks): none
                cell += f" (max-gen-toks {cap or 'default'} vs {ref[4] or 'default'} !)"
            elif ref is not None and None not in (examples, ref[5]) and examples != ref[5]:  # another test set
                cell += " (other examples !)"
            elif ref is not None and ref[1] is not None and se is not None:
                noise = 2 * math.sqrt(ref[1] ** 2 + se ** 2)
                places = 1 if max(abs(v), abs(ref[0])) >= 1000 else 4  # as fmt wrote the values
                cell += f" ({v - ref[0]:+.{places}f} {'~' if abs(v - ref[0]) <= noise else '*'})"
            cells.append(cell)
        lines.append(f"| {task} | {m} | " + " | ".join(cells) + " |")
    lines.append("\n~ = difference from the first column within noise (|diff| <= 2 * sqrt(se1^2 + se2^2)); "
                 "* = outside it; ! = scored on another number of examples than the first column (--limit, other "
                 "data), on other examples, with other few-shot prompts or generation caps: not compared; a row "
                 "without a first-column value is not compared")
    for name, s, p in zip(names, sums, paths):  # what each column scored (a run dir's name says neither step nor data)
        shots = ", ".join(f"{t} {summary_fewshot(s, t)}" for t in s["results"])
        # synthetic tasks alone (counting, passkey@N) read no data: "data hub" sent a reader after a download
        made = s["results"] and all(ET.TASKS.get(t.split("@")[0], ("", ""))[1] is None for t in s["results"])
        data = f"generated (seed {s.get('seed', '?')})" if made else s.get("data", "?")
        kind = f"{s['model_kind']}, " if s.get("model_kind") else ""  # an int4 container's said "dtype float32" only
        weights = f" ({s['model_weights']})" if s.get("model_weights") else ""  # a path whose weights were replaced
        k = (f"experts per token {s['experts_per_token']} (its own {s.get('own_experts_per_token', '?')}), "
             if s.get("experts_per_token") else "")
        lines.append(f"- {name}: {p}: {s.get('model_source', '?')}{weights}, {kind}data {data}, "
                     f"dtype {s.get('dtype', '?')}, {k}limit {s.get('limit')}, shots: {shots}")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(description="Evaluation with lm-evaluation-harness task definitions and its default "
                                 "shots (gsm8k 5-shot, the others zero-shot; see the header of eval.py).")
    ap.add_argument("model", nargs="?", help="picaflor checkpoint/run dir, int4 container, HF model dir or repo id")
    ap.add_argument("--tasks", default="lambada_openai,piqa,winogrande,arc_easy,arc_challenge,openbookqa,hellaswag",
                    help=f"comma-separated, from: {', '.join(ET.TASKS)}")
    ap.add_argument("--limit", type=int, default=None, help="first N examples per task (synthetic: N per length)")
    ap.add_argument("--data-dir", default=None, help="local task files DIR/<task>.jsonl|.json|.parquet or a folder "
                    "DIR/<task>/ of them (of a Hub snapshot's several splits, the task's split's files)")
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/picaflor/eval"),
                    help="where Hub downloads are kept")
    ap.add_argument("--out", default=None, help="write <task>.jsonl, summary.json and results.md here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json for picaflor/int4 models (default: beside it)")
    ap.add_argument("--int4-engine", action="store_true",
                    help="int4 containers: score through stream_infer's Engine (served kernels, one request at a "
                    "time) instead of the dequantised weights in the batched path; the served kernels round "
                    "activations to int8 per group, so a request's log-likelihood differs by up to ~0.1 nats: "
                    "compare models scored the same way")
    ap.add_argument("--ram-budget", default=None, help="--int4-engine: bound for the whole process, e.g. 4G "
                    "(stream_infer.py's; default: no bound, every expert read into memory)")
    ap.add_argument("--experts-per-token", type=int, default=None, metavar="K",
                    help="routed experts per token in each MoE layer (default: the model's own top_k), as "
                    "stream_infer.py / chat.py --experts-per-token serve it: e.g. 1 scores top-1 serving; recorded in "
                    "summary.json and --compare's columns; a model without MoE layers takes any K")
    ap.add_argument("--batch-size", type=int, default=32,
                    help="max sequences per forward; for choices sharing a context: max questions per batch "
                    "(all their choices run on the shared context's cache, bounded by --max-batch-tokens)")
    ap.add_argument("--max-batch-tokens", type=int, default=32768, help="token budget per batched forward")
    ap.add_argument("--seed", type=int, default=1234, help="for the synthetic tasks (counting, passkey) and the "
                    "few-shot sampler (the harness's fewshot_random_seed, default 1234)")
    ap.add_argument("--num-fewshot", type=int, default=None,
                    help=f"few-shot examples per prompt (default: the harness's per task: "
                    f"{', '.join(f'{t} {v[0]}' for t, v in ET.FEWSHOT.items())}, the others 0); N > 0 only for "
                    f"{', '.join(ET.FEWSHOT)}, drawn from its {'/'.join(sorted({v[1] for v in ET.FEWSHOT.values()}))} split "
                    f"(--data-dir: DIR/<task>/train.jsonl)")
    ap.add_argument("--passkey-lengths", default=None,
                    help="e.g. 4096,8192 (default: 4K doubling, and the context itself; the context alone under 4K)")
    ap.add_argument("--passkey-n", type=int, default=10, help="passkey examples per length")
    ap.add_argument("--max-gen-toks", type=int, default=None,
                    help="cap on generated tokens (default: the task's, e.g. the harness's 256 for gsm8k)")
    ap.add_argument("--bootstrap-iters", type=int, default=BOOTSTRAP_ITERS,
                    help="perplexity stderr resamples (0: none; the means' stderrs are kept)")
    ap.add_argument("--compare", nargs="+", metavar="SUMMARY", help="print summaries side by side and exit")
    return ap.parse_args(argv)


# (num_fewshot is per task: a task rerun with other shots replaces its own results only)
# (seed: the synthetic tasks' examples and the few-shot draws; model_weights: a path's weights, which a rollback or a
# new export replaces under the same name)
SAME_EVALUATION = ("model_source", "model_weights", "tokenizer", "data", "dtype", "limit", "max_gen_toks",
                   "harness_version", "seed", "experts_per_token")


def keep_earlier_results(out, summary, tasks):
    """An --out that holds a summary.json: its other tasks' results are kept when it scored the same model the same
    way (a rerun of a failed task, as its error says, left a summary of that task alone), and another model's are
    refused (its per-task files would have sat beside this model's summary)."""
    path = os.path.join(out, "summary.json")
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            earlier = json.load(f)
        assert isinstance(earlier, dict)
    except (OSError, ValueError, AssertionError) as e:
        raise EvalError(f"{path}: not a summary this script wrote ({e or 'not a JSON object'}); move it aside or pass "
                        f"another --out") from None
    done = [t for t in earlier.get("tasks_done", []) if t in ET.TASKS]
    earlier.setdefault("experts_per_token", summary["own_experts_per_token"])  # (written before it was recorded)
    for key in SAME_EVALUATION:
        if key == "data" and (reads_no_data(done) or reads_no_data(tasks)):
            if reads_no_data(tasks):  # (counting, passkey alone: the summary's data stays the other tasks')
                summary["data"] = earlier.get("data", summary["data"])
            continue
        if earlier.get(key) != summary[key]:
            raise EvalError(f"--out {out} holds results of another evaluation ({key} {earlier.get(key)!r}, now "
                            f"{summary[key]!r}); pass another --out, or delete {path} to start over")
    # a task asked again keeps its earlier results until it is scored (a Ctrl-C before that dropped them)
    summary["results"] = {n: r for n, r in (earlier.get("results") or {}).items() if result_task(n) in done}
    summary["examples"] = {n: h for n, h in (earlier.get("examples") or {}).items() if result_task(n) in done}
    summary["seconds"] = {t: (earlier.get("seconds") or {}).get(t) for t in done}
    summary["num_fewshot"] = {t: summary_fewshot(earlier, t) for t in done}
    kept = [t for t in done if t not in tasks]
    if kept:
        print(f"--out {out}: keeping the earlier results of {', '.join(kept)} (the same model, scored the same way)")


def reads_no_data(tasks):
    """Whether these tasks are all synthetic (counting, passkey): their results do not depend on --data-dir."""
    return all(ET.TASKS[t][1] is None for t in tasks)


def result_task(name):
    """The task a results entry belongs to (passkey@4096: passkey)."""
    return name.split("@")[0]


def summary_fewshot(summary, task):
    """A task's shots in a summary: {task: N} (an earlier eval.py wrote one 0 for every task, or nothing)."""
    v = summary.get("num_fewshot", 0)
    return v.get(task.split("@")[0], 0) if isinstance(v, dict) else v


def evaluate(args):
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:  # (an empty table, exit 0)
        raise EvalError(f"--tasks {args.tasks!r}: no task named; known: {', '.join(ET.TASKS)}")
    unknown = [t for t in tasks if t not in ET.TASKS]
    if unknown:
        raise EvalError(f"unknown task {unknown[0]!r}; known: {', '.join(ET.TASKS)}")
    if args.data_dir and not os.path.isdir(args.data_dir):
        raise EvalError(f"{args.data_dir}: --data-dir is not a directory; pass the folder that holds the task "
                        f"data files")
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit {args.limit}: a positive number of examples per task (leave it out for all)")
    if args.bootstrap_iters < 0 or args.bootstrap_iters == 1:  # (-1 ran as 0, unsaid; 1 wrote a nan stderr)
        raise EvalError(f"--bootstrap-iters {args.bootstrap_iters}: 0 (no perplexity stderr) or at least 2 "
                        f"resamples")
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise EvalError(f"{args.out}: exists and is not a folder; pass --out DIR")
    if args.out and args.data_dir and os.path.realpath(args.out) == os.path.realpath(args.data_dir):
        # each task's results, written as <task>.jsonl, replaced the task's own data file there
        clash = [p for p in (os.path.join(args.data_dir, t + ".jsonl") for t in tasks) if os.path.exists(p)]
        if clash:
            raise EvalError(f"--out {args.out}: is --data-dir, and the results would replace {clash[0]}; pass "
                            f"another --out")
    if problem := picaflor.device_problem(args.device):
        raise EvalError(f"--device {args.device}: {problem}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise EvalError(f"--num-fewshot {args.num_fewshot}: 0 or more (leave it out for each task's harness default)")
    zero_only = [t for t in tasks if t not in ET.FEWSHOT]
    if args.num_fewshot and zero_only:
        raise EvalError(f"--num-fewshot {args.num_fewshot}: task {zero_only[0]} is scored zero-shot only (the "
                        f"harness's default for it); few-shot prompts are built for {', '.join(ET.FEWSHOT)}: run "
                        f"{zero_only[0]} in a call without --num-fewshot")
    if args.passkey_lengths is not None:
        try:
            [int(x) for x in args.passkey_lengths.split(",")]  # as eval_tasks.passkey_lengths() parses it
        except ValueError:
            raise EvalError(f"--passkey-lengths {args.passkey_lengths!r}: comma-separated token counts, e.g. 4096,8192")
    if args.ram_budget is not None and not (args.int4_engine and os.path.isfile(args.model)):
        raise EvalError(f"--ram-budget {args.ram_budget}: bounds an int4 container scored with --int4-engine only; "
                        f"drop it, or add --int4-engine with an int4 container")
    lm = load_model(args.model, args.device, args.dtype, args.tokenizer, args.int4_engine, args.ram_budget,
                    args.experts_per_token)
    if note := picaflor.more_experts_note(lm.experts_per_token, lm.own_experts_per_token):
        print(note, file=sys.stderr, flush=True)
    if any(ET.TASKS[t][0] == "generate_until" for t in tasks):
        warn_shipped_settings(lm)
    bos = bos_convention(lm)
    if lm.kind == "hf":  # (a picaflor model always starts with <|bos|>, as trained)
        print(f"note: {lm.name}: {'BOS ' + bos['empty_context_token'] + ' put' if bos['bos_added'] else 'no BOS'} "
              f"before every text (its tokenizer's default, as lm-eval's HFLM without add_bos_token); an empty "
              f"context is {bos['empty_context_token']}", file=sys.stderr, flush=True)
    summary = {"results": {}, "model": args.model, "model_kind": lm.kind,
               "model_source": getattr(lm, "source", os.path.abspath(args.model)),
               "model_weights": getattr(lm, "weights", None),
               # a picaflor tokenizer's sha256 (--tokenizer or the model's own; an HF model's is among its files)
               "tokenizer": getattr(lm.tok, "hash", None) if lm.kind != "hf" else None,
               "data": os.path.abspath(args.data_dir) if args.data_dir else "hub", "harness_version": HARNESS_VERSION,
               "seed": args.seed, "dtype": lm.dtype, "device": str(args.device), "max_length": lm.max_length,
               **bos,  # bos_added, empty_context_token
               # routed experts per token scored at, and the model's own (None: no MoE layers)
               "experts_per_token": lm.experts_per_token, "own_experts_per_token": lm.own_experts_per_token,
               "num_fewshot": {}, "limit": args.limit, "bootstrap_iters": args.bootstrap_iters,
               "logprob_dtype": "float32",  # log-softmax and sums in fp32 whatever the model's dtype (the harness: its)
               "max_gen_toks": args.max_gen_toks,
               "sampling": {"method": "greedy", "temperature": 0.0, "repetition_penalty": 1.0,
                            "presence_penalty": 0.0, "frequency_penalty": 0.0,
                            "ignored_model_settings": lm.generation_settings},
               "seconds": {}, "examples": {}}
    made = []  # the folders this run makes for --out, deepest first: a failure that leaves them empty removes them
    d = os.path.abspath(args.out) if args.out else None
    while d and not os.path.exists(d):
        made.append(d)
        d = os.path.dirname(d)
    try:
        return score_tasks(lm, args, tasks, summary)
    except OutBusy:  # the folders are the other eval's now: removing one it made, still empty, failed its writes
        raise
    except BaseException:
        for d in made:
            try:
                os.rmdir(d)  # only an empty folder: anything written there (or by anyone else) keeps it
            except FileNotFoundError:
                continue  # (makedirs failed above it)
            except OSError:
                break
        raise


def score_tasks(lm, args, tasks, summary):
    lock = None
    try:
        if args.out:
            lock = hold_out(args.out)
        return score_into(lm, args, tasks, summary)
    finally:
        if lock is not None:
            os.close(lock)


class OutBusy(EvalError):
    pass


def hold_out(out):
    """Make --out and hold it (an flock on the folder, dropped when this process ends, however it ends) for this run:
    two evals into one --out each kept its own summary.json, the later one dropping the other's tasks without a word.
    Returns the folder's fd to close, or None on a filesystem without locks."""
    try:
        os.makedirs(out, exist_ok=True)
        fd = os.open(out, os.O_RDONLY)
    except OSError as e:
        raise EvalError(f"--out {out}: cannot write there ({e.strerror}); pass a folder you can write")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutBusy(f"--out {out}: another eval.py is writing there; wait for it to end, or pass another --out")
    except OSError:  # a filesystem without flock (NFS -o nolock): unguarded, as before
        os.close(fd)
        return None
    return fd


def score_into(lm, args, tasks, summary):
    if args.out:
        try:
            checkpoint.check_writable(args.out)  # before hours of scoring, not after
        except OSError as e:
            raise EvalError(f"--out {args.out}: cannot write there ({e.strerror}); pass a folder you can write")
        keep_earlier_results(args.out, summary, tasks)
    args.tasks_left, args.tasks_asked = list(tasks), list(tasks)
    for task in tasks:
        docs, results, seconds = run_task(lm, task, args)
        # its earlier results (kept until now) go: another --passkey-lengths leaves none of their lengths behind
        summary["results"] = {n: r for n, r in summary["results"].items() if result_task(n) != task}
        summary["results"].update(results)
        summary["examples"] = {n: h for n, h in summary["examples"].items() if result_task(n) != task}
        summary["examples"].update(examples_fingerprints(task, docs))
        summary["seconds"].pop(task, None)  # (tasks_done in the order they finished)
        summary["seconds"][task] = round(seconds, 3)
        summary["num_fewshot"][task] = ET.num_fewshot(task, args)
        for name, res in results.items():
            shown = ", ".join(f"{m} {fmt(v)}" for m, v in res.items() if not m.endswith("_stderr") and m != "n")
            print(f"{name}: {shown} (n={res['n']}, {ET.num_fewshot(task, args)}-shot, {seconds:.1f}s)", flush=True)
        if args.out:  # after every task: a later task's failure (its data, a download, Ctrl-C) loses none of these
            # each file whole or not at all (a crash mid-rewrite truncated summary.json, losing the finished tasks)
            try:
                checkpoint.write_atomic_text(os.path.join(args.out, f"{task}.jsonl"),
                                             "".join(json.dumps(example_record(i, d)) + "\n" for i, d in enumerate(docs)))
                summary["tasks_done"] = list(summary["seconds"])
                checkpoint.write_atomic_text(os.path.join(args.out, "summary.json"), json.dumps(summary, indent=1))
                k = summary.get("experts_per_token")
                checkpoint.write_atomic_text(os.path.join(args.out, "results.md"), f"# {args.model}"
                                             + (f" (routed experts per token: {k})" if k else "")
                                             + "\n\n" + markdown_table(summary))
            except OSError as e:  # a full disk: the scores above are printed; the files of earlier tasks stay whole
                raise EvalError(f"--out {args.out}: writing {task}'s results failed ({e.strerror}); its scores are "
                                f"printed above; free space and rerun with --tasks {task}")
        args.tasks_left.remove(task)
    print(markdown_table(summary))
    return summary


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        # (0 meant the default, < 0 nothing)
        for flag in ("max_gen_toks", "batch_size", "max_batch_tokens", "passkey_n", "experts_per_token"):
            v = getattr(args, flag)
            if v is not None and v < 1:
                raise EvalError(f"--{flag.replace('_', '-')} {v}: at least 1")
        if args.compare:
            print(compare(args.compare))
            return 0
        if not args.model:
            raise EvalError("give a MODEL (or --compare SUMMARY.json ...); see --help")
        evaluate(args)
    except (EvalError, checkpoint.CheckpointError, C.ContainerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (a traceback) the tasks finished before it are in --out: a rerun there keeps them
        left = getattr(args, "tasks_left", None)
        done = args.out and left and len(left) < len(getattr(args, "tasks_asked", left))
        print("interrupted" + (f"; the finished tasks are in {args.out}: go on with --tasks {','.join(left)} --out "
                               f"{args.out} (it keeps them)" if done else ""), file=sys.stderr)
        return 130
    except BrokenPipeError:  # `| head`: the reader left (a traceback); stdout pointed elsewhere for the exit's flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # stream_infer's errors (imported only for --int4-engine): one line too
        si = sys.modules.get("stream_infer")
        if si is None or not isinstance(e, si.StreamError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
