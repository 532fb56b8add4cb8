"""
eval.py vs lm-evaluation-harness's own HF backend (lm_eval.models.huggingface.HFLM): examples/s and scores on the
same small model and the same data, in one run, no downloads.

The model is a random GPT-2-style transformers model with a byte-level BPE tokenizer trained here on synthetic
text (saved as an ordinary HF model dir, so both evaluators load it the same way). The data is synthetic, in
the Hub datasets' own schemas, written as local JSON files; lm-eval reads them through its own task YAMLs
(copied from the installed package, with only the dataset source changed to those files).

Both run in fp32 on the same device with the same --batch-size (HFLM: sequences per forward; eval.py: the same
for unshared requests, and questions per batch where a question's choices share one context, bounded by its
--max-batch-tokens). The model's output head is 32768 wide by default (as picaflor nano; the baselines have
~50K), since where the head's work goes is part of what eval.py saves. Printed: per-task metrics from both,
the largest per-request log-likelihood difference, and scoring time (wall and process CPU seconds, examples/s,
ratio) for lm-eval's loglikelihood calls vs eval.py's run_task calls (both include tokenisation).

    python bench/eval_speed.py                      # default sizes (a few minutes on 2 shared CPU cores)
    python bench/eval_speed.py --n 40 --quick       # smoke run
    python bench/eval_speed.py --device cuda --n 500 --d-model 512 --layers 8

Measured here (2 shared CPU cores, `python bench/eval_speed.py --n 200`: d_model 256, 4 layers, head 32768,
6 tasks x 200 examples, batch 32, 1 thread): lm-eval HFLM 7.9 examples/s, eval.py 21.5 examples/s wall (2.71x;
process CPU time 2.65x); every acc / acc_norm identical, lambada perplexity equal to 4e-8 relative, largest
per-request |d loglikelihood| 4.7e-5 (fp32 reduction order).

The helpers here (make_tiny_hf_model, write_task_data, write_lm_eval_tasks) are also used by tests/test_eval.py.
"""

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORDS = ("the a man woman dog cat house tree river car red blue green big small old new run walks jumps eats "
         "sees takes makes under over near with from into water fire stone wood paper glass bread milk apple "
         "table chair door window road city farm field sun moon star rain snow wind cold hot fast slow quiet "
         "loud happy sad bright dark heavy light open closed first last good bad").split()


def sentence(rng, lo=4, hi=12):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def corpus(n=400, seed=0):
    rng = random.Random(seed)
    return [sentence(rng).capitalize() + "." for _ in range(n)] + ["Question: Answer: Count from 1, 2, 3 [title]"]


