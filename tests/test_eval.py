"""
eval.py against lm-evaluation-harness itself, on tiny models and small task files written here (no network):
- a tiny GPT-2-style transformers model: lm-eval's own HF backend (HFLM) vs eval.py, all 7 tasks;
- a tiny picaflor checkpoint: lm-eval's evaluator with a naive one-request-at-a-time LM wrapper vs eval.py's
  batched / shared-context path;
per-request log-likelihoods within 1e-4, identical greedy flags, identical metrics and stderrs. lm-eval reads
the installed harness's own task YAMLs with only the dataset source changed (bench/eval_speed.py helpers).
Plus: generation ignores a shipped repetition penalty, passkey per length, bad input, --compare, Hub layout.
"""

import json
import math
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ["DISABLE_MULTIPROC"] = "1"  # the harness's bootstrap in-process (same numbers as its pool)

import eval as ev  # noqa: E402
import eval_tasks as et  # noqa: E402
import eval_speed as es  # noqa: E402

ALL_TASKS = ["lambada_openai", "piqa", "winogrande", "arc_easy", "arc_challenge", "openbookqa", "hellaswag"]
N_DOCS = 6
BOOT = 500  # bootstrap resamples for the perplexity stderr, the same in both


def metric_rows(results):
    return {k: v for k, v in results.items() if k != "n"}


def assert_same_as_harness(ref, ours, tasks):
    """ref: lm_eval.simple_evaluate output; ours: {task: (docs, results)}."""
    for t in tasks:
        samples = sorted(ref["samples"][t], key=lambda s: s["doc_id"])
        docs, results = ours[t]
        assert len(samples) == len(docs) == results[t]["n"]
        for s, d in zip(samples, docs):
            assert [tuple(a[:2]) for a in s["arguments"]] == [tuple(r) for r in d["requests"]], t
            ref_ll = [float(r[0][0]) for r in s["resps"]]
            ref_greedy = [bool(r[0][1]) for r in s["resps"]]
            assert max(abs(a - b) for a, b in zip(ref_ll, d["lls"])) <= 1e-4, (t, ref_ll, d["lls"])
            assert ref_greedy == d["greedy"], t
        for m, v in metric_rows(results[t]).items():
            key = f"{m.replace('_stderr', '')},none" if not m.endswith("_stderr") else f"{m[:-7]}_stderr,none"
            assert key in ref["results"][t], (t, key)
            want = ref["results"][t][key]
            if m.startswith("perplexity"):
                assert v == pytest.approx(want, rel=1e-4), (t, m)
            else:
                assert v == pytest.approx(want, abs=1e-9), (t, m)


@pytest.fixture(scope="module")
def hf_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    os.environ["HF_DATASETS_CACHE"] = str(tmp / "hf_datasets")
    model_dir = es.make_tiny_hf_model(str(tmp / "model"), vocab_size=300, d_model=32, n_layer=2, n_positions=256)
    data_dir = es.write_task_data(str(tmp / "data"), ALL_TASKS + ["gsm8k"], N_DOCS)
    yaml_dir = es.write_lm_eval_tasks(str(tmp / "tasks"), data_dir, ALL_TASKS)
    return tmp, model_dir, data_dir, yaml_dir


def test_parity_with_lm_eval_hf_backend(hf_setup):
    from lm_eval.models.huggingface import HFLM
    tmp, model_dir, data_dir, yaml_dir = hf_setup
    ref = es.run_lm_eval(HFLM(pretrained=model_dir, device="cpu", batch_size=4, dtype="float32"), yaml_dir,
                         ALL_TASKS, bootstrap_iters=BOOT)
    # batch size 4 rows: several batches per task, left-padded shared contexts of different lengths
    args = ev.parse_args([model_dir, "--data-dir", data_dir, "--device", "cpu", "--batch-size", "4",
                          "--bootstrap-iters", str(BOOT)])
    lm = ev.load_model(model_dir, "cpu", "float32")
    ours = {t: ev.run_task(lm, t, args)[:2] for t in ALL_TASKS}
    assert_same_as_harness(ref, ours, ALL_TASKS)
    # the data exercises the edge cases: ARC numeric labels, OBQA leading-space keys, trailing-space contexts
    assert any(d["requests"][0][0].endswith(" ") for d in ours["openbookqa"][0])
    assert {d["gold"] for d in ours["arc_easy"][0]} and ours["lambada_openai"][1]["lambada_openai"]["n"] == N_DOCS


