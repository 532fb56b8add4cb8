"""
eval.py's tasks and their data: each task as lm-evaluation-harness v0.4.x defines it (a dataset row -> requests or
a prompt, its scorer, its default shots and the harness's few-shot prompts), the synthetic counting and passkey
tasks, and where rows come from (a local --data-dir copy, or the Hub's parquet through huggingface_hub, cached for
offline use). eval.py's docstring describes the tasks, shots and data layouts as a user sees them.
"""

import json
import os
import random
import re
import sys

import checkpoint

MAX_GEN_TOKS = 256  # the harness's default max_gen_toks


class EvalError(Exception):
    """Bad input (model path, task name, data file); the message names the thing and the fix."""


# ----------------------------------------------------------------------------------------------------------
# tasks: a dataset row (doc) -> requests, as the harness's task YAMLs define them

def hellaswag_pre(text):
    # lm-eval tasks/hellaswag/utils.py preprocess: strip, " [title]" -> ". ", drop "[...]" spans, "  " -> " "
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def str_list(x):
    """A row's list of strings; a string (a copy whose list was written as text, "['a', 'b']") had each of its
    characters scored as a choice, silently."""
    if not isinstance(x, (list, tuple)) or not all(isinstance(c, str) for c in x):
        raise TypeError(f"expected a list of strings, not {x!r:.60}")
    return list(x)


def mc(context, choices, gold):
    """Multiple choice: one request (context, " " + choice) per choice (target_delimiter " "). A gold outside the
    choices (PIQA's unlabelled test split has -1 on every row) is an error, not a silent miss."""
    choices = str_list(choices)
    g = int(gold)
    if not 0 <= g < len(choices):
        raise EvalError(f"gold label {gold!r} is outside 0..{len(choices) - 1} (an unlabelled split? use the "
                        f"task's validation data)")
    return {"requests": [(context, " " + c) for c in choices], "choices": list(choices), "gold": g}


def doc_lambada(d):
    words = d["text"].split(" ")
    return {"requests": [(" ".join(words[:-1]), " " + words[-1])]}


def doc_piqa(d):
    return mc(f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], d["label"])


def doc_winogrande(d):
    # partial scoring: the two fillings are the contexts, the rest of the sentence is the shared continuation
    s = d["sentence"]
    i = s.index("_")
    contexts = [s[:i] + d["option1"], s[:i] + d["option2"]]
    cont = " " + s[i + 1:].strip()
    return {"requests": [(c, cont) for c in contexts], "choices": contexts, "gold": {"1": 0, "2": 1}[d["answer"]]}


def doc_arc(d):
    return mc(f"Question: {d['question']}\nAnswer:", d["choices"]["text"],
              d["choices"]["label"].index(d["answerKey"]))


def doc_openbookqa(d):
    return mc(d["question_stem"], d["choices"]["text"], d["choices"]["label"].index(d["answerKey"].lstrip()))


def doc_hellaswag(d):
    ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize()
    return mc(hellaswag_pre(d["activity_label"] + ": " + ctx), [hellaswag_pre(e) for e in str_list(d["endings"])],
              int(d["label"]))


def doc_gsm8k(d):
    if not (isinstance(d["question"], str) and isinstance(d["answer"], str)):  # a TypeError after generation
        raise TypeError("question and answer must be strings")
    return {"prompt": f"Question: {d['question']}\nAnswer:", "target": d["answer"],
            "until": ["Question:", "</s>", "<|im_end|>"], "max_gen_toks": MAX_GEN_TOKS}