def make_tiny_hf_model(out_dir, vocab_size=512, n_layer=2, d_model=64, n_head=4, n_positions=512, seed=0,
                       generation_config=None, head_vocab=None):
    """A random GPT-2-style model + byte-level BPE tokenizer (trained on synthetic text) saved as a HF dir.
    head_vocab: width of the embedding / output head if larger than the tokenizer's (real LMs have 32K-50K)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                  unk_token="<|endoftext|>")
    tok.model_max_length = n_positions
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=max(len(tok), head_vocab or 0), n_positions=n_positions, n_embd=d_model, n_layer=n_layer, n_head=n_head,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # larger-than-default weights so that log-likelihoods differ clearly between choices
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    if generation_config is not None:
        GenerationConfig(**generation_config).save_pretrained(out_dir)
    return out_dir


def task_rows(task, n, seed=0):
    """n synthetic rows of one task in its Hub dataset's schema, with word counts in the real datasets' typical
    ranges (LAMBADA passages ~40-90 words, HellaSwag contexts ~25-45 words and endings ~8-20, ARC questions
    ~10-30 words and answers 1-6, PIQA goals 5-15 and solutions 5-25, OpenBookQA stems 5-20 and answers 1-5),
    and the edge cases: trailing spaces, hellaswag brackets, ARC with 3-5 choices and numeric labels,
    OpenBookQA keys with a leading space."""
    rng = random.Random(f"{task}-{seed}")
    rows = []
    for i in range(n):
        if task == "lambada_openai":
            rows.append({"text": sentence(rng, 40, 90) + " " + rng.choice(WORDS)})
        elif task == "piqa":
            rows.append({"goal": sentence(rng, 5, 15) + ("? " if i % 5 == 0 else "?"), "sol1": sentence(rng, 5, 25),
                         "sol2": sentence(rng, 5, 25), "label": rng.randint(0, 1)})
        elif task == "winogrande":
            s = sentence(rng, 5, 12) + " _ " + sentence(rng, 3, 10) + "."
            rows.append({"sentence": s, "option1": rng.choice(WORDS), "option2": rng.choice(WORDS),
                         "answer": rng.choice(["1", "2"])})
        elif task in ("arc_easy", "arc_challenge"):
            k = rng.randint(3, 5)
            labels = [str(j + 1) for j in range(k)] if i % 4 == 0 else "ABCDE"[:k]
            rows.append({"id": f"q{i}", "question": sentence(rng, 10, 30) + "?",
                         "choices": {"text": [sentence(rng, 1, 6) for _ in range(k)], "label": list(labels)},
                         "answerKey": rng.choice(list(labels))})
        elif task == "openbookqa":
            rows.append({"id": f"o{i}", "question_stem": sentence(rng, 5, 20) + (" " if i % 3 == 0 else ""),
                         "choices": {"text": [sentence(rng, 1, 5) for _ in range(4)], "label": list("ABCD")},
                         "answerKey": (" " if i % 4 == 0 else "") + rng.choice("ABCD")})
        elif task == "hellaswag":
            rows.append({"ind": i, "activity_label": rng.choice(WORDS).capitalize(),
                         "ctx_a": sentence(rng, 20, 40) + (" [title] " + sentence(rng, 2, 4) if i % 3 == 0 else ""),
                         "ctx_b": sentence(rng, 2, 5), "ctx": "", "split": "val", "split_type": "indomain",
                         "endings": [sentence(rng, 8, 20) + (" [step] x" if j == 1 else "") for j in range(4)],
                         "source_id": f"s{i}", "label": str(rng.randint(0, 3))})
        elif task == "gsm8k":
            a, b = rng.randint(2, 40), rng.randint(2, 40)
            rows.append({"question": f"{sentence(rng)} {a} and {b}. How many in all?",
                         "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b:,}"})
    return rows


def write_task_data(data_dir, tasks, n, seed=0):
    """DATA_DIR/<task>.jsonl for each task (eval.py's --data-dir layout, also lm-eval's json data_files)."""
    os.makedirs(data_dir, exist_ok=True)
    for t in tasks:
        with open(os.path.join(data_dir, f"{t}.jsonl"), "w") as f:
            for r in task_rows(t, n, seed):
                f.write(json.dumps(r) + "\n")
    return data_dir


# each task's YAML in the installed lm_eval/tasks (arc_challenge = arc_easy's with the task name changed)
HARNESS_TASK_FILES = {"lambada_openai": "lambada/lambada_openai.yaml", "piqa": "piqa/piqa.yaml",
                      "winogrande": "winogrande/default.yaml", "arc_easy": "arc/arc_easy.yaml",
                      "arc_challenge": "arc/arc_easy.yaml", "openbookqa": "openbookqa/openbookqa.yaml",
                      "hellaswag": "hellaswag/hellaswag.yaml", "gsm8k": "gsm8k/gsm8k.yaml"}


def write_lm_eval_tasks(yaml_dir, data_dir, tasks, split_files=None):
    """lm-eval task YAMLs, include-free: the installed harness's own YAML text for each task with the dataset
    source replaced by DATA_DIR/<task>.jsonl, or by split_files {split: path} (few-shot: a train split of its own),
    and its helper .py files copied beside, for `!function`."""
    import lm_eval
    root = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")
    os.makedirs(yaml_dir, exist_ok=True)
    for t in tasks:
        rel = HARNESS_TASK_FILES[t]
        src_dir = os.path.join(root, os.path.dirname(rel))
        for f in os.listdir(src_dir):
            if f.endswith(".py"):
                shutil.copy(os.path.join(src_dir, f), yaml_dir)
        lines, skip = [], False
        for line in open(os.path.join(root, rel)).read().splitlines():
            if skip and line.startswith("  "):
                continue
            skip = False
            key = line.split(":")[0]
            if key in ("dataset_path", "dataset_name", "include", "tag"):
                skip = key == "tag"
                continue
            if key == "task":
                line = f"task: {t}"
            lines.append(line)
        path = os.path.abspath(os.path.join(data_dir, f"{t}.jsonl"))
        # every split the YAML names points at the one file (the evaluated split is then our data whichever it is)
        files = split_files or {s: path for s in ("train", "validation", "test")}
        lines += ["dataset_path: json", "dataset_kwargs:", "  data_files:"] + [f"    {s}: {p}" for s, p in files.items()]
        with open(os.path.join(yaml_dir, f"{t}.yaml"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return yaml_dir


def run_lm_eval(lm, yaml_dir, tasks, limit=None, bootstrap_iters=0):
    """lm_eval.simple_evaluate on our task dir (zero-shot, samples logged). Returns its results dict."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager
    tm = TaskManager(include_path=yaml_dir, include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=0, limit=limit, task_manager=tm,
                                   log_samples=True, bootstrap_iters=bootstrap_iters, random_seed=0, numpy_random_seed=0,
                                   torch_random_seed=0, fewshot_random_seed=0)