class NaiveLM:
    """lm-eval LM around a picaflor model: one request per forward, the harness's own truncation rule."""

    def __new__(cls, model, tok):
        from lm_eval.api.model import TemplateLM

        class _LM(TemplateLM):
            def __init__(self):
                super().__init__()

            @property
            def eot_token_id(self):
                return tok.bos_id

            @property
            def prefix_token_id(self):
                return tok.bos_id

            def tok_encode(self, string, add_special_tokens=None, **kw):
                ids = tok.encode(string)
                return ids if add_special_tokens is False else [tok.bos_id] + ids

            def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kw):
                out = []
                for _, ctx, cont in requests:
                    inp = (ctx + cont)[-(model.cfg.max_seq_len + 1):][:-1]
                    with torch.no_grad():
                        lp = torch.log_softmax(model(torch.tensor([inp]))[0].float(), -1)[-len(cont):]
                    tgt = torch.tensor(cont)
                    out.append((float(lp.gather(1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all())))
                return out

            def loglikelihood_rolling(self, requests, disable_tqdm=False):
                raise NotImplementedError

            def generate_until(self, requests, disable_tqdm=False):
                raise NotImplementedError

        return _LM()


def make_picaflor_ckpt(tmp, max_seq_len=256):
    import model as picaflor
    import tokenizer
    tok = tokenizer.train_tokenizer(es.corpus(), 320)
    tok_path = tok.save(str(tmp / "tok.json"))
    cfg = picaflor.ModelConfig(vocab_size=tok.vocab_size, n_layer=2, n_dense_layers=1, d_model=32, n_head=4,
                               n_kv_head=2, dense_ffn=64, n_experts=4, expert_ffn=16, n_shared=1, top_k=2,
                               max_seq_len=max_seq_len)
    torch.manual_seed(0)
    m = picaflor.Picaflor(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2 and "gate.weight" not in name:
                p.normal_(0.0, 0.1)
    picaflor.save_checkpoint(m, str(tmp / "run"), 1, tokenizer_file=tok_path)
    return str(tmp / "run"), tok


def test_parity_picaflor_checkpoint_with_lm_eval(hf_setup, tmp_path):
    import model as picaflor
    _, _, data_dir, yaml_dir = hf_setup
    run_dir, tok = make_picaflor_ckpt(tmp_path)
    tasks = ["lambada_openai", "piqa", "winogrande", "hellaswag"]
    ref = es.run_lm_eval(NaiveLM(picaflor.load_checkpoint(run_dir), tok), yaml_dir, tasks, bootstrap_iters=BOOT)
    out = tmp_path / "out"
    assert ev.main([run_dir, "--tasks", ",".join(tasks), "--data-dir", data_dir, "--device", "cpu",
                    "--batch-size", "3", "--bootstrap-iters", str(BOOT), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_kind"] == "picaflor" and summary["sampling"]["repetition_penalty"] == 1.0
    assert set(summary) >= {"results", "model", "harness_version", "seed", "dtype", "sampling"}
    ours = {}
    for t in tasks:
        recs = [json.loads(line) for line in (out / f"{t}.jsonl").read_text().splitlines()]
        docs = [{"requests": r["requests"], "lls": r["loglikelihoods"], "greedy": r["is_greedy"]} for r in recs]
        ours[t] = (docs, summary["results"])
        assert all("gold" in r and "pred" in r for r in recs) or t == "lambada_openai"
    assert_same_as_harness(ref, ours, tasks)
    assert "| piqa | acc |" in (out / "results.md").read_text()


def test_shared_context_path_equals_flat_path(hf_setup, tmp_path):
    """The KV-reuse path (picaflor: one context length per batch) gives the flat path's numbers."""
    _, _, data_dir, _ = hf_setup
    run_dir, _ = make_picaflor_ckpt(tmp_path)
    lm = ev.load_model(run_dir, "cpu", "float32")
    args = ev.parse_args([run_dir, "--data-dir", data_dir])
    docs = et.task_docs("hellaswag", lm, args)
    ev.loglikelihoods(lm, docs, batch_size=8)
    shared = [list(d["lls"]) for d in docs]
    reqs = []
    cache = {}
    for i, d in enumerate(docs):
        for j, (c, x) in enumerate(d["requests"]):
            reqs.append(((i, j), *ev.encode_pair(lm, c, x, cache)))
    out = {}
    ev.score_flat(lm, reqs, out, 5, 10 ** 6)
    flat = [[out[(i, j)][0] for j in range(len(d["requests"]))] for i, d in enumerate(docs)]
    assert max(abs(a - b) for x, y in zip(shared, flat) for a, b in zip(x, y)) <= 1e-4


def test_shared_context_batch_near_the_context_limit(tmp_path):
    """HF shared-context path: a question whose context + continuations just fit the model's context, batched with
    one whose continuations are longer, got position ids past the last position for its padded continuation
    columns: a GPT-2-style model (learned positions: Cerebras-GPT) raised IndexError (a device assert on CUDA); a
    dynamic-RoPE model could rescale every row's rotary frequencies. Now it gives the flat path's numbers."""
    model_dir = es.make_tiny_hf_model(str(tmp_path / "m"), vocab_size=300, d_model=32, n_layer=2, n_positions=32)
    lm = ev.load_model(model_dir, "cpu", "float32")
    groups = [([5] * 30, [((0, 0), [7, 8]), ((0, 1), [9, 10, 11])]),  # 30 + 3 - 1 = 32 positions: fits exactly
              ([5, 6], [((1, 0), [7] * 10), ((1, 1), [8] * 12)])]  # the batch's continuations: 11 columns
    shared, flat = {}, {}
    ev.score_shared_prefix(lm, groups, shared, 32, 10 ** 6)
    ev.score_flat(lm, [(idx, ctx, cont) for ctx, conts in groups for idx, cont in conts], flat, 1, 10 ** 6)
    assert set(shared) == set(flat)
    for k in flat:
        assert shared[k][0] == pytest.approx(flat[k][0], abs=1e-4) and shared[k][1] == flat[k][1], k


def test_bootstrap_and_mean_stderr_match_harness():
    from lm_eval.api import metrics as hm
    rng = torch.Generator().manual_seed(0)
    lls = (-torch.rand(37, generator=rng, dtype=torch.float64) * 8).tolist()
    want = hm.bootstrap_stderr(hm.perplexity, lls, iters=3000)
    assert ev.bootstrap_perplexity_stderr(lls, 3000) == pytest.approx(want, rel=1e-9)
    accs = [float(x > -4) for x in lls]
    assert ev.mean_stderr(accs) == pytest.approx(hm.mean_stderr(accs), rel=1e-12)



def test_aggregate_is_the_harness_s_on_the_same_scores_edge_log_likelihoods_included():
    """The same per-request (log-likelihood, is_greedy) through the installed harness's process_results, its task
    YAMLs' aggregations and stderr_for_metric vs eval.py's doc_scores + aggregate. Where the harness has a number,
    the same number: a mean log-likelihood of -709.5 (perplexity 1.35e308) was inf here and a NaN log-likelihood
    (NaN logits) was perplexity inf where the harness says nan. Where it has N/A, None; where its perplexity crashes
    (OverflowError) inf; a non-finite perplexity or a resample past float range (its nan, inf or crash): None."""
    import types
    import warnings
    import yaml
    from lm_eval.api import metrics as hm
    from lm_eval.api.registry import get_aggregation
    from lm_eval.api.task import ConfigurableTask
    tasks_dir = os.path.join(os.path.dirname(__import__("lm_eval").__file__), "tasks")
    yamls = {"lambada_openai": "lambada/lambada_openai.yaml", "piqa": "piqa/piqa.yaml"}
    rnd = __import__("random").Random(0)
    nan, inf = float("nan"), float("inf")

    def harness(task, docs, iters):
        cfg = yaml.safe_load(open(os.path.join(tasks_dir, yamls[task])))
        aggs = {m["metric"]: get_aggregation(m["aggregation"]) for m in cfg["metric_list"]}
        kind = "loglikelihood" if task == "lambada_openai" else "multiple_choice"
        task_self = types.SimpleNamespace(
            OUTPUT_TYPE=kind, config=types.SimpleNamespace(process_results=None),
            _metric_fn_list=dict.fromkeys(aggs), multiple_input=False, multiple_target=False,
            doc_to_choice=lambda doc: doc["choices"], doc_to_target=lambda doc: doc["gold"])
        rows = [ConfigurableTask.process_results(task_self, d, list(zip(d["lls"], d["greedy"]))) for d in docs]
        out = {}
        for m, agg in aggs.items():
            items = [r[m] for r in rows]
            try:
                out[m] = agg(items)
            except OverflowError:
                out[m] = "OverflowError"
            se_fn = hm.stderr_for_metric(agg, iters)
            try:
                out[m + "_stderr"] = se_fn(items) if se_fn and len(items) > 1 else "N/A"
            except OverflowError:
                out[m + "_stderr"] = "OverflowError"
        return out

    def mc(n, lls=None):
        return [{"lls": lls or [-rnd.uniform(0, 20) for _ in range(4)], "greedy": [False] * 4,
                 "choices": ["x" * rnd.randint(1, 9) for _ in range(4)], "gold": rnd.randrange(4)} for _ in range(n)]

    def ll(n, value=None):
        return [{"lls": [-rnd.uniform(0, 12) if value is None else value(i)], "greedy": [rnd.random() < 0.4]}
                for i in range(n)]

    cases = [("piqa", mc(30)), ("piqa", mc(1)), ("piqa", mc(6, [-3.0] * 4)), ("piqa", mc(6, [-inf, -2.0, -3, -4])),
             ("piqa", mc(6, [-inf] * 4)), ("piqa", mc(6, [-1.0, nan, -3, -4])), ("lambada_openai", ll(30)),
             ("lambada_openai", ll(1)), ("lambada_openai", ll(5, lambda i: -inf if i == 2 else -1.0)),
             ("lambada_openai", ll(5, lambda i: nan if i == 2 else -1.0)), ("lambada_openai", ll(4, lambda i: -800.0)),
             ("lambada_openai", ll(4, lambda i: -709.5))]
    for task, docs in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            want = harness(task, docs, 300)
            for d in docs:
                d["scores"] = ev.doc_scores(task, d)
            got = ev.aggregate(task, docs, 300)
        assert set(got) == set(want) | {"n"} and got["n"] == len(docs), (task, got)
        for k, w in want.items():
            g = got[k]
            if w == "N/A" or (k == "perplexity_stderr" and not (isinstance(w, float) and math.isfinite(w))):
                assert g is None, (task, k, g, w)
            elif w == "OverflowError":
                assert g == inf, (task, k, g)
            elif math.isnan(w):
                assert math.isnan(g), (task, k, g)
            else:
                assert g == pytest.approx(w, rel=1e-9), (task, k, g, w)
    assert ev.bootstrap_perplexity_stderr([-1.0, -2.0, -3.0], 1) is None  # (the harness: ZeroDivisionError)


def test_gsm8k_scores_are_the_harness_filters_and_exact_match():
    """gsm8k's strict-match / flexible-extract regex filters then exact_match (ignore_case, regexes_to_ignore), run by
    the installed harness's own code, on generations that hit each rule: no match, several, $ and , and a final '.'."""
    import yaml
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter
    cfg = yaml.safe_load(open(os.path.join(os.path.dirname(__import__("lm_eval").__file__), "tasks", "gsm8k",
                                           "gsm8k.yaml")))
    em = next(m for m in cfg["metric_list"] if m["metric"] == "exact_match")
    kw = {k: em[k] for k in ("ignore_case", "ignore_punctuation", "regexes_to_ignore")}
    filters = {f["name"]: RegexFilter(regex_pattern=f["filter"][0]["regex_pattern"],
                                      group_select=f["filter"][0].get("group_select", 0)) for f in cfg["filter_list"]}
    gens = ["The answer is 18.\n#### 18", "so $1,234.50 total", "#### -3.", "no numbers here", "x 12 y 7.5.",
            "#### 1,000\nQuestion:", "it is 42", "$5", "-7 apples", "#### 18 and 19", "#### 7.5"]
    for target in ("Natalia sold 18.\n#### 18", "#### 1000", "#### -7", "#### 7.5", "#### 42", "#### -3", "#### 5",
                   "#### 1234.50"):
        for g in gens:
            want = {f"exact_match_{name.split('-')[0]}": exact_match_hf_evaluate(
                [list(f.apply([[g]], [None]))[0][0]], [target], **kw)["exact_match"] for name, f in filters.items()}
            assert et.gsm8k_scores(g, target) == want, (g, target)

def test_generation_ignores_shipped_repetition_penalty(hf_setup, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _, _, data_dir, _ = hf_setup
    clean = es.make_tiny_hf_model(str(tmp_path / "clean"), vocab_size=300, d_model=32, n_layer=2, n_positions=256)
    penal = es.make_tiny_hf_model(str(tmp_path / "penal"), vocab_size=300, d_model=32, n_layer=2, n_positions=256,
                                  generation_config={"repetition_penalty": 1.3})
    outs = {}
    for name, d in (("clean", clean), ("penal", penal)):
        assert ev.main([d, "--tasks", "counting,gsm8k", "--limit", "3", "--max-gen-toks", "24", "--data-dir", data_dir, "--device", "cpu",
                        "--num-fewshot", "0", "--out", str(tmp_path / f"out_{name}")]) == 0
        outs[name] = {t: [json.loads(x) for x in (tmp_path / f"out_{name}" / f"{t}.jsonl").read_text().splitlines()]
                      for t in ("counting", "gsm8k")}
    err = capsys.readouterr().err
    assert "WARNING" in err and "repetition_penalty" in err and err.count("IGNORES") == 1
    for t in ("counting", "gsm8k"):
        assert [r["generation"] for r in outs["clean"][t]] == [r["generation"] for r in outs["penal"][t]]
        assert [r["scores"] for r in outs["clean"][t]] == [r["scores"] for r in outs["penal"][t]]
    s_pen = json.loads((tmp_path / "out_penal" / "summary.json").read_text())
    s_cln = json.loads((tmp_path / "out_clean" / "summary.json").read_text())
    assert s_pen["results"] == s_cln["results"]
    assert s_pen["sampling"]["ignored_model_settings"] == {"repetition_penalty": 1.3}
    # the trap is real for this model: HF's generate with the shipped config decodes differently
    tok = AutoTokenizer.from_pretrained(penal)
    m = AutoModelForCausalLM.from_pretrained(penal).eval()
    differs = False
    for r in outs["penal"]["counting"]:
        ids = torch.tensor([tok.encode(r["prompt"])])
        gen = m.generate(ids, max_new_tokens=20, pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
        ours = tok.encode(r["generation"]) if r["generation"] else []
        differs |= gen[:len(ours)].tolist() != ours[:len(gen)] or not ours
    assert differs


def test_int4_engine_generation_stops_where_the_batched_loop_does():
    """The int4 engine's path stops at a stop token (it glued the text after <|end|> onto the answer) and at a stop
    string, as eval.py's own loop does."""
    class Engine:
        def __init__(self, out):
            self.out, self.closed = out, False

        def stream(self, ids, n, temperature=0):
            try:
                yield from self.out[:n]
            finally:
                self.closed = True

    class LM:  # eval.py's engine wrapper, minus the model: token i decodes to words[i]
        words = ["", " The", " answer", " is", " 12.", "<|end|>", " 99", " bottles", "\n\n"]
        stop_ids, max_length = {5}, 64

        def encode(self, text):
            return [1, 2]

        def decode(self, ids):
            return "".join(self.words[i] for i in ids)
    lm = LM()
    lm.engine = Engine([1, 2, 3, 4, 5, 6, 7])
    assert ev.greedy_generate(lm, "Q", ["\n\n"], 16) == " The answer is 12."
    assert lm.engine.closed  # the engine's request ended (its cache settled) although not every token was taken
    lm.engine = Engine([1, 2, 8, 6, 7])
    assert ev.greedy_generate(lm, "Q", ["\n\n"], 16) == " The answer"


def test_hf_stop_ids_include_the_generation_configs_eos_list(tmp_path):
    """export.py's generation_config lists <|end|> and <|bos|>: eval.py's HF path stops at both, as HF's generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = es.make_tiny_hf_model(str(tmp_path / "m"), vocab_size=300, d_model=32, n_layer=2, n_positions=64,
                              generation_config={"eos_token_id": [7, 9]})
    lm = ev.HFModel(AutoModelForCausalLM.from_pretrained(d), AutoTokenizer.from_pretrained(d), "m", "cpu")
    assert {7, 9} <= lm.stop_ids


def test_passkey_reported_per_length(tmp_path, monkeypatch):
    run_dir, tok = make_picaflor_ckpt(tmp_path, max_seq_len=1024)
    out = tmp_path / "out"
    caps, real = [], ev.greedy_generate
    monkeypatch.setattr(ev, "greedy_generate", lambda lm, p, until, n: caps.append(n) or real(lm, p, until, n))
    # --max-gen-toks caps each task's own length: it replaced passkey's 10, and the longer reservation's left
    # truncation cut the needle out of the prompt
    assert ev.main([run_dir, "--tasks", "passkey", "--passkey-lengths", "384,512", "--limit", "2", "--device", "cpu",
                    "--out", str(out), "--max-gen-toks", "128"]) == 0
    assert caps == [10] * 4
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["results"]) == {"passkey@384", "passkey@512"}
    assert all(r["n"] == 2 and 0.0 <= r["acc"] <= 1.0 for r in summary["results"].values())
    recs = [json.loads(x) for x in (out / "passkey.jsonl").read_text().splitlines()]
    for r in recs:
        n_tok = len(tok.encode(r["prompt"])) + 1
        assert r["length"] - 64 <= n_tok <= r["length"] - 10, (r["length"], n_tok)
        assert r["target"] in r["prompt"] and len(r["target"]) == 5
    # default lengths: 4K doubling up to the context, and the context itself when it is below 4K
    lm = ev.load_model(run_dir, "cpu", "float32")
    # a model may emit ids no text maps to (reserved 0, unused top ids): dropped with the specials, as its HF export's
    # tokenizer decodes (test_generated_text_is_the_same_from_a_checkpoint_its_container_and_its_hf_export)
    assert lm.decode([0, 72, tok.bos_id, 0]) == tok.decode([72])
    assert et.passkey_lengths(lm, None) == [1024]
    lm.max_length = 10000
    assert et.passkey_lengths(lm, None) == [4096, 8192, 10000]
    assert ev.main([run_dir, "--tasks", "passkey", "--passkey-lengths", "4096", "--device", "cpu"]) == 2
    assert ev.main([run_dir, "--tasks", "passkey", "--passkey-lengths", "64", "--device", "cpu"]) == 2


def test_passkey_on_a_context_too_short_for_it_says_so(tmp_path, capsys):
    """max_seq_len 64: it said to pass --passkey-lengths of at least ~100, which the next run refused (over 64)."""
    run_dir, _ = make_picaflor_ckpt(tmp_path, max_seq_len=64)
    assert ev.main([run_dir, "--tasks", "passkey", "--limit", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "this model's is 64: leave passkey out of --tasks" in err and "--passkey-lengths" not in err, err


def test_bad_input_one_line_errors(hf_setup, tmp_path, capsys):
    _, model_dir, data_dir, _ = hf_setup
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ([model_dir, "--tasks", "piqa,nosuchtask", "--data-dir", data_dir], "unknown task 'nosuchtask'"),
        ([model_dir, "--tasks", "piqa", "--data-dir", str(empty)], "no data file for task piqa"),
        ([str(empty), "--tasks", "piqa", "--data-dir", data_dir], "neither a Hugging Face model dir"),
        ([str(tmp_path / "nope"), "--tasks", "piqa"], "no such file or directory"),
        (["--compare", str(tmp_path / "missing.json")], "missing.json: no such file"),
    ]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "piqa.jsonl").write_text('{"goal": "x"}\n')
    cases.append(([model_dir, "--tasks", "piqa", "--data-dir", str(bad)],
                  f"example 0 in {bad} does not have the dataset's schema"))  # (which copy: it named none)
    unlabelled = tmp_path / "unlabelled"  # PIQA's test split: label -1 on every row (was scored as acc 0.0)
    unlabelled.mkdir()
    rows = [json.loads(line) for line in open(os.path.join(data_dir, "piqa.jsonl"))]
    (unlabelled / "piqa.jsonl").write_text("".join(json.dumps({**r, "label": -1}) + "\n" for r in rows))
    afile = tmp_path / "afile"
    afile.write_text("x")
    no_rows = tmp_path / "no_rows"  # it said "empty data file or --limit 0", and --limit 0 is refused before
    no_rows.mkdir()
    (no_rows / "piqa.jsonl").write_text("")
    cases.append(([model_dir, "--tasks", "piqa", "--data-dir", str(no_rows)], "put its rows in the task's file"))
    junk = tmp_path / "junk.pcf4"  # a file that is no container: it said what is wrong, not what to do
    junk.write_bytes(b"x" * 4096)
    cases.append(([str(junk), "--tasks", "piqa", "--data-dir", data_dir], "; else evaluate its checkpoint dir"))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    worded = tmp_path / "worded.json"
    worded.write_text('{"results": {"piqa": {"acc": "high"}}}')
    bare = tmp_path / "bare.json"  # a number where the metrics dict belongs: a TypeError in the table
    bare.write_text('{"results": {"piqa": 0.5}}')
    numeric = tmp_path / "numeric"  # a gsm8k answer that is not text: a TypeError after the generation
    numeric.mkdir()
    (numeric / "gsm8k.jsonl").write_text('{"question": "1+1?", "answer": 2}\n')
    import shutil
    broken = tmp_path / "broken_hf"  # a transformers dir whose weights file was cut short
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    cases += [([model_dir, "--tasks", "piqa", "--data-dir", str(unlabelled)], f"in {unlabelled}: gold label"),
              ([model_dir, "--tasks", "piqa", "--data-dir", data_dir, "--limit", "0"], "--limit 0"),
              ([model_dir, "--tasks", "piqa", "--data-dir", data_dir, "--out", str(afile)], "is not a folder"),
              ([model_dir, "--tasks", "passkey", "--passkey-lengths", "100,abc"], "--passkey-lengths"),
              ([model_dir, "--tasks", "passkey", "--passkey-lengths", "48,"], "--passkey-lengths"),
              (["--compare", str(listed)], "not an eval.py summary.json"),
              (["--compare", str(worded)], "is not a number"),
              (["--compare", str(bare)], "is not a dict of metrics"),
              ([model_dir, "--tasks", "gsm8k", "--data-dir", str(numeric), "--num-fewshot", "0"],
               "does not have the dataset's schema"),
              ([model_dir, "--tasks", "gsm8k", "--max-gen-toks", "0"], "--max-gen-toks 0: at least 1"),
              ([str(broken), "--tasks", "piqa", "--data-dir", data_dir], "cannot load as a transformers model"),
              ([model_dir, "--tasks", "piqa", "--data-dir", data_dir, "--device", "gpu"], "--device gpu: use cpu, cuda or cuda:N"),
              # the prompt was cut to its last token to make room for 256 new ones: scores of nothing
              ([model_dir, "--tasks", "gsm8k", "--data-dir", data_dir, "--max-gen-toks", "100000", "--num-fewshot", "0"],
               "leaves no room"),
              ([model_dir, "--tasks", ",", "--data-dir", data_dir], "no task named"),
              ([model_dir, "--tasks", "piqa", "--data-dir", data_dir, "--bootstrap-iters", "-1"], "--bootstrap-iters -1"),
              ([model_dir, "--tasks", "piqa", "--data-dir", data_dir, "--bootstrap-iters", "1"], "--bootstrap-iters 1"),
              ([model_dir, "--tasks", "piqa", "--data-dir", data_dir, "--out", str(afile / "sub")], "cannot write")]
    if not torch.cuda.is_available():  # a pin_memory traceback
        cases.append(([model_dir, "--tasks", "piqa", "--data-dir", data_dir, "--device", "cuda"], "no CUDA GPU is visible"))
    for argv, msg in cases:
        assert ev.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and msg in errors[0] and err.endswith(errors[0]) and "Traceback" not in err, err


def test_auto_dtype_is_bfloat16_on_any_cuda_device():
    """--dtype auto: bfloat16 on cuda and cuda:N (a torch.device too), float32 on the CPU; a dtype named is that dtype
    on either (eval.py's only CUDA-only choice besides the device check: test_bad_input_one_line_errors' cases)."""
    assert ev.resolve_dtype("auto", "cuda") == ev.resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert ev.resolve_dtype("auto", "cpu") == torch.float32 and ev.resolve_dtype("auto", torch.device("cuda", 0)) == \
        torch.bfloat16
    assert ev.resolve_dtype("float32", "cuda") == torch.float32 and ev.resolve_dtype("float16", "cpu") == torch.float16


def test_out_the_same_folder_as_data_dir_never_replaces_the_task_data(hf_setup, tmp_path, capsys):
    """--out DIR --data-dir DIR wrote piqa's per-example results over DIR/piqa.jsonl, the task's data (a second run
    then read the results as data)."""
    _, model_dir, data_dir, _ = hf_setup
    both = tmp_path / "both"
    both.mkdir()
    (both / "piqa.jsonl").write_bytes(open(os.path.join(data_dir, "piqa.jsonl"), "rb").read())
    before = (both / "piqa.jsonl").read_bytes()
    assert ev.main([model_dir, "--tasks", "piqa", "--limit", "2", "--data-dir", str(both), "--out", f"{both}/"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --out {both}/: is --data-dir, and the results would replace {both}/piqa.jsonl; pass "
                   f"another --out")
    assert (both / "piqa.jsonl").read_bytes() == before and sorted(os.listdir(both)) == ["piqa.jsonl"]


def test_a_mistyped_local_path_is_not_tried_on_the_hub(tmp_path, monkeypatch, capsys):
    """out/nope (owner/name in shape, its owner a folder here) was tried as a Hub repo: ~50 s of retries offline,
    then 'cannot connect'. It is a local path that does not exist, said at once."""
    import time
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    t0 = time.time()
    assert ev.main(["out/nope", "--tasks", "piqa"]) == 2
    err = capsys.readouterr().err
    assert "out/nope: no such file or directory" in err and time.time() - t0 < 10 and "Retrying" not in err


def test_finished_tasks_are_written_when_a_later_one_fails(hf_setup, tmp_path, capsys):
    """summary.json and results.md were written only after the last task: a missing file, a failed download or
    Ctrl-C in a later task lost every finished one."""
    _, model_dir, data_dir, _ = hf_setup
    only_piqa = tmp_path / "only_piqa"
    only_piqa.mkdir()
    (only_piqa / "piqa.jsonl").write_text(open(os.path.join(data_dir, "piqa.jsonl")).read())
    out = tmp_path / "res"
    assert ev.main([model_dir, "--tasks", "piqa,arc_easy", "--data-dir", str(only_piqa), "--out", str(out)]) == 2
    assert "no data file for task arc_easy" in capsys.readouterr().err
    summary = json.load(open(out / "summary.json"))
    assert list(summary["results"]) == ["piqa"] and summary["tasks_done"] == ["piqa"]
    assert "piqa" in (out / "results.md").read_text()
    # a run that fails before writing a file leaves no empty --out behind (folders it made); one that was there stays
    made = tmp_path / "new" / "res"
    assert ev.main([model_dir, "--tasks", "arc_easy", "--data-dir", str(only_piqa), "--out", str(made)]) == 2
    assert "no data file for task arc_easy" in capsys.readouterr().err and not (tmp_path / "new").exists()
    there = tmp_path / "there"
    there.mkdir()
    assert ev.main([model_dir, "--tasks", "arc_easy", "--data-dir", str(only_piqa), "--out", str(there)]) == 2
    assert there.is_dir() and out.is_dir()


def test_compare_marks_noise(tmp_path, capsys):
    def summary(name, acc, se):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"model": name, "results": {"piqa": {"acc": acc, "acc_stderr": se, "n": 100},
                                                            "arc_easy": {"acc": acc, "acc_stderr": se, "n": 100}}}))
        return str(p)
    a, b, c = summary("A", 0.60, 0.02), summary("B", 0.62, 0.02), summary("C", 0.75, 0.02)
    assert ev.main(["--compare", a, b, c]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("| piqa | acc |"))
    assert "| A | B | C |" in table and "+0.0200 ~" in row and "+0.1500 *" in row
    z1, z2 = summary("Z1", 1.0, 0.0), summary("Z2", 1.0, 0.0)  # identical, stderr 0 (all right): within noise
    assert ev.main(["--compare", z1, z2]) == 0
    assert "+0.0000 ~" in capsys.readouterr().out
    # a difference has the decimals of the values beside it (1281.5 ± 40.0 vs 1600.3 ± 50.0 read "+318.8738 *"), and a
    # stderr its value's ("1281.5 ± 40.0000": a precision the value does not claim; 999.5 ± 1500.0 the other way)
    ppl = [tmp_path / f"ppl{i}.json" for i in (1, 2, 3)]
    for p, v, se in zip(ppl, (1281.5, 1600.3738, 999.5), (40.0, 50.0, 1500.0)):
        p.write_text(json.dumps({"model": p.stem, "results": {"wikitext": {"perplexity": v, "perplexity_stderr": se,
                                                                           "n": 50}}}))
    assert ev.main(["--compare", *map(str, ppl)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| wikitext | perplexity |"))
    assert row.endswith("| 1281.5 ± 40.0 | 1600.4 ± 50.0 (+318.9 *) | 999.5000 ± 1500.0000 (-282.0 ~) |"), row
    table = ev.markdown_table(json.loads(ppl[0].read_text()))  # results.md: the same decimals (it wrote 40.0000)
    assert "| wikitext | perplexity | 1281.5 | 40.0 | 50 |" in table, table
    partial = tmp_path / "P.json"  # the first column lacks arc_easy: that row compares nothing (B was its reference)
    partial.write_text(json.dumps({"model": "P", "results": {"piqa": {"acc": 0.6, "acc_stderr": 0.02, "n": 100}}}))
    assert ev.main(["--compare", str(partial), b, c]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| arc_easy | acc |"))
    assert row.startswith("| arc_easy | acc | - | 0.6200") and "~" not in row and "*" not in row, row
    # one run dir scored twice, the second with --limit 3: two columns told apart, and no "within noise" verdict
    # between 100 examples and 3 (it printed "0.3333 ± 0.3333 (-0.1310 ~)" under two identical headers)
    lim = tmp_path / "L.json"
    lim.write_text(json.dumps({"model": "A", "limit": 3, "model_source": "/runs/a/step_0000300",
                               "results": {"piqa": {"acc": 1 / 3, "acc_stderr": 1 / 3, "n": 3}}}))
    assert ev.main(["--compare", a, str(lim)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| piqa | acc |"))
    assert "| A [1] | A [2] |" in out and "(n=3 vs 100 !)" in row and "~" not in row and "*" not in row, row
    assert f"- A [2]: {lim}: /runs/a/step_0000300" in out and "limit 3" in out
    # synthetic tasks alone read no data: said so, not "data hub" (a download that never was)
    made = tmp_path / "S.json"
    made.write_text(json.dumps({"model": "S", "data": "hub", "seed": 7, "results": {
        "counting": {"exact_match": 0.5, "exact_match_stderr": 0.1, "n": 20},
        "passkey@512": {"acc": 1.0, "acc_stderr": 0.0, "n": 4}}}))
    assert ev.main(["--compare", str(made), a]) == 0
    out = capsys.readouterr().out
    assert f"- S: {made}: ?, data generated (seed 7)," in out and "- A: " in out and "data ?," in out, out


def test_compare_names_each_columns_model_kind(tmp_path, capsys):
    """A checkpoint and its int4 container scored on the dequantised path were told apart only by their paths: both
    columns said "dtype float32"; summary.json's model_kind (int4 (dequantized), picaflor, hf) was not shown."""
    paths = []
    for name, kind in (("ck", "picaflor"), ("q", "int4 (dequantized)")):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"model": name, "model_kind": kind, "dtype": "float32",
                                 "results": {"piqa": {"acc": 0.6, "acc_stderr": 0.02, "n": 100}}}))
        paths.append(str(p))
    assert ev.main(["--compare", *paths]) == 0
    out = capsys.readouterr().out
    assert f"- ck: {paths[0]}: ?, picaflor, data ?," in out and f"- q: {paths[1]}: ?, int4 (dequantized), data" in out


def test_a_reader_that_leaves_is_no_traceback(tmp_path):
    """`eval.py --compare A B | head -1` (and scoring piped into head) ended in a BrokenPipeError traceback."""
    import subprocess
    p = tmp_path / "A.json"
    p.write_text(json.dumps({"model": "A", "results": {"piqa": {"acc": 0.6, "acc_stderr": 0.02, "n": 100}}}))
    r = subprocess.run(f"{sys.executable} {os.path.join(ROOT, 'eval.py')} --compare {p} {p} | true", shell=True,
                       capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr[-2000:]


def test_hub_download_reads_converted_parquet(tmp_path, monkeypatch, capsys):
    """The Hub path: the dataset's refs/convert/parquet branch, CONFIG/SPLIT/*.parquet, through huggingface_hub."""
    import huggingface_hub
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = es.task_rows("arc_challenge", 3)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "0000.parquet")
    calls = []

    def list_repo_files(self, repo, repo_type=None, revision=None):
        calls.append((repo, repo_type, revision))
        return ["ARC-Easy/test/0000.parquet", "ARC-Challenge/test/0000.parquet", "ARC-Challenge/train/0000.parquet"]

    def hf_hub_download(repo, filename, repo_type=None, revision=None, cache_dir=None):
        calls.append((repo, filename, revision, cache_dir))
        return str(tmp_path / "0000.parquet")

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(et, "hub_unreachable", lambda: "")  # (this machine may have no network)
    got = et.hub_task_rows("arc_challenge", str(tmp_path / "cache"))
    assert got == rows
    assert ("allenai/ai2_arc", "ARC-Challenge/test/0000.parquet", "refs/convert/parquet",
            str(tmp_path / "cache")) in calls

    def offline(self, *a, **k):  # HF_HUB_OFFLINE or no network: the listing is never cached by huggingface_hub
        raise ConnectionError("offline mode is enabled")
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", offline)
    assert et.hub_task_rows("arc_challenge", str(tmp_path / "cache")) == rows  # the earlier download, read again
    assert "reads the copy downloaded into" in capsys.readouterr().err
    with pytest.raises(ev.EvalError, match="cannot download allenai/ai2_arc for task arc_easy"):
        et.hub_task_rows("arc_easy", str(tmp_path / "cache"))  # never downloaded: the error it always was
    os.remove(tmp_path / "0000.parquet")  # a cache pruned since: not a half-read, the same error
    with pytest.raises(ev.EvalError, match="cannot download allenai/ai2_arc for task arc_challenge"):
        et.hub_task_rows("arc_challenge", str(tmp_path / "cache"))


HUB_CLIENT = """
import json, os, sys
sys.path.insert(0, "tests")
from hub_server import FakeHub
hub = FakeHub(sys.argv[1])
os.environ.update(hub.client_env(sys.argv[2]))  # before huggingface_hub reads its settings
hub.start()
import eval as ev, eval_tasks as et


def attempts():
    out = []
    for spec in ("picaflor-test/tiny", "picaflor-test/none"):
        try:
            out.append(ev.load_model(spec, "cpu", "float32").kind)
        except ev.EvalError as e:
            out.append(f"error: {e}")
    for t in ("arc_easy", "piqa"):
        try:
            out.append(et.hub_task_rows(t, sys.argv[3]))
        except et.EvalError as e:
            out.append(f"error: {e}")
    return out


online = attempts()
hub.stop()  # its port refuses connections now, as no network does
from huggingface_hub.utils import close_session
close_session()  # (a kept-alive connection's handler thread would still answer)
et.HUB_UNREACHABLE.clear()
print(json.dumps({"online": online, "requests": hub.requests, "offline": attempts()}))
"""


def test_hub_models_and_data_online_and_offline(tmp_path):
    """The real huggingface_hub client against tests/hub_server.py. A dataset without the Hub's parquet branch
    (RevisionNotFound) was "cannot download", never its files on main. Offline (a refused connection, as no network
    is), each task spent ~25 s in huggingface_hub's retries before reading its cached copy or failing, and a Hub model
    id ~30-55 s before loading from the HF cache or failing: now one quick request says so, and what is not cached is
    one line naming the way out."""
    import subprocess
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = es.task_rows("arc_easy", 3)
    repo = tmp_path / "hub" / "datasets" / "allenai" / "ai2_arc" / "ARC-Easy"
    repo.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), repo / "test-00000-of-00001.parquet")
    es.make_tiny_hf_model(str(tmp_path / "hub" / "models" / "picaflor-test" / "tiny"), vocab_size=300, d_model=32,
                          n_layer=2, n_positions=64)
    r = subprocess.run([sys.executable, "-c", HUB_CLIENT, str(tmp_path / "hub"), str(tmp_path / "hf_home"),
                        str(tmp_path / "cache")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.splitlines()[-1])
    on, off = res["online"], res["offline"]
    assert ["HEAD", "/"] in res["requests"] and ["GET", "/datasets/allenai/ai2_arc/resolve/main/ARC-Easy/test-00000-of-"
                                                    "00001.parquet"] in res["requests"]
    assert on[0] == "hf" and on[1].startswith("error: picaflor-test/none: cannot load as a transformers model")
    assert on[2] == rows and on[3].startswith("error: cannot download baber/piqa"), on[3]
    assert "Retrying" not in r.stderr, r.stderr[-3000:]
    assert off[0] == "hf" and off[2] == rows and "reads the copy downloaded into" in r.stderr  # the caches
    assert off[1].startswith("error: picaflor-test/none: cannot reach the Hub (") and "not in the Hugging Face " \
        "cache" in off[1]
    assert off[3].startswith("error: cannot download baber/piqa for task piqa (") and "--data-dir DIR with " \
        "DIR/piqa.jsonl" in off[3], off[3]


def test_data_dir_folder_of_a_hub_snapshot_reads_the_tasks_split(tmp_path):
    """A folder DIR/<task>/ holding a Hub snapshot's train-*, validation-*, test-* files was read whole: the train
    rows were scored too. Only the split the task scores on the Hub is read; unnamed files are read whole as before."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    sizes = (("train", 5), ("validation", 3), ("test", 2))
    rows = {s: es.task_rows("piqa", n, seed=i) for i, (s, n) in enumerate(sizes)}
    snap = tmp_path / "snap" / "piqa"
    snap.mkdir(parents=True)
    for s, r in rows.items():
        pq.write_table(pa.Table.from_pylist(r), snap / f"{s}-00000-of-00001.parquet")
    (snap / "dataset_info.json").write_text('{"splits": {}}')  # a snapshot's metadata: not rows of the split
    assert et.local_task_rows(str(tmp_path / "snap"), "piqa") == rows["validation"]
    arc = tmp_path / "snap" / "arc_easy"  # arc_easy scores test; its shards in name order
    arc.mkdir()
    parts = [es.task_rows("arc_easy", 2, seed=s) for s in (1, 2)]
    for i, r in enumerate(parts):
        pq.write_table(pa.Table.from_pylist(r), arc / f"test-0000{i}-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(es.task_rows("arc_easy", 4, seed=3)), arc / "train-00000-of-00001.parquet")
    assert et.local_task_rows(str(tmp_path / "snap"), "arc_easy") == parts[0] + parts[1]
    plain = tmp_path / "plain" / "piqa"  # no split in the names: every file, in name order, as before
    plain.mkdir(parents=True)
    for name, r in (("a.jsonl", rows["train"]), ("b.jsonl", rows["test"])):
        (plain / name).write_text("".join(json.dumps(x) + "\n" for x in r))
    assert et.local_task_rows(str(tmp_path / "plain"), "piqa") == rows["train"] + rows["test"]
    os.remove(snap / "validation-00000-of-00001.parquet")  # the task's split missing, others there: refused
    with pytest.raises(ev.EvalError) as e:
        et.local_task_rows(str(tmp_path / "snap"), "piqa")
    msg = str(e.value)
    assert msg.startswith(f"{snap}: holds train/test split files") and "no validation split" in msg, msg
    assert "train-00000-of-00001.parquet" in msg and "\n" not in msg


def test_lambada_reads_only_its_default_configs_file(tmp_path, monkeypatch):
    """EleutherAI/lambada_openai keeps every config's test file side by side (lambada_test.jsonl, the default English
    one, and lambada_test_{de,en,es,fr,it}.jsonl): a snapshot folder, or the Hub's main branch when its parquet branch
    is missing, was read whole, six languages scored as one task. Only the default config's file is read now."""
    import huggingface_hub
    langs = {lang: es.task_rows("lambada_openai", 2, seed=i) for i, lang in enumerate(("", "de", "en", "es", "fr", "it"))}
    snap = tmp_path / "snap" / "lambada_openai"
    snap.mkdir(parents=True)
    for lang, r in langs.items():
        (snap / f"lambada_test{'_' + lang if lang else ''}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in r))
    assert et.local_task_rows(str(tmp_path / "snap"), "lambada_openai") == langs[""]

    def list_repo_files(self, repo, repo_type=None, revision=None):  # no parquet branch: the files on main
        return [] if revision else ["lambada_openai.py", "README.md"] + [f"data/{f.name}" for f in sorted(snap.iterdir())]
    got = []
    monkeypatch.setattr(et, "hub_unreachable", lambda: "")
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo, f, **k: got.append(f) or str(snap / os.path.basename(f)))
    assert et.hub_task_rows("lambada_openai", str(tmp_path / "cache")) == langs[""] and got == ["data/lambada_test.jsonl"]
    os.remove(snap / "lambada_test.jsonl")  # only the translations: refused, not scored as English
    with pytest.raises(ev.EvalError) as e:
        et.local_task_rows(str(tmp_path / "snap"), "lambada_openai")
    assert str(e.value).startswith(f"{snap}: holds only other configs' files") and "lambada_test.jsonl" in str(e.value)


def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, capsys):
    """A truncated or random-bytes model.safetensors: a run dir said only "neither a Hugging Face model dir nor a
    picaflor checkpoint"; one whose MANIFEST.json matched the damage was a SafetensorError traceback."""
    import shutil
    import checkpoint
    run_dir, _ = make_picaflor_ckpt(tmp_path)
    step = os.path.basename(checkpoint.resolve(run_dir))

    def damaged(name, damage, remanifest):
        d = tmp_path / name
        shutil.copytree(run_dir, d)
        w = d / step / "model.safetensors"
        w.write_bytes(damage(w.read_bytes()))
        if remanifest:  # the damage happened before the manifest was written (or it was rewritten)
            man = json.loads((d / step / "MANIFEST.json").read_text())
            man["files"]["model.safetensors"] = {"sha256": checkpoint.sha256_file(str(w)), "bytes": w.stat().st_size}
            (d / step / "MANIFEST.json").write_text(json.dumps(man))
        return d, str(w)

    def cut(b):
        return b[:100]

    def garbage(b):
        return os.urandom(len(b))
    cases = []
    for name, damage, remanifest, msg in (("cut", cut, False, "(truncated?)"), ("garbage", garbage, False, "sha256"),
                                          ("cut_man", cut, True, "not a readable safetensors file"),
                                          ("garbage_man", garbage, True, "not a readable safetensors file")):
        d, weights = damaged(name, damage, remanifest)
        cases += [(str(d), weights, msg), (str(d / step), weights, msg)]
    for spec, weights, msg in cases:
        assert ev.main([spec, "--tasks", "piqa", "--device", "cpu"]) == 2, spec
        err = capsys.readouterr().err.strip()
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and err.endswith(errors[0]) and "Traceback" not in err, err
        assert weights in errors[0] and msg in errors[0], errors[0]
        assert "another checkpoint" in errors[0] or "earlier step_* dir" in errors[0], errors[0]