def gsm8k_scores(generation, target):
    """The harness's gsm8k filters (strict-match, flexible-extract) then exact_match with its regexes_to_ignore."""
    def extract(pattern, group_select):
        found = re.findall(pattern, generation)
        if not found:
            return "[invalid]"
        m = found[group_select]
        if isinstance(m, tuple):
            m = [x for x in m if x]
            m = m[0] if m else "[invalid]"
        return m.strip()

    def norm(s):
        for r in (",", "\\$", "(?s).*#### ", "\\.$"):
            s = re.sub(r, "", s)
        return s.lower()

    strict = extract(r"#### (\-?[0-9\.\,]+)", 0)
    flexible = extract(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", -1)
    return {"exact_match_strict": float(norm(strict) == norm(target)),
            "exact_match_flexible": float(norm(flexible) == norm(target))}


def counting_docs(n, seed):
    """Synthetic counting (seeded): 'Count from a to b:' with the first three numbers given."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        a = rng.randint(1, 60)
        b = a + rng.randint(6, 14)
        docs.append({"prompt": f"Count from {a} to {b}:\n{a}, {a + 1}, {a + 2},",
                     "target": " " + ", ".join(str(i) for i in range(a + 3, b + 1)),
                     "until": ["\n"], "max_gen_toks": 4 * (b - a)})
    return docs


def counting_scores(generation, target):
    want = re.findall(r"-?\d+", target)
    got = re.findall(r"-?\d+", generation)[:len(want)]
    return {"exact_match": float(got == want)}


PASSKEY_FILLER = ["The grass is green. ", "The sky is blue. ", "The sun is yellow. ", "Here we go. ",
                  "There and back again. "]


def filler(n):
    return "".join(PASSKEY_FILLER[i % len(PASSKEY_FILLER)] for i in range(n))


def passkey_docs(lm, lengths, n, seed):
    """Synthetic passkey retrieval (Mohtashami & Jaggi 2023, arXiv 2305.16300 prompt): a 5-digit key hidden at a
    random depth in filler text; the prompt is sized to just under LEN tokens with this model's tokenizer."""
    rng = random.Random(seed)
    head = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the important information there.\n")
    tail = "\nWhat is the pass key? The pass key is"
    per_sentence = max(1.0, len(lm.encode(filler(50), False)) / 50)
    docs = []
    for length in lengths:
        for _ in range(n):
            key = str(rng.randint(10000, 99999))
            needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
            fixed = len(lm.encode(head + needle + tail))
            if fixed + 16 > lm.max_length:  # (it said to pass a longer --passkey-lengths, which was then refused)
                raise EvalError(f"passkey needs a context of at least {fixed + 16} tokens (the prompt without filler "
                                f"is already {fixed}); this model's is {lm.max_length}: leave passkey out of --tasks")
            if fixed + 16 > length:
                raise EvalError(f"passkey length {length} is too short: the prompt without filler is already "
                                f"{fixed} tokens; use --passkey-lengths of at least {fixed + 16}")
            n_fill = int((length - 16 - fixed) / per_sentence) + 4
            depth = rng.random()
            while True:  # the estimate can overshoot; drop sentences until the prompt fits in LEN - 16 tokens
                cut = int(depth * n_fill)
                prompt = head + filler(cut) + needle + filler(n_fill)[len(filler(cut)):] + tail
                if n_fill == 0 or len(lm.encode(prompt)) <= length - 16:
                    break
                n_fill -= 1
            docs.append({"prompt": prompt, "target": key, "until": ["\n"], "max_gen_toks": 10, "length": length,
                         "depth": round(depth, 3)})
    return docs


def passkey_scores(generation, target):
    m = re.search(r"\d+", generation)
    return {"acc": float(m is not None and m.group(0) == target)}


# name -> (kind, Hub (repo, config, split) or None for synthetic, doc builder, metrics)
TASKS = {
    "lambada_openai": ("loglikelihood", ("EleutherAI/lambada_openai", "default", "test"), doc_lambada,
                       ["acc", "perplexity"]),
    "piqa": ("multiple_choice", ("baber/piqa", None, "validation"), doc_piqa, ["acc", "acc_norm"]),
    "winogrande": ("multiple_choice", ("allenai/winogrande", "winogrande_xl", "validation"), doc_winogrande,
                   ["acc"]),
    "arc_easy": ("multiple_choice", ("allenai/ai2_arc", "ARC-Easy", "test"), doc_arc, ["acc", "acc_norm"]),
    "arc_challenge": ("multiple_choice", ("allenai/ai2_arc", "ARC-Challenge", "test"), doc_arc,
                      ["acc", "acc_norm"]),
    "openbookqa": ("multiple_choice", ("allenai/openbookqa", "main", "test"), doc_openbookqa, ["acc", "acc_norm"]),
    "hellaswag": ("multiple_choice", ("Rowan/hellaswag", None, "validation"), doc_hellaswag, ["acc", "acc_norm"]),
    "gsm8k": ("generate_until", ("openai/gsm8k", "main", "test"), doc_gsm8k,
              ["exact_match_strict", "exact_match_flexible"]),
    "counting": ("generate_until", None, None, ["exact_match"]),
    "passkey": ("generate_until", None, None, ["acc"]),
}
SCORERS = {"gsm8k": gsm8k_scores, "counting": counting_scores, "passkey": passkey_scores}
# rows of each Hub split (the datasets' cards; lm-eval scores all of them): another count is a partial or other copy
SPLIT_ROWS = {"lambada_openai": 5153, "piqa": 1838, "winogrande": 1267, "arc_easy": 2376, "arc_challenge": 1172,
              "openbookqa": 500, "hellaswag": 10042, "gsm8k": 1319}
# tasks given few-shot prompts as the harness builds them: (its YAML's num_fewshot, its fewshot_split, that split's rows
# on the Hub); every other task's YAML leaves num_fewshot unset (0 shots), the only count eval.py scores them with
FEWSHOT = {"gsm8k": (5, "train", 7473)}
TARGET_DELIMITER, FEWSHOT_DELIMITER = " ", "\n\n"  # the harness's TaskConfig defaults (gsm8k's YAML keeps them)


def num_fewshot(task, args):
    """--num-fewshot if given, else the harness's default for the task."""
    return args.num_fewshot if args.num_fewshot is not None else FEWSHOT.get(task, (0,))[0]


# ----------------------------------------------------------------------------------------------------------
# data: Hub parquet via huggingface_hub, or a local copy

def read_rows(path):
    """Rows (dicts) of one .parquet, .jsonl or .json file."""
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq
            return pq.read_table(path).to_pylist()
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith(".json") and text.lstrip().startswith("["):
            return json.loads(text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise EvalError(f"{path}: cannot read task data ({str(e).splitlines()[0]}); "
                        f"write .jsonl (one JSON object per line), a JSON list or parquet") from None


DATA_EXTS = (".parquet", ".jsonl", ".json")


SPLIT_NAMES = ("train", "validation", "test")


# datasets whose repo holds every config's file for one split side by side (EleutherAI/lambada_openai: lambada_test.jsonl
# is the default config, OpenAI's English text; lambada_test_{de,en,es,fr,it}.jsonl the translated configs)
# task -> (the other configs' file names, the scored config's file on the Hub)
OTHER_CONFIG_FILES = {"lambada_openai": (r"lambada_test_(de|en|es|fr|it)\.\w+", "lambada_test.jsonl")}


def drop_other_configs(task, files, where):
    """The files of the task's own config (all of them where the task has no such siblings)."""
    if task not in OTHER_CONFIG_FILES:
        return files
    others, own_file = OTHER_CONFIG_FILES[task]
    own = [f for f in files if not re.fullmatch(others, os.path.basename(f))]
    if files and not own:
        raise EvalError(f"{where}: holds only other configs' files for task {task} ({', '.join(files[:6])}); "
                        f"it scores {TASKS[task][1][0]}'s {TASKS[task][1][1]} config: add that file "
                        f"({own_file} on the Hub) or put its rows at {task}.jsonl")
    return own


def names_split(path, split):
    """Whether a data file's path names the split as a word: test-00000-of-00001.parquet, main/test/0000.parquet."""
    return re.search(rf"(^|[/_\-.]){split}([/_\-.]|$)", path) is not None


def local_task_rows(data_dir, task, split=None):
    """Rows of the split the task scores; another split (few-shot examples) only from the folder DIR/<task>/'s
    files whose names name it (DIR/<task>.jsonl and unnamed files are the scored split)."""
    if split not in (None, TASKS[task][1][2]):
        folder = os.path.join(data_dir, task)
        files = sorted(f for f in os.listdir(folder) if f.endswith(DATA_EXTS) and names_split(f, split)) \
            if os.path.isdir(folder) else []
        if not files:
            raise EvalError(f"{data_dir}: no {split} split file for task {task}'s few-shot examples; add "
                            f"{task}/{split}.jsonl there (the Hub dataset's {split} rows; the scored rows then at "
                            f"{task}.jsonl or {task}/{TASKS[task][1][2]}.jsonl), or pass --num-fewshot 0")
        return [r for f in files for r in read_rows(os.path.join(folder, f))]
    for ext in DATA_EXTS:
        p = os.path.join(data_dir, task + ext)
        if os.path.isfile(p):
            return read_rows(p)
    folder = os.path.join(data_dir, task)
    if os.path.isdir(folder):
        files = sorted(f for f in os.listdir(folder) if f.endswith(DATA_EXTS))
        # a Hub snapshot holds every split (train-*, validation-*, test-*): only the task's split is scored
        named = [s for s in SPLIT_NAMES if any(names_split(f, s) for f in files)]
        if named:
            split = TASKS[task][1][2]
            if split not in named:
                raise EvalError(f"{folder}: holds {'/'.join(named)} split files ({', '.join(files[:6])}"
                                f"{', ...' if len(files) > 6 else ''}) but no {split} split, the one task {task} "
                                f"scores; add its {split} file(s) (a name with '{split}' in it) to that folder")
            files = [f for f in files if names_split(f, split)]
        files = drop_other_configs(task, files, folder)
        if files:
            return [r for f in files for r in read_rows(os.path.join(folder, f))]
    raise EvalError(f"{data_dir}: no data file for task {task}; expected {task}.jsonl, {task}.json, "
                    f"{task}.parquet or a folder {task}/ of those there (or drop --data-dir to download)")


def hub_task_rows(task, cache_dir, split=None):
    """Download the task's split (or another: split) from the Hub (parquet) into cache_dir and read it. The files
    downloaded are listed in cache_dir/picaflor_tasks/TASK[-SPLIT].json: offline (or the Hub down), a later run reads
    them from there with a warning (hf_hub_download finds a cached file offline, but the file listing before it is
    never cached)."""
    repo, config, scored = TASKS[task][1]
    split = split or scored
    name = task if split == scored else f"{task}-{split}"
    local = f"{task}.jsonl" if split == scored else f"{task}/{split}.jsonl"  # (the --data-dir file to write instead)
    listing = os.path.join(cache_dir, "picaflor_tasks", f"{name}.json")
    try:
        from huggingface_hub import HfApi, hf_hub_download
        from huggingface_hub.errors import RevisionNotFoundError
        if why := hub_unreachable():  # offline: huggingface_hub retried the listing ~25 s per task before failing
            raise ConnectionError(why)
        api = HfApi()
        # the Hub's auto-converted parquet branch has one layout for every dataset: CONFIG/SPLIT/NNNN.parquet
        revision = "refs/convert/parquet"
        try:
            files = [f for f in api.list_repo_files(repo, repo_type="dataset", revision=revision)
                     if f.startswith(f"{config or 'default'}/{split}/") and f.endswith(".parquet")]
        except RevisionNotFoundError:  # a dataset the Hub never converted has no such branch: its files on main
            files = []
        if not files:  # else the files on main whose path names the config (if any) and the split
            revision = None
            names = api.list_repo_files(repo, repo_type="dataset")
            files = [f for f in names if f.endswith(DATA_EXTS) and names_split(f, split)
                     and (config in (None, "default") or config in f.split("/")[0])]
            files = drop_other_configs(task, files, repo)
        if not files:
            raise EvalError(f"{repo}: no {split} split file found on the Hub; use --data-dir with {local}")
        paths = [hf_hub_download(repo, f, repo_type="dataset", revision=revision, cache_dir=cache_dir)
                 for f in sorted(files)]
    except EvalError:
        raise
    except Exception as e:  # network, auth, missing repo: all mean "get the data another way"
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        paths = cached_task_files(listing, repo)
        if paths is None:
            raise EvalError(f"cannot download {repo} for task {task} ({msg}), and --cache-dir {cache_dir} holds no "
                            f"earlier download of it; check the network or use --data-dir DIR with DIR/{local}") from None
        print(f"warning: cannot reach {repo} ({msg[:120]}); task {task} reads the copy downloaded into "
              f"{cache_dir} earlier", file=sys.stderr)
        return [r for p in paths for r in read_rows(p)]
    try:
        os.makedirs(os.path.dirname(listing), exist_ok=True)
        checkpoint.write_atomic_text(listing, json.dumps(
            {"repo": repo, "revision": revision, "files": [os.path.abspath(p) for p in paths]}, indent=1))
    except OSError:  # a read-only cache: the download still serves this run
        pass
    return [r for p in paths for r in read_rows(p)]


HUB_UNREACHABLE = {}  # endpoint -> why it cannot be reached ("": it can), asked once per process


def hub_unreachable():
    """Why the Hub cannot be reached, from one quick request through huggingface_hub's own session (its proxies;
    HF_HUB_OFFLINE=1 fails it at once), or "" when it can."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session
    if constants.ENDPOINT not in HUB_UNREACHABLE:
        try:
            get_session().head(constants.ENDPOINT, timeout=10)
            HUB_UNREACHABLE[constants.ENDPOINT] = ""
        except Exception as e:  # no DNS, refused, timed out, offline mode: any status back means it is reachable
            HUB_UNREACHABLE[constants.ENDPOINT] = str(e).splitlines()[0] if str(e) else type(e).__name__
    return HUB_UNREACHABLE[constants.ENDPOINT]


def cached_task_files(listing, repo):
    """The files an earlier download of repo listed in listing, if every one is still there; else None."""
    try:
        with open(listing, encoding="utf-8") as f:
            rec = json.load(f)
        paths = rec["files"]
        if rec["repo"] == repo and paths and all(isinstance(p, str) and os.path.isfile(p) for p in paths):
            return paths
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def task_docs(task, lm, args):
    """The task's examples as dicts of requests (loglikelihood kinds) or prompts (generation)."""
    docs = all_task_docs(task, lm, args)
    if TASKS[task][0] == "generate_until":
        check_stop_strings(task, docs)
    return docs


def check_stop_strings(task, docs):
    """A generation's stop strings (`until`) must be a list of non-empty strings: "" is in every text, so it stopped
    each generation at its first token and then crashed the cut (str.split(""): ValueError: empty separator)."""
    for i, d in enumerate(docs):
        until = d.get("until")
        if not isinstance(until, (list, tuple)) or not all(isinstance(u, str) and u for u in until):
            raise EvalError(f"task {task}: example {i}: until={until!r}: stop strings must be a list of non-empty "
                            f"strings; drop the empty one (or use [] for no stop string)")


def all_task_docs(task, lm, args):
    limit = args.limit
    if task == "counting":
        return counting_docs(limit or 100, args.seed)
    if task == "passkey":
        return passkey_docs(lm, passkey_lengths(lm, args.passkey_lengths), limit or args.passkey_n, args.seed)
    rows = local_task_rows(args.data_dir, task) if args.data_dir else hub_task_rows(task, args.cache_dir)
    if len(rows) != SPLIT_ROWS.get(task, len(rows)):  # (a copy cut at a line boundary read as a smaller split)
        repo, _, split = TASKS[task][1]
        print(f"warning: task {task}: {len(rows)} examples, but {repo}'s {split} split has {SPLIT_ROWS[task]}: a "
              f"partial or other copy; its scores are not comparable with published ones", file=sys.stderr)
    docs = build_docs(task, rows[:limit] if limit else rows, "example", args.data_dir)
    if num_fewshot(task, args):
        add_fewshot(task, docs, num_fewshot(task, args), args)
    return docs


def build_docs(task, rows, what, data_dir=None):
    build = TASKS[task][2]
    where = f" in {data_dir}" if data_dir else ""  # (the task named, not whose copy of its data)
    docs = []
    for i, row in enumerate(rows):
        try:
            docs.append(build(row))
        except EvalError as e:
            raise EvalError(f"task {task}: {what} {i}{where}: {e}") from None
        except (KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
            raise EvalError(f"task {task}: {what} {i}{where} does not have the dataset's schema ({type(e).__name__}: "
                            f"{e}); the data file must hold the Hub dataset's own fields") from None
    return docs


def add_fewshot(task, docs, n, args):
    """The harness's few-shot prompts (ConfigurableTask.fewshot_context with the default ContextSampler): one
    random.Random(fewshot seed) per task draws rnd.sample(fewshot split rows, n) for each example in order; each shot
    is its prompt + target_delimiter + its target + fewshot_delimiter, before the example's own prompt (no
    description; the eval doc is excluded only when the fewshot split is the scored one, never here)."""
    _, split, hub_rows = FEWSHOT[task]
    rows = local_task_rows(args.data_dir, task, split) if args.data_dir else hub_task_rows(task, args.cache_dir, split)
    if len(rows) != hub_rows:  # other rows to draw from: other shots than the harness's
        print(f"warning: task {task}: {len(rows)} {split} examples for the few-shot prompts, but the Hub's {split} "
              f"split has {hub_rows}: other shots than the harness's; scores not comparable with published ones",
              file=sys.stderr)
    if len(rows) < n:  # (random.sample's ValueError)
        raise EvalError(f"task {task}: --num-fewshot {n}, but its {split} split has only {len(rows)} examples; "
                        f"pass --num-fewshot {len(rows)} or fewer, or the full {split} split")
    shots = build_docs(task, rows, f"{split} example", args.data_dir)
    rnd = random.Random(args.seed)
    for d in docs:
        d["prompt"] = "".join(s["prompt"] + TARGET_DELIMITER + s["target"] + FEWSHOT_DELIMITER
                              for s in rnd.sample(shots, n)) + d["prompt"]


def passkey_lengths(lm, spec):
    if spec:
        lengths = [int(x) for x in spec.split(",")]
    else:  # 4K, 8K, ... doubling, and the model's context itself (alone if it is under 4K)
        lengths, n = [], 4096
        while n <= lm.max_length:
            lengths.append(n)
            n *= 2
        if not lengths or lengths[-1] != lm.max_length:
            lengths.append(lm.max_length)
    too_long = [n for n in lengths if n > lm.max_length]
    if too_long:
        raise EvalError(f"--passkey-lengths {too_long} exceed the model's context of {lm.max_length} tokens; pass "
                        f"lengths up to {lm.max_length}")
    return lengths