def run_eval_py(model_dir, data_dir, tasks, device, batch_size, limit=None):
    """eval.py's own path (model loaded once); returns {task: (docs, results)} and the scoring (wall, cpu) seconds."""
    import eval as ev
    args = ev.parse_args([model_dir, "--data-dir", data_dir, "--tasks", ",".join(tasks), "--device", device,
                          "--dtype", "float32", "--batch-size", str(batch_size), "--bootstrap-iters", "0"]
                         + (["--limit", str(limit)] if limit else []))
    lm = ev.load_model(model_dir, device, "float32")
    out, wall, cpu = {}, 0.0, 0.0
    for t in tasks:
        t0, c0 = time.time(), time.process_time()
        docs, results, _ = ev.run_task(lm, t, args)
        wall, cpu = wall + time.time() - t0, cpu + time.process_time() - c0
        out[t] = (docs, results)
    return out, (wall, cpu)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="examples per task")
    ap.add_argument("--tasks", default="hellaswag,arc_easy,piqa,openbookqa,winogrande,lambada_openai")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048, help="BPE vocab trained on the synthetic text")
    ap.add_argument("--head-vocab", type=int, default=32768,
                    help="output head width (as picaflor nano's 32768; Pythia and SmolLM2 have ~50K)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="tiny model (d_model 64, 2 layers)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both (1: steadier on a shared box)")
    args = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    tasks = [t for t in args.tasks.split(",") if t]
    timed = [t for t in HARNESS_TASK_FILES if t != "gsm8k"]  # the loglikelihood tasks (gsm8k: the parity test's)
    unknown = [t for t in tasks if t not in timed]
    if unknown or not tasks or args.n < 1:  # (a KeyError traceback after the model was made, its temp dir left)
        ap.error(f"--tasks: {', '.join(unknown) or '(none)'} not among {', '.join(timed)}" if unknown or not tasks
                 else "--n: at least 1 example per task")
    tmp = tempfile.mkdtemp(prefix="eval_speed_")
    try:
        run(args, tasks, tmp, torch)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args, tasks, tmp, torch):
    os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(tmp, "hf_datasets"))
    d = 64 if args.quick else args.d_model
    model_dir = make_tiny_hf_model(os.path.join(tmp, "model"), vocab_size=args.vocab, d_model=d,
                                   n_layer=2 if args.quick else args.layers, n_head=4, n_positions=1024,
                                   head_vocab=args.head_vocab)
    data_dir = write_task_data(os.path.join(tmp, "data"), tasks, args.n)
    yaml_dir = write_lm_eval_tasks(os.path.join(tmp, "tasks"), data_dir, tasks)
    print(f"model: GPT-2 style, d_model {d}, {2 if args.quick else args.layers} layers, head vocab {args.head_vocab}; "
          f"{args.n} examples per task; "
          f"device {args.device}; batch size {args.batch_size}; torch threads {torch.get_num_threads()}")

    from lm_eval.models.huggingface import HFLM
    hflm = HFLM(pretrained=model_dir, device=args.device, batch_size=args.batch_size, dtype="float32")
    import lm_eval.api.model
    timed = [0.0, 0.0]
    orig = lm_eval.api.model.TemplateLM.loglikelihood

    def timed_ll(self, requests, *a, **kw):  # lm-eval's scoring (tokenising + forwards), not its dataset loading
        t0, c0 = time.time(), time.process_time()
        r = orig(self, requests, *a, **kw)
        timed[0] += time.time() - t0
        timed[1] += time.process_time() - c0
        return r
    lm_eval.api.model.TemplateLM.loglikelihood = timed_ll
    ref = run_lm_eval(hflm, yaml_dir, tasks)
    lm_eval.api.model.TemplateLM.loglikelihood = orig
    ours, ours_t = run_eval_py(model_dir, data_dir, tasks, args.device, args.batch_size)

    print(f"\n{'task':16s} {'metric':9s} {'lm-eval':>9s} {'eval.py':>9s}  max|dll|")
    worst = 0.0
    for t in tasks:
        samples = sorted(ref["samples"][t], key=lambda s: s["doc_id"])
        docs = ours[t][0]
        dll = max(abs(float(r[0][0]) - ll) for s, d in zip(samples, docs) for r, ll in zip(s["resps"], d["lls"]))
        worst = max(worst, dll)
        for m in ("acc", "acc_norm", "perplexity"):
            key = f"{m},none"
            if key in ref["results"][t]:
                print(f"{t:16s} {m:9s} {ref['results'][t][key]:9.4f} {ours[t][1][t][m]:9.4f}  {dll:.2e}")
    n_total = args.n * len(tasks)
    for what, i in (("wall", 0), ("cpu", 1)):  # cpu: process CPU seconds, steadier on a shared machine
        print(f"{what:4s} time: lm-eval HFLM {timed[i]:7.2f}s ({n_total / timed[i]:7.1f} examples/s)   eval.py "
              f"{ours_t[i]:7.2f}s ({n_total / ours_t[i]:7.1f} examples/s)   ->  eval.py is {timed[i] / ours_t[i]:.2f}x")
    print(f"max |d loglikelihood| {worst:.2e}; identical metrics: "
          f"{all(abs(ref['results'][t][k] - ours[t][1][t][k.split(',')[0]]) < 1e-9 for t in tasks for k in ref['results'][t] if k.split(',')[0] in ('acc', 'acc_norm'))}")


if __name__ == "__main__":
    main()