def test_int4_container_too_big_to_dequantise_is_refused(hf_setup, tmp_path, monkeypatch, capsys):
    """The dequantised path holds the fp32 weights twice while loading: on a container larger than the memory (the
    case it streams for) the OOM killer ended eval.py silently. Refused in one line naming --int4-engine, whose
    engine had no budget either (every expert read into memory): --ram-budget now bounds it."""
    import checkpoint
    import container
    _, _, data_dir, _ = hf_setup
    run_dir, _ = make_picaflor_ckpt(tmp_path)
    path = str(tmp_path / "model.int4")
    container.write_container(checkpoint.resolve(run_dir), path, group_size=32, progress=False)
    capsys.readouterr()  # (write_container's padding warning)
    monkeypatch.setattr(ev, "available_memory", lambda: 64 << 10)  # 64 KiB left
    argv = [path, "--tasks", "piqa", "--data-dir", data_dir, "--limit", "2", "--bootstrap-iters", "0"]
    assert ev.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}: its weights dequantised take ") and err.endswith(
        "pass --int4-engine --ram-budget SIZE to score it on stream_infer's int4 kernels, experts streamed"), err
    assert "\n" not in err
    # which scores it, under the budget given (it had none: every expert read into memory)
    out = {}
    for extra in ([], ["--ram-budget", "2G"]):
        out[len(extra)] = tmp_path / f"out{len(extra)}"
        assert ev.main(argv + ["--int4-engine", "--out", str(out[len(extra)]), *extra]) == 0
    assert (out[0] / "piqa.jsonl").read_text() == (out[2] / "piqa.jsonl").read_text()
    assert ev.main(argv + ["--int4-engine", "--ram-budget", "1M"]) == 2
    assert "--ram-budget 1.00M is below what this model needs" in capsys.readouterr().err
    assert ev.main(argv + ["--ram-budget", "2G"]) == 2  # the dequantised path has no budget to keep
    assert capsys.readouterr().err.strip() == "error: --ram-budget 2G: bounds an int4 container scored with " \
                                              "--int4-engine only; drop it, or add --int4-engine with an int4 " \
                                              "container"


def test_int4_container_scores_its_dequantized_weights(hf_setup, tmp_path):
    """An int4 container (container.py) evaluates exactly as a checkpoint holding its dequantised weights."""
    import checkpoint
    import container
    import model as picaflor
    _, _, data_dir, _ = hf_setup
    run_dir, _ = make_picaflor_ckpt(tmp_path)
    path = str(tmp_path / "model.int4")
    container.write_container(checkpoint.resolve(run_dir), path, group_size=32, progress=False)
    c = container.load_container(path)
    m = picaflor.Picaflor(c.config)
    m.load_state_dict(c.dequantized_state_dict(), strict=False)
    picaflor.save_checkpoint(m, str(tmp_path / "deq"), 1, tokenizer_file=os.path.join(checkpoint.resolve(run_dir),
                                                                                      "tokenizer.json"))
    got = {}
    for name, argv in (("int4", [path]), ("deq", [str(tmp_path / "deq")]), ("engine", [path, "--int4-engine"])):
        out = tmp_path / f"out_{name}"
        assert ev.main(argv + ["--tasks", "piqa,lambada_openai", "--data-dir", data_dir, "--device", "cpu",
                               "--limit", "4", "--out", str(out), "--bootstrap-iters", "0"]) == 0
        got[name] = [json.loads(x)["loglikelihoods"] for t in ("piqa", "lambada_openai")
                     for x in (out / f"{t}.jsonl").read_text().splitlines()]
        kind = json.loads((out / "summary.json").read_text())["model_kind"]
        assert kind == {"int4": "int4 (dequantized)", "deq": "picaflor", "engine": "int4 (stream_infer engine)"}[name]
    assert max(abs(a - b) for x, y in zip(got["int4"], got["deq"]) for a, b in zip(x, y)) <= 1e-4
    # stream_infer's Engine (int4 kernels, one request at a time) agrees up to its kernels' rounding; on AVX2 that
    # includes int8 activations into the lm_head (this random model's log-likelihoods reach -370: up to 0.18 off)
    assert all(abs(a - b) <= 2e-3 * abs(a) + 3e-2 for x, y in zip(got["int4"], got["engine"]) for a, b in zip(x, y))
    # in bf16 (the default on CUDA) the routers and their biases stay the container's fp32 values, bit for bit (cast
    # back after .to(bfloat16), they had lost their low bits: other experts for ~0.1-0.3% of tokens)
    sd = c.dequantized_state_dict()
    lm = ev.load_int4(path, "cpu", torch.bfloat16, None)
    for name, mod in lm.model.named_modules():
        if isinstance(mod, picaflor.MoE):
            assert torch.equal(mod.gate.weight, sd[f"{name}.gate.weight"].float())
            assert torch.equal(mod.e_score_correction_bias, sd[f"{name}.e_score_correction_bias"].float())
            assert mod.shared_experts.gate_proj.weight.dtype == torch.bfloat16
    # an engine error during the run is one line, exit 2 (a traceback: main caught only its own error types)
    import stream_infer

    def refuses(self, *a, **k):
        raise stream_infer.StreamError("the engine refused (a test)")
    stream_infer.Engine.loglikelihood, real = refuses, stream_infer.Engine.loglikelihood
    try:
        assert ev.main([path, "--int4-engine", "--tasks", "piqa", "--data-dir", data_dir, "--device", "cpu",
                        "--limit", "2"]) == 2
    finally:
        stream_infer.Engine.loglikelihood = real


def test_experts_per_token_reaches_every_model_kind_and_is_recorded(hf_setup, tmp_path, capsys):
    """--experts-per-token K: a checkpoint, its int4 container (dequantised and on stream_infer's engine) and its HF
    export all score at K routed experts per token (eval.py scored each at its trained top_k only: "how much does
    top-1 serving lose?" had no answer); at K=1 they agree as the parity tests ask of them at their own top_k, and
    differ from K=2; summary.json, results.md and --compare's columns say the K."""
    import io
    from contextlib import redirect_stdout

    import checkpoint
    import container
    import export
    import model as picaflor
    _, _, data_dir, _ = hf_setup
    run_dir, tok = make_picaflor_ckpt(tmp_path)
    path = str(tmp_path / "model.int4")
    container.write_container(checkpoint.resolve(run_dir), path, group_size=32, progress=False)
    c = container.load_container(path)
    m = picaflor.Picaflor(c.config)  # the container's weights as a checkpoint, and that checkpoint's HF export
    m.load_state_dict(c.dequantized_state_dict(), strict=False)
    deq = str(tmp_path / "deq")
    picaflor.save_checkpoint(m, deq, 1, tokenizer_file=os.path.join(checkpoint.resolve(run_dir), "tokenizer.json"))
    with redirect_stdout(io.StringIO()):
        export.main([deq, "--format", "hf", "--out", str(tmp_path / "hf"), "--dtype", "float32", "--no-progress"])
    got, summaries = {}, {}
    for name, argv in (("deq", [deq]), ("deq_k1", [deq, "--experts-per-token", "1"]),
                       ("int4_k1", [path, "--experts-per-token", "1"]),
                       ("engine_k1", [path, "--int4-engine", "--experts-per-token", "1"]),
                       ("hf_k1", [str(tmp_path / "hf"), "--experts-per-token", "1"])):
        out = tmp_path / f"out_{name}"
        assert ev.main(argv + ["--tasks", "piqa,lambada_openai", "--data-dir", data_dir, "--device", "cpu",
                               "--limit", "3", "--out", str(out), "--bootstrap-iters", "0"]) == 0
        got[name] = [a for t in ("piqa", "lambada_openai") for x in (out / f"{t}.jsonl").read_text().splitlines()
                     for a in json.loads(x)["loglikelihoods"]]
        summaries[name] = json.loads((out / "summary.json").read_text())
        k = 1 if name.endswith("_k1") else 2
        assert (summaries[name]["experts_per_token"], summaries[name]["own_experts_per_token"]) == (k, 2), name
        assert (out / "results.md").read_text().startswith(f"# {argv[0]} (routed experts per token: {k})\n")
    near = lambda a, b, tol: all(abs(x - y) <= tol(x) for x, y in zip(got[a], got[b]))  # noqa: E731
    assert near("deq_k1", "int4_k1", lambda x: 1e-4) and near("deq_k1", "hf_k1", lambda x: 1e-4)
    assert near("int4_k1", "engine_k1", lambda x: 2e-3 * abs(x) + 3e-2)  # (the engine's kernels' rounding)
    assert max(abs(x - y) for x, y in zip(got["deq"], got["deq_k1"])) > 0.1  # top-1 is another model
    capsys.readouterr()
    assert ev.main(["--compare", str(tmp_path / "out_deq" / "summary.json"),
                    str(tmp_path / "out_deq_k1" / "summary.json")]) == 0
    table = capsys.readouterr().out
    assert f"| task | metric | {deq} top-2 | {deq} top-1 |" in table
    assert "experts per token 1 (its own 2)" in table
    # a rerun into an --out scored at another K is another evaluation (its results were mixed into one summary); a
    # summary written before K was recorded was scored at the model's own
    old = {k: v for k, v in summaries["deq"].items() if "experts_per_token" not in k}
    (tmp_path / "out_deq" / "summary.json").write_text(json.dumps(old))
    assert ev.main([deq, "--tasks", "piqa", "--data-dir", data_dir, "--limit", "3", "--bootstrap-iters", "0",
                    "--out", str(tmp_path / "out_deq")]) == 0  # (the same K: kept)
    assert "keeping the earlier results of lambada_openai" in capsys.readouterr().out
    capsys.readouterr()
    assert ev.main([deq, "--experts-per-token", "1", "--tasks", "piqa", "--data-dir", data_dir, "--limit", "3",
                    "--out", str(tmp_path / "out_deq")]) == 2
    err = capsys.readouterr().err
    assert "holds results of another evaluation (experts_per_token 2, now 1)" in err and err.count("\n") == 1


def test_bad_experts_per_token_is_one_line_before_the_model_loads(hf_setup, tmp_path, capsys, monkeypatch):
    """0, a negative K and a K above the model's experts are refused in one line, before its weights load; a model
    without MoE layers takes any K >= 1 (it routes nothing) and records none."""
    import io
    from contextlib import redirect_stdout

    import checkpoint
    import container
    import export
    import model as picaflor
    _, hf_dir, data_dir, _ = hf_setup
    run_dir, tok = make_picaflor_ckpt(tmp_path)
    path = str(tmp_path / "model.int4")
    container.write_container(checkpoint.resolve(run_dir), path, group_size=32, progress=False)
    with redirect_stdout(io.StringIO()):
        export.main([run_dir, "--format", "hf", "--out", str(tmp_path / "hf"), "--dtype", "float32", "--no-progress"])
    capsys.readouterr()
    argv = ["--tasks", "piqa", "--data-dir", data_dir, "--limit", "2", "--bootstrap-iters", "0", "--device", "cpu"]
    for k in ("0", "-1"):
        assert ev.main([run_dir, "--experts-per-token", k] + argv) == 2
        assert capsys.readouterr().err == f"error: --experts-per-token {k}: at least 1\n"

    def heavy(*a, **kw):
        raise AssertionError("weights loaded before --experts-per-token was checked")
    with monkeypatch.context() as mp:
        mp.setattr(picaflor, "load_checkpoint", heavy)
        mp.setattr(container.Container, "dequantized_state_dict", heavy)
        for model, extra, where in ((run_dir, [], checkpoint.resolve(run_dir)), (path, [], path),
                                    (path, ["--int4-engine"], path), (str(tmp_path / "hf"), [], str(tmp_path / "hf"))):
            assert ev.main([model, "--experts-per-token", "5"] + extra + argv) == 2
            assert capsys.readouterr().err == (f"error: --experts-per-token 5: {where} has 4 experts per MoE layer; "
                                               f"pass 1..4 (leave it out for its own 2)\n"), (model, extra)
    # more than its own top_k: an experiment, allowed, said once (it was silent)
    assert ev.main([run_dir, "--experts-per-token", "3", "--out", str(tmp_path / "out_k3")] + argv) == 0
    assert capsys.readouterr().err.count("note: serving with 3 experts per token, more than the 2 the model was "
                                         "trained with") == 1
    # no MoE layers: a dense picaflor checkpoint and a GPT-2-style HF model take any K and record none
    cfg = picaflor.ModelConfig(vocab_size=tok.vocab_size, n_layer=2, n_dense_layers=2, d_model=32, n_head=4,
                               n_kv_head=2, dense_ffn=64, n_experts=0)
    picaflor.save_checkpoint(picaflor.Picaflor(cfg), str(tmp_path / "dense"), 1,
                             tokenizer_file=str(tmp_path / "tok.json"))
    for model in (str(tmp_path / "dense"), hf_dir):
        out = tmp_path / f"out_{os.path.basename(model)}"
        assert ev.main([model, "--experts-per-token", "7", "--out", str(out)] + argv) == 0, capsys.readouterr().err
        assert "experts per token" not in capsys.readouterr().err  # (it routes nothing: no note)
        s = json.loads((out / "summary.json").read_text())
        assert s["experts_per_token"] is None and s["own_experts_per_token"] is None


def test_cli_end_to_end(hf_setup, tmp_path, capsys):
    """The script as a user runs it: outputs on success; on bad input exit 2 with one stderr line, no traceback."""
    import subprocess
    _, model_dir, data_dir, _ = hf_setup
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), model_dir, "--tasks", "piqa,winogrande",
                        "--limit", "3", "--data-dir", data_dir, "--device", "cpu", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # a split of other than the Hub's size is said (a copy cut at a line boundary read as a smaller split, silently)
    assert "warning: task piqa: " in r.stderr and "validation split has 1838: a partial or other copy" in r.stderr
    assert "| piqa | acc |" in r.stdout and "| winogrande | acc |" in r.stdout
    assert {p.name for p in out.iterdir()} == {"piqa.jsonl", "winogrande.jsonl", "summary.json", "results.md"}
    capsys.readouterr()  # bad input: its main() here (the script's exit status is main()'s, as the run above shows)
    assert ev.main([model_dir, "--tasks", "piqa", "--data-dir", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "--data-dir is not a directory; pass the folder" in err, err


def test_encode_pair_as_harness(hf_setup):
    """Empty context -> the prefix token (BOS/EOS) alone; trailing context spaces move into the continuation."""
    from lm_eval.models.huggingface import HFLM
    _, model_dir, _, _ = hf_setup
    lm = ev.load_model(model_dir, "cpu", "float32")
    ref = HFLM(pretrained=model_dir, device="cpu", batch_size=1, dtype="float32")
    pairs = [("", " the dog runs"), ("the cat  ", "sees the dog"), ("Question: a b?\nAnswer:", " c d")]
    for ctx, cont in pairs:
        got = ev.encode_pair(lm, ctx, cont, {})
        want = ref._encode_pair(ctx, cont) if ctx else ([ref.prefix_token_id], ref.tok_encode(cont, add_special_tokens=False))
        assert (list(got[0]), list(got[1])) == (list(want[0]), list(want[1])), (ctx, cont)
    assert ev.encode_pair(lm, "", " the dog runs", {})[0] == [lm.prefix_id]


def test_whitespace_only_context_conditions_on_the_prefix_token(hf_setup):
    """A whitespace-only context, its spaces moved into the continuation as the harness does, encoded to no tokens
    with a tokenizer that adds no BOS (GPT-2's): the shared-context path crashed on a 0-length context (a reshape
    RuntimeError) and the flat path read the first target's log-prob off the last position. It is the prefix token
    alone now, as an empty context is; an empty continuation is an EvalError, not an IndexError."""
    _, model_dir, _, _ = hf_setup
    lm = ev.load_model(model_dir, "cpu", "float32")
    docs = [{"requests": [("   ", " the dog"), ("   ", " a cat")]}, {"requests": [("  ", " runs")]}]
    ev.loglikelihoods(lm, docs)
    for d in docs:
        for (ctx, cont), ll in zip(d["requests"], d["lls"]):
            ids = [lm.prefix_id] + lm.encode(ctx + cont, add_special_tokens=False)
            with torch.no_grad():
                lp = torch.log_softmax(lm.model(torch.tensor([ids])).logits[0].float(), -1)
            assert ll == pytest.approx(sum(float(lp[i, t]) for i, t in enumerate(ids[1:])), abs=1e-4), (ctx, cont)
    with pytest.raises(ev.EvalError, match="empty continuation after tokenisation; fix or drop that example"):
        ev.loglikelihoods(lm, [{"requests": [("", "")]}])


def test_review_round_reruns_keep_results_wrong_tokenizers_and_diverged_models(hf_setup, tmp_path, capsys):
    """Helper-56's review: a rerun of a failed task (as its error advises) left a summary.json of that task alone,
    and another model's run into the same --out wrote its summary beside the first model's per-task files; an int4
    container with a larger-vocab --tokenizer was an IndexError traceback; a diverged model's lambada perplexity
    (mean log-likelihood under -709.8) overflowed math.exp and ended the run."""
    import checkpoint
    import container
    import tokenizer
    _, model_dir, data_dir, _ = hf_setup
    only_piqa = tmp_path / "only_piqa"
    only_piqa.mkdir()
    (only_piqa / "piqa.jsonl").write_text(open(os.path.join(data_dir, "piqa.jsonl")).read())
    out = tmp_path / "res"
    assert ev.main([model_dir, "--tasks", "piqa,arc_easy", "--data-dir", str(only_piqa), "--out", str(out),
                    "--limit", "3"]) == 2
    (only_piqa / "arc_easy.jsonl").write_text(open(os.path.join(data_dir, "arc_easy.jsonl")).read())
    assert ev.main([model_dir, "--tasks", "arc_easy", "--data-dir", str(only_piqa), "--out", str(out),
                    "--limit", "3"]) == 0
    summary = json.load(open(out / "summary.json"))
    assert sorted(summary["results"]) == ["arc_easy", "piqa"] and sorted(summary["tasks_done"]) == ["arc_easy", "piqa"]
    assert "keeping the earlier results of piqa" in capsys.readouterr().out
    run_dir, _ = make_picaflor_ckpt(tmp_path)
    assert ev.main([run_dir, "--tasks", "piqa", "--data-dir", str(only_piqa), "--out", str(out), "--limit", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds results of another evaluation (model_source" in err[0], err
    assert json.load(open(out / "summary.json")) == summary
    # another --seed (the synthetic tasks' examples, gsm8k's few-shot draws): kept results would be another seed's
    assert ev.main([model_dir, "--tasks", "piqa", "--data-dir", str(only_piqa), "--out", str(out), "--limit", "3",
                    "--seed", "7"]) == 2
    assert "(seed 1234, now 7)" in capsys.readouterr().err
    assert json.load(open(out / "summary.json")) == summary
    # an int4 container with another, larger tokenizer: one line naming it
    path = str(tmp_path / "m.int4")
    container.write_container(checkpoint.resolve(run_dir), path, group_size=16, progress=False)
    capsys.readouterr()
    big = tokenizer.train_tokenizer([" ".join(f"w{i}x{j}" for j in range(40)) for i in range(200)] + list(es.corpus()), 1000)
    assert big.vocab_size > 320
    big_path = big.save(str(tmp_path / "big.json"))
    for extra in ([], ["--int4-engine"]):
        assert ev.main([path, "--tokenizer", big_path, "--tasks", "piqa", "--data-dir", data_dir, "--limit", "2",
                        *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{big_path}: tokenizer vocab {big.vocab_size} > model vocab" in err[0], err
    # a diverged model: perplexity inf (no stderr), the run goes on
    docs = [{"scores": {"perplexity": -800.0 - i, "acc": 0.0}} for i in range(4)]
    res = ev.aggregate("lambada_openai", docs, 100)
    assert res["perplexity"] == float("inf") and res["perplexity_stderr"] is None and res["acc"] == 0.0


def interrupt_at_task(monkeypatch, name):
    """A Ctrl-C as eval.py starts scoring task `name` (the tasks before it scored as ever)."""
    real = ev.run_task

    def interrupted(lm, task, args):
        if task == name:
            raise KeyboardInterrupt
        return real(lm, task, args)
    monkeypatch.setattr(ev, "run_task", interrupted)


def test_ctrl_c_is_one_line_naming_the_tasks_left(hf_setup, tmp_path, capsys, monkeypatch):
    """Ctrl-C was a traceback; now one line, exit 130, naming the tasks to go on with (the finished ones are kept)."""
    _, model_dir, data_dir, _ = hf_setup
    out = tmp_path / "res"
    interrupt_at_task(monkeypatch, "arc_easy")
    assert ev.main([model_dir, "--tasks", "piqa,arc_easy,winogrande", "--data-dir", data_dir, "--out", str(out),
                    "--limit", "2"]) == 130
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith(("warning: task", "note:"))]
    assert err == [f"interrupted; the finished tasks are in {out}: go on with --tasks arc_easy,winogrande --out {out} "
                   f"(it keeps them)"], err
    assert json.load(open(out / "summary.json"))["tasks_done"] == ["piqa"]
    assert ev.main([model_dir, "--tasks", "arc_easy,winogrande", "--data-dir", data_dir, "--out", str(tmp_path / "r2"),
                    "--limit", "2"]) == 130  # none finished: nothing to go on from
    assert [line for line in capsys.readouterr().err.strip().splitlines()
            if not line.startswith(("warning: task", "note:"))] == ["interrupted"]
    assert not (tmp_path / "r2").exists()  # (the empty folder its writability check made)


def write_gsm8k_splits(root, n_train, n_test):
    """ROOT/gsm8k/{train,test}.jsonl in the Hub schema (eval.py's --data-dir folder of a task's splits)."""
    files = {}
    for split, n, seed in (("train", n_train, 1), ("test", n_test, 2)):
        path = root / "gsm8k" / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in es.task_rows("gsm8k", n, seed=seed)))
        files[split] = str(path)
    return files


def test_gsm8k_fewshot_prompts_are_the_harness_s(tmp_path):
    """gsm8k was scored zero-shot while the harness's gsm8k YAML says 5-shot: picaflor's figure was not comparable
    with published ones. Now its prompts for the default (5), 0 and another N and seed are lm-eval's own strings
    for the same test docs, train split and fewshot seed."""
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    class NoModel(LM):  # lm-eval's requests are all this test reads
        def loglikelihood(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def generate_until(self, requests, disable_tqdm=False):
            return ["" for _ in requests]
    files = write_gsm8k_splits(tmp_path / "data", 12, 4)
    tm = TaskManager(include_path=es.write_lm_eval_tasks(str(tmp_path / "tasks"), str(tmp_path / "data"), ["gsm8k"], files),
                     include_defaults=False)
    for n, seed in ((None, 1234), (0, 1234), (3, 7)):
        ref = lm_eval.simple_evaluate(model=NoModel(), tasks=["gsm8k"], num_fewshot=n, task_manager=tm, log_samples=True,
                                      bootstrap_iters=0, fewshot_random_seed=seed)
        by_id = {s["doc_id"]: s["arguments"][0][0] for s in ref["samples"]["gsm8k"]}  # (a sample per filter)
        want = [by_id[i] for i in range(len(by_id))]
        argv = ["m", "--data-dir", str(tmp_path / "data"), "--seed", str(seed)]
        got = [d["prompt"] for d in et.task_docs("gsm8k", None, ev.parse_args(argv + (["--num-fewshot", str(n)]
                                                                                       if n is not None else [])))]
        assert got == want, (n, seed)
        assert all(p.count("Question: ") == (5 if n is None else n) + 1 for p in got)
    test = [json.loads(x) for x in open(files["test"])]
    got0 = et.task_docs("gsm8k", None, ev.parse_args(argv + ["--num-fewshot", "0"]))
    assert [d["prompt"] for d in got0] == [f"Question: {r['question']}\nAnswer:" for r in test]  # 0-shot unchanged


def test_num_fewshot_errors_and_summary(hf_setup, tmp_path, capsys):
    """--num-fewshot: one-line errors (a task scored zero-shot only, no train split, too few train rows, N < 0);
    summary.json records each task's shots, kept per task across reruns into one --out; --compare gives no verdict
    between 0- and 5-shot gsm8k."""
    _, model_dir, data_dir, _ = hf_setup
    write_gsm8k_splits(tmp_path / "few", 3, 2)
    cases = [([model_dir, "--tasks", "gsm8k,piqa", "--num-fewshot", "2", "--data-dir", data_dir],
              "--num-fewshot 2: task piqa is scored zero-shot only"),
             ([model_dir, "--tasks", "gsm8k", "--num-fewshot", "-1"], "--num-fewshot -1: 0 or more"),
             ([model_dir, "--tasks", "gsm8k", "--data-dir", data_dir],
              f"{data_dir}: no train split file for task gsm8k's few-shot examples; add gsm8k/train.jsonl there"),
             ([model_dir, "--tasks", "gsm8k", "--data-dir", str(tmp_path / "few")],
              "task gsm8k: --num-fewshot 5, but its train split has only 3 examples")]
    for argv, msg in cases:
        assert ev.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and msg in errors[0] and err.endswith(errors[0]) and "Traceback" not in err, err
    few = str(tmp_path / "few")
    out, out0 = str(tmp_path / "out"), str(tmp_path / "out0")
    common = [model_dir, "--data-dir", few, "--device", "cpu", "--max-gen-toks", "4", "--limit", "2"]
    assert ev.main(common + ["--tasks", "gsm8k", "--num-fewshot", "3", "--out", out]) == 0
    assert "3-shot" in capsys.readouterr().out
    assert ev.main(common + ["--tasks", "counting", "--out", out]) == 0  # gsm8k's kept, and its shots
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["num_fewshot"] == {"gsm8k": 3, "counting": 0} and set(summary["results"]) == {"gsm8k", "counting"}
    prompts = [json.loads(x)["prompt"] for x in open(os.path.join(out, "gsm8k.jsonl"))]
    assert all(p.count("Question: ") == 4 for p in prompts)
    assert ev.main(common + ["--tasks", "gsm8k", "--num-fewshot", "0", "--out", out0]) == 0
    capsys.readouterr()
    assert ev.main(["--compare", os.path.join(out, "summary.json"), os.path.join(out0, "summary.json")]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("| gsm8k | exact_match_strict |"))
    assert "(0-shot vs 3-shot !)" in row and "~" not in row and "*" not in row, row
    assert "shots: gsm8k 3, counting 0" in table and "shots: gsm8k 0" in table


def test_hf_generation_stops_at_a_stop_string_that_is_a_special_token(tmp_path):
    """gsm8k's until has "<|im_end|>", a special token (not the eos) of chat-style tokenizers (SmolLM2's). The harness's
    stop check (MultiTokenEOSCriteria) decodes with special tokens kept and stops there; eval.py's check decoded with
    them skipped, never saw it, and glued the text generated after it onto the answer (a later number)."""
    from lm_eval.models.utils_hf import MultiTokenEOSCriteria
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = es.make_tiny_hf_model(str(tmp_path / "m"), vocab_size=300, d_model=32, n_layer=2, n_positions=64,
                              head_vocab=320)
    tok = AutoTokenizer.from_pretrained(d)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    lm = ev.HFModel(AutoModelForCausalLM.from_pretrained(d), tok, "m", "cpu")
    assert im_end not in lm.stop_ids and im_end < 320
    scripted = (tok.encode(" 12", add_special_tokens=False) + [im_end]
                + tok.encode(" 99 bottles", add_special_tokens=False))
    it = iter(scripted)

    def head(h):  # the model's greedy choices, scripted
        logits = torch.zeros(h.shape[0], 320)
        logits[:, next(it)] = 1.0
        return logits
    lm.head = head
    lm.run = lambda ids, cache=None, **kw: torch.zeros(ids.shape[0], ids.shape[1], 32)
    upto = scripted.index(im_end) + 1
    assert MultiTokenEOSCriteria("<|im_end|>", tok, 0, 1)(torch.tensor([scripted[:upto]]), None)  # the harness stops
    assert ev.greedy_generate(lm, "Question: how many?\nAnswer:", ["Question:", "</s>", "<|im_end|>"],
                             len(scripted)) == " 12"


def test_a_choices_field_that_is_text_is_a_schema_error():
    """A local copy whose list field was written as text (hellaswag endings "['a', 'b']", a CSV round trip) was scored
    with each character as a choice, silently; now it is the one-line schema error of any malformed row."""
    rows = {"hellaswag": {"activity_label": "x", "ctx_a": "a", "ctx_b": "b", "endings": "['one', 'two']",
                          "label": "1"},
            "arc_easy": {"question": "q", "choices": {"text": "ab", "label": ["A", "B"]}, "answerKey": "B"},
            "piqa": {"goal": "g", "sol1": "a", "sol2": None, "label": 0}}
    for task, row in rows.items():
        with pytest.raises(et.EvalError, match="does not have the dataset's schema"):
            et.build_docs(task, [row], "example")
    assert et.build_docs("arc_easy", [dict(rows["arc_easy"], choices={"text": ["a", "b"], "label": ["A", "B"]})],
                         "example")[0]["gold"] == 1


def test_a_rerun_into_out_refuses_other_weights_under_the_same_path(hf_setup, tmp_path, capsys):
    """A rollback (rundir.set_aside_after) trains a new step_0000001 under the same name: the second call's
    model_source was the same path, so its arc_easy was kept beside the old weights' piqa as one model's summary."""
    import shutil
    import model as picaflor
    _, _, data_dir, _ = hf_setup
    run_dir, _ = make_picaflor_ckpt(tmp_path)
    out = tmp_path / "res"
    common = ["--data-dir", data_dir, "--limit", "2", "--out", str(out), "--device", "cpu"]
    assert ev.main([run_dir, "--tasks", "piqa", *common]) == 0
    first = json.load(open(out / "summary.json"))
    assert first["model_weights"].startswith("manifest ")
    step = os.path.join(run_dir, "step_0000001")
    m = picaflor.load_checkpoint(step)
    with torch.no_grad():
        m.lm_head.weight.mul_(2.0)  # the new timeline's weights
    shutil.move(step, str(tmp_path / "abandoned"))
    picaflor.save_checkpoint(m, run_dir, 1, tokenizer_file=os.path.join(str(tmp_path / "abandoned"), "tokenizer.json"))
    assert ev.main([run_dir, "--tasks", "arc_easy", *common]) == 2
    err = capsys.readouterr().err
    assert "holds results of another evaluation (model_weights" in err, err
    assert json.load(open(out / "summary.json")) == first
    # the same weights again: kept (a rerun of one task)
    shutil.rmtree(step)
    shutil.move(str(tmp_path / "abandoned"), step)
    assert ev.main([run_dir, "--tasks", "arc_easy", *common]) == 0
    assert sorted(json.load(open(out / "summary.json"))["results"]) == ["arc_easy", "piqa"]


def test_compare_gives_no_verdict_between_other_generation_caps(tmp_path, capsys):
    """gsm8k scored with --max-gen-toks 8 (answers cut before their number) and with the task's 256 was marked
    against the first column as if one scoring: the same n and shots, other outputs."""
    paths = []
    for name, cap, em in (("full", None, 0.30), ("cut", 8, 0.02)):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"model": name, "max_gen_toks": cap, "num_fewshot": {"gsm8k": 5}, "results": {
            "gsm8k": {"exact_match": em, "exact_match_stderr": 0.01, "n": 100}}}))
        paths.append(str(p))
    assert ev.main(["--compare", *paths]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| gsm8k |"))
    assert "!" in row and "*" not in row and "~" not in row, row


def test_a_rerun_stopped_before_a_task_keeps_that_tasks_earlier_result(hf_setup, tmp_path, capsys, monkeypatch):
    """Rescoring piqa,arc_easy into an --out that held both: the earlier arc_easy was dropped from summary.json at
    the start, so a Ctrl-C (or a fault) in arc_easy left a summary without it, beside its arc_easy.jsonl."""
    _, model_dir, data_dir, _ = hf_setup
    out = tmp_path / "res"
    common = ["--data-dir", data_dir, "--out", str(out), "--limit", "2"]
    assert ev.main([model_dir, "--tasks", "piqa,arc_easy", *common]) == 0
    first = json.load(open(out / "summary.json"))
    interrupt_at_task(monkeypatch, "arc_easy")
    assert ev.main([model_dir, "--tasks", "piqa,arc_easy", *common]) == 130
    after = json.load(open(out / "summary.json"))
    assert after["results"] == first["results"] and sorted(after["tasks_done"]) == ["arc_easy", "piqa"], after
    assert after["num_fewshot"] == first["num_fewshot"] and "arc_easy" in (out / "results.md").read_text()


def test_a_rerun_with_another_tokenizer_is_another_evaluation(hf_setup, tmp_path, capsys):
    """--tokenizer was in no summary: a rerun of one task with another tokenizer (of no larger vocab) kept the first
    call's results beside it as one model scored one way."""
    import tokenizer
    _, _, data_dir, _ = hf_setup
    run_dir, _ = make_picaflor_ckpt(tmp_path)
    other = tokenizer.train_tokenizer([f"zeta {i} omega {i * 3} " * 5 for i in range(300)], 300)
    other_path = other.save(str(tmp_path / "other.json"))
    out = tmp_path / "res"
    common = ["--data-dir", data_dir, "--limit", "2", "--out", str(out), "--device", "cpu"]
    assert ev.main([run_dir, "--tasks", "piqa", *common]) == 0
    first = json.load(open(out / "summary.json"))
    assert ev.main([run_dir, "--tasks", "arc_easy", "--tokenizer", other_path, *common]) == 2
    assert "holds results of another evaluation (tokenizer" in capsys.readouterr().err
    assert json.load(open(out / "summary.json")) == first


def test_compare_gives_no_verdict_between_other_examples(hf_setup, tmp_path, capsys):
    """Two --data-dir copies of piqa holding other questions, both --limit 2: the same n and shots, so --compare
    marked the difference ~ or * as if one test set; summary.json now says which examples each task scored."""
    _, model_dir, data_dir, _ = hf_setup
    rows = open(os.path.join(data_dir, "piqa.jsonl")).read().splitlines()
    other = tmp_path / "other"
    other.mkdir()
    (other / "piqa.jsonl").write_text("\n".join(rows[::-1]) + "\n")
    sums = []
    for name, d in (("a", data_dir), ("b", str(other)), ("c", data_dir)):
        assert ev.main([model_dir, "--tasks", "piqa", "--data-dir", d, "--limit", "2",
                        "--out", str(tmp_path / name)]) == 0
        sums.append(str(tmp_path / name / "summary.json"))
    capsys.readouterr()
    assert ev.main(["--compare", *sums]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| piqa | acc |"))
    cells = row.split(" | ")
    assert "other examples !" in cells[3] and "~" not in cells[3] and "*" not in cells[3], row
    assert "~" in cells[4] or "*" in cells[4], row  # the same examples from the same file: compared


def test_an_empty_stop_string_is_refused_at_task_load(monkeypatch):
    """"" is in every text: a task whose `until` held it stopped each generation at its first token, then the cut
    (text.split("")) crashed with ValueError: empty separator. Now the task load refuses it, naming the task."""
    args = ev.parse_args(["m", "--tasks", "counting", "--limit", "2"])
    assert all(d["until"] for d in et.task_docs("counting", None, args))  # the built-in tasks pass
    built = et.counting_docs
    monkeypatch.setattr(et, "counting_docs", lambda n, seed: [dict(d, until=["\n", ""]) for d in built(n, seed)])
    with pytest.raises(et.EvalError, match=r"task counting: example 0: until=\['\\n', ''\]: stop strings must be"):
        et.task_docs("counting", None, args)


def test_a_repeated_choice_ties_exactly_and_the_first_wins(hf_setup):
    """A question that lists one answer twice: the harness scores a repeated request once (HFLM's Collator), so the
    two tie exactly and argmax takes the first; eval.py scored each copy in its own batch row, and float noise between
    rows picked either (seen on CPU here: gold 1, the second copy, was scored right on some)."""
    _, model_dir, _, _ = hf_setup
    rows = es.task_rows("piqa", 24)
    for r in rows:
        r["sol2"], r["label"] = r["sol1"], 1
    lm = ev.load_model(model_dir, "cpu", "float32")
    for batch_size in (1, 3):
        docs = et.build_docs("piqa", rows, "example")
        ev.loglikelihoods(lm, docs, batch_size)
        assert [d["lls"][0] for d in docs] == [d["lls"][1] for d in docs], batch_size
        assert [ev.doc_scores("piqa", d) for d in docs] == [{"acc": 0.0, "acc_norm": 0.0}] * len(docs)


def test_acc_and_acc_norm_are_the_harness_s_on_ties_empty_and_non_ascii_choices():
    """The installed harness's own multiple-choice process_results on hand-made scores: acc_norm divides by the
    choice's length in characters (len(str); bytes are its separate acc_bytes), ties go to the first choice, and an
    empty choice's 0 length gives -inf (never chosen) as in numpy there."""
    import types
    import warnings
    from lm_eval.api.task import ConfigurableTask
    cases = [([-2.0, -2.0, -3.0], ["ab", "cd", "ef"], 1),  # exact tie: first
             ([-4.0, -4.0], ["abcd", "wxyz"], 1),  # tie in acc and in acc_norm
             ([-1.0, -1.9], ["é", "ab"], 0),  # 1 character vs 2 bytes: acc_norm picks "ab" by characters
             ([-3.0, -6.1], ["日本", "ascii!"], 0),  # 2 characters (6 bytes) vs 6
             ([-0.5, -5.0, -6.0], ["", "xy", "xyz"], 2),  # the empty choice: -inf after the division
             ([-1.0, -1.0], ["a\u0301", "á"], 1)]  # combining accent: 2 code points vs 1
    for lls, choices, gold in cases:
        harness_self = types.SimpleNamespace(
            OUTPUT_TYPE="multiple_choice", config=types.SimpleNamespace(process_results=None),
            _metric_fn_list={"acc": None, "acc_norm": None}, multiple_input=False, multiple_target=False,
            doc_to_choice=lambda doc: doc["choices"], doc_to_target=lambda doc: doc["gold"])
        doc = {"choices": choices, "gold": gold, "lls": lls}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (numpy's divide by zero, both sides)
            want = ConfigurableTask.process_results(harness_self, doc, [(x, False) for x in lls])
            assert ev.doc_scores("piqa", doc) == want, (lls, choices)


def test_picaflor_generation_stops_at_every_special_token_as_its_exports_do(tmp_path):
    """A picaflor checkpoint or int4 engine stopped at <|bos|> and <|end|> only, while the same model's HF export
    (generation_config, export.GENERATION_STOPS) and chat.py stop at every special token: a chat model that went on
    into a turn of its own (<|user|> ...) had that turn glued onto its answer here (the special dropped from the text),
    and scored otherwise than its export."""
    import export
    run_dir, tok = make_picaflor_ckpt(tmp_path, max_seq_len=64)
    for name in export.GENERATION_STOPS:
        script = tok.encode(" 12") + [tok.special_ids[name]] + tok.encode(" 99 bottles")
        lm = ev.load_model(run_dir, "cpu", "float32")
        it = iter(script)

        def head(h):  # the model's greedy choices, scripted
            logits = torch.zeros(h.shape[0], lm.model.cfg.vocab_size)
            logits[:, next(it, script[-1])] = 1.0
            return logits
        lm.head = head
        assert ev.greedy_generate(lm, "Question: how many?\nAnswer:", ["Question:"], 8) == " 12", name

        class Engine:  # the int4 engine's stream: the same scripted tokens
            context = 64

            def stream(self, ids, n, temperature=0):
                yield from script[:n]
        engine_lm = ev.EngineModel(Engine(), tok, "e")
        assert ev.greedy_generate(engine_lm, "Question: how many?\nAnswer:", ["Question:"], 8) == " 12", name


def test_generated_text_is_the_same_from_a_checkpoint_its_container_and_its_hf_export(tmp_path):
    """eval.py decoded a picaflor checkpoint's (and its int4 container's) generation with U+FFFD for an id no text maps
    to (reserved 0), where its HF export's tokenizer drops it: counting scored " 12<0>13" 1 there ("12", "13") and 0 on
    the export ("1213"). Every kind decodes the same text now, a character cut across tokens (or across a dropped id)
    and invalid UTF-8 included, and scores the same."""
    import io
    from contextlib import redirect_stdout

    import checkpoint
    import container
    import export
    run_dir, tok = make_picaflor_ckpt(tmp_path, max_seq_len=64)
    with redirect_stdout(io.StringIO()):
        export.main([run_dir, "--format", "hf", "--out", str(tmp_path / "hf"), "--dtype", "float32", "--no-progress"])
    path = str(tmp_path / "m.pcf4")
    container.write_container(checkpoint.resolve(run_dir), path, group_size=16, progress=False)
    lms = {"checkpoint": ev.load_model(run_dir, "cpu", "float32"), "hf": ev.load_model(str(tmp_path / "hf"), "cpu",
                                                                                        "float32"),
           "int4": ev.load_model(path, "cpu", "float32")}
    lms["engine"] = ev.EngineModel(type("Engine", (), {"context": 64})(), tok, "e")
    byte = [b + 1 for b in range(256)]  # the byte tokens' ids
    emoji, end = list("\U0001f642".encode()), tok.special_ids["<|end|>"]
    scripts = [tok.encode(" 12, 13") + [0] + tok.encode("14"),  # an id with no text between digits
               tok.encode(" 12,") + [byte[emoji[0]], 0, byte[emoji[1]], tok.bos_id, byte[emoji[2]], byte[emoji[3]]],
               tok.encode(" 12") + [byte[0xf0], byte[0x9f]] + tok.encode("13") + [byte[0xed], byte[0xa0], byte[0x80],
                                                                                   byte[0xc0], byte[0xaf], byte[0x80]]]
    for script in scripts:
        assert len({lm.decode(script) for lm in lms.values()}) == 1, {k: lm.decode(script) for k, lm in lms.items()}
        got = {}
        for name, lm in lms.items():
            it = iter(script + [end])
            if name == "engine":
                lm.engine.stream = lambda ids, n, temperature=0, it=it: (t for t in it)
            else:
                def head(h, it=it):  # the model's greedy choices, scripted
                    logits = torch.zeros(h.shape[0], tok.vocab_size)
                    logits[:, next(it)] = 1.0
                    return logits
                lm.head = head
            text = ev.greedy_generate(lm, "Count from 10 to 14:\n10, 11,", ["\n"], 20)
            got[name] = (text, et.counting_scores(text, " 12, 13, 14"))
        assert len(set(map(str, got.values()))) == 1, got
    assert got["hf"][0] == " 12\ufffd13" + "\ufffd" * 6


def test_synthetic_tasks_share_an_out_with_data_dir_tasks(hf_setup, tmp_path, capsys):
    """counting scored into --out, then piqa with --data-dir into the same --out, was refused as "another evaluation
    (data 'hub', now DIR)": counting reads no data, so its result does not depend on where the data came from."""
    _, model_dir, data_dir, _ = hf_setup
    out = str(tmp_path / "res")
    common = [model_dir, "--limit", "2", "--max-gen-toks", "4", "--out", out, "--device", "cpu"]
    assert ev.main(common + ["--tasks", "counting"]) == 0
    assert ev.main(common + ["--tasks", "piqa", "--data-dir", data_dir]) == 0, capsys.readouterr().err
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert set(summary["results"]) == {"counting", "piqa"} and summary["data"] == os.path.abspath(data_dir)
    assert ev.main(common + ["--tasks", "counting"]) == 0  # rescored without --data-dir: piqa's data is still DIR
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert set(summary["results"]) == {"counting", "piqa"} and summary["data"] == os.path.abspath(data_dir)
    other = tmp_path / "other"
    other.mkdir()
    (other / "arc_easy.jsonl").write_text(open(os.path.join(data_dir, "arc_easy.jsonl")).read())
    assert ev.main(common + ["--tasks", "arc_easy", "--data-dir", str(other)]) == 2  # data tasks still checked
    assert "(data " in capsys.readouterr().err


def test_a_long_task_says_how_far_it_is(hf_setup, tmp_path, capsys, monkeypatch):
    """A task printed nothing until it was done: hellaswag's 10k examples on a CPU, or an int4 engine's one request
    at a time, sat silent for hours. Now a line on stderr every PROGRESS_EVERY_S (here: every batch / example)."""
    _, model_dir, data_dir, _ = hf_setup
    monkeypatch.setattr(ev, "PROGRESS_EVERY_S", 0)
    common = [model_dir, "--data-dir", data_dir, "--limit", "3", "--batch-size", "1", "--device", "cpu"]
    assert ev.main(common + ["--tasks", "piqa,counting", "--max-gen-toks", "4"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"piqa: \d+/6 requests \(\d+%\)", err) and re.search(r"counting: \d+/3 examples", err), err
    monkeypatch.setattr(ev, "PROGRESS_EVERY_S", 3600)  # the default spacing: a quick task says nothing
    assert ev.main(common + ["--tasks", "piqa"]) == 0
    assert "requests (" not in capsys.readouterr().err


class CharLM:
    """eval.py's engine wrapper minus the model: one token per character (BOS 1 first), a context of 8 tokens; the
    engine records each loglikelihood request and streams 'x' tokens."""
    max_length, stop_ids, prefix_id = 8, {2}, 1

    def __init__(self):
        lm = self

        class Engine:
            def loglikelihood(self, ctx, cont):
                lm.seen.append((list(ctx), list(cont)))
                return 0.0, True

            def stream(self, ids, n, temperature=0):
                lm.seen.append(list(ids))
                yield from [ord("x")] * n
        self.engine, self.seen = Engine(), []

    def encode(self, text, add_special_tokens=None):
        return ([] if add_special_tokens is False else [1]) + [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_inputs_cut_to_the_context_are_said_as_the_harness_warns(capsys, monkeypatch):
    """lm-eval-harness cuts a (context, continuation) longer than the model's context on the left, and a
    generate_until prompt to max_length - max_gen_toks, warning each time; eval.py cut both without a word (a 5-shot
    gsm8k on a 256-token model lost its shots unseen). A continuation longer than the context (the harness asserts)
    named neither the task nor the fix."""
    lm = CharLM()
    docs = [{"requests": [("abc", " d"), ("abcdefghijkl", " mn")]}]  # 4 + 3 tokens fit; 13 + 3 is 7 over 8 + 1
    ev.loglikelihoods(lm, docs, task="piqa")
    assert lm.seen[1] == (lm.encode("abcdefghijkl")[-6:], lm.encode(" mn", False))  # the harness's window
    err = capsys.readouterr().err
    assert "note: piqa: 1 of 2 requests longer than the model's context (8 tokens) cut on the left" in err, err
    assert "up to 7 tokens dropped" in err
    ev.loglikelihoods(lm, [{"requests": [("a", " b")]}], task="piqa")
    assert "cut" not in capsys.readouterr().err  # nothing cut, nothing said
    with pytest.raises(ev.EvalError, match=r"^task piqa: example 1: a continuation of 9 tokens exceeds the model's "
                                           r"context of 8 tokens; leave piqa out"):
        ev.loglikelihoods(lm, [{"requests": [("a", " b")]}, {"requests": [("a", " bcdefghi")]}], task="piqa")
    monkeypatch.setattr(ev.ET, "task_docs", lambda task, lm, args: [
        {"prompt": p, "until": ["\n"], "max_gen_toks": 3, "target": "x"} for p in ("ab", "abcdefgh")])
    lm.seen.clear()
    docs, _, _ = ev.run_task(lm, "counting", type("Args", (), {"max_gen_toks": None, "bootstrap_iters": 0})())
    assert lm.seen[1] == lm.encode("abcdefgh")[-5:] and docs[1]["generation"] == "xxx"
    err = capsys.readouterr().err
    assert "note: counting: 1 of 2 prompts longer than the model's context (8 tokens) cut on the left" in err, err
    assert "up to 4 tokens dropped" in err


def test_bos_convention_is_the_harness_s_and_is_said(hf_setup, tmp_path, capsys):
    """A Llama/SmolLM-style tokenizer that puts BOS before every text, beside the GPT-2 one that adds none: eval.py
    encodes as lm-eval's HFLM does (its default add_bos_token), and says which one it used (stderr, summary.json),
    as scores compared with published ones depend on it."""
    import shutil
    from tokenizers import processors
    from transformers import AutoTokenizer
    from lm_eval.models.huggingface import HFLM
    _, model_dir, data_dir, _ = hf_setup
    bos_dir = str(tmp_path / "bos_model")
    shutil.copytree(model_dir, bos_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", pair=f"{tok.bos_token} $A {tok.bos_token} $B",
        special_tokens=[(tok.bos_token, bos)])
    tok.save_pretrained(bos_dir)
    for d, added in ((model_dir, False), (bos_dir, True)):
        ref = HFLM(pretrained=d, device="cpu", batch_size=1, dtype="float32")
        lm = ev.load_model(d, "cpu", "float32")
        assert (ref.tok_encode("the cat")[:1] == [bos]) == added and lm.encode("the cat") == ref.tok_encode("the cat")
        assert ev.encode_pair(lm, "the cat", " sees", {}) == tuple(ref._encode_pair("the cat", " sees"))
        out = tmp_path / f"out{int(added)}"
        capsys.readouterr()
        assert ev.main([d, "--tasks", "winogrande", "--limit", "2", "--data-dir", data_dir, "--device", "cpu",
                        "--out", str(out)]) == 0
        err = capsys.readouterr().err
        said = "BOS <|endoftext|> put before every text" if added else "no BOS before every text"
        assert said in err and "an empty context is <|endoftext|>" in err, err
        summary = json.load(open(out / "summary.json"))
        assert summary["bos_added"] is added and summary["empty_context_token"] == "<|endoftext|>"


def test_max_length_of_a_composite_config_is_its_text_model_s(hf_setup):
    """Gemma3 / Mistral3 / Llama4 configs keep max_position_embeddings in text_config only: eval.py fell through to
    the tokenizer's unset model_max_length and cut inputs at 2048 tokens where lm-eval (resolve_max_length) reads
    131072 from text_config."""
    from transformers import AutoTokenizer, GPT2Config
    from lm_eval.models.utils import resolve_max_length
    _, model_dir, _, _ = hf_setup
    lm = ev.load_model(model_dir, "cpu", "float32")
    tok = AutoTokenizer.from_pretrained(model_dir)
    lm.model.config.text_config = GPT2Config(n_positions=131072)
    got = ev.HFModel(lm.model, tok, model_dir, "cpu").max_length
    del lm.model.config.text_config
    assert got == resolve_max_length(GPT2Config(text_config=GPT2Config(n_positions=131072)), tok) == 131072


def test_a_task_with_no_examples_names_the_fix_for_where_its_data_came_from(monkeypatch):
    """An empty task said "drop --data-dir to download them" to a run given no --data-dir (its rows came from the Hub's
    cached copy): each source now gets its own fix."""
    import argparse
    monkeypatch.setattr(ev.ET, "task_docs", lambda task, lm, args: [])
    for data_dir, fix in (("d", "under --data-dir, or drop --data-dir"), (None, "delete its cached copy under /c")):
        with pytest.raises(ev.EvalError, match=fix):
            ev.run_task(None, "piqa", argparse.Namespace(data_dir=data_dir, cache_dir="/c"))


def test_a_second_eval_into_the_same_out_says_so_and_writes_nothing(hf_setup, tmp_path, capsys):
    """Two evals into one --out at once (two terminals, a cron job and a hand run) both said they succeeded, and the
    later summary.json dropped the other's tasks without a word. One eval holds --out (an flock) while it writes."""
    import fcntl
    _, model_dir, data_dir, _ = hf_setup
    out = tmp_path / "res"
    out.mkdir()
    held = os.open(out, os.O_RDONLY)  # the other eval.py, mid-run
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        assert ev.main([model_dir, "--tasks", "piqa", "--data-dir", data_dir, "--out", str(out)]) == 2
    finally:
        os.close(held)
    err = capsys.readouterr().err.strip().splitlines()
    assert "another eval.py is writing there" in err[-1] and "Traceback" not in "".join(err) and os.listdir(out) == []
    assert ev.main([model_dir, "--tasks", "piqa", "--data-dir", data_dir, "--out", str(out)]) == 0  # once it ended
    assert list(json.load(open(out / "summary.json"))["results"]) == ["piqa"]
    # the other eval made --out (new) just before this one looked: this one leaves it, empty, to the other one
    new, real_hold, others = tmp_path / "new", ev.hold_out, []

    def the_other_made_it_first(path):
        others.append(os.open(ev.os.makedirs(path) or path, os.O_RDONLY))
        fcntl.flock(others[0], fcntl.LOCK_EX)
        return real_hold(path)
    ev.hold_out = the_other_made_it_first
    try:
        assert ev.main([model_dir, "--tasks", "piqa", "--data-dir", data_dir, "--out", str(new)]) == 2
    finally:
        ev.hold_out = real_hold
        os.close(others[0])
    assert "another eval.py" in capsys.readouterr().err and new.is_dir()
