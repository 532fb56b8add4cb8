"""export.py: HF export loads in transformers with picaflor's logits and tokenization; GGUF has what llama.cpp's
hy_v3 loader needs and dequantizes back to the weights; bad checkpoints give one-line errors.
(int4 container round-trip, truncation and magic checks are container.py's tests.)"""

import contextlib
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoint  # noqa: E402
import export  # noqa: E402
import model as M  # noqa: E402
import tokenizer as T  # noqa: E402

CFG = dict(vocab_size=400, n_layer=3, n_dense_layers=1, d_model=64, n_head=4, n_kv_head=2, dense_ffn=128,
           n_experts=8, expert_ffn=32, n_shared=2, top_k=2, route_scale=1.5, max_seq_len=128)
FULL_CFG = asdict(M.ModelConfig(**CFG))  # as a state.json holds it: every field

WORDS = ("the quick brown fox jumps over the lazy dog café naïve über straße 東京 日本語 😀 🇫🇷 Ω≈ç√ "
         "def return import class 123 4567 3.14159 don't I'll WE'RE hello world").split()

SAMPLES = [
    "Hello world, the quick brown fox!",
    "café naïve über 東京 😀😀 ",
    "def f(x):\n    return x**2  \n\n\n",
    "   leading spaces\ttabs\r\nCRLF\r\n",
    "numbers 1234567 3.14159 don't I'll WE'RE",
    "ĀĂ ß ẞ ǅ  Ω≈ç√∫ 🇫🇷 \u200b zero-width 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "", " ", "a" * 50, "\n", "!!!???...", "ü" * 7 + " x",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(12)) + rng.choice(["\n", "  \n\n", " ", "\t"])
             for _ in range(300)]
    tok = T.train_tokenizer(texts, 400)
    tok_path = str(d / "tok.json")
    tok.save(tok_path)
    torch.manual_seed(0)
    m = M.Picaflor(M.ModelConfig(**CFG)).eval()
    with torch.no_grad():
        for moe in m.moe_layers():  # a non-trivial selection bias, so a dropped bias changes the logits
            moe.e_score_correction_bias.normal_(0, 0.1)
    path = M.save_checkpoint(m, str(d / "run"), 7, tokenizer_file=tok_path)
    return {"dir": d, "path": path, "run": str(d / "run"), "tok": tok}


def run_export(args):
    """export.main; returns the report dict, or raises SystemExit with the error line."""
    import io
    from contextlib import redirect_stdout
    buf = io.StringIO()
    with redirect_stdout(buf):
        export.main(args + ["--no-progress"])
    return json.loads(buf.getvalue().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hf_fp32(ckpt):
    out = str(ckpt["dir"] / "hf32")
    rep = run_export([ckpt["run"], "--format", "hf", "--out", out, "--dtype", "float32", "--max-shard-size", "300KB"])
    return out, rep


def test_hf_export_loads_and_matches_logits_fp32(ckpt, hf_fp32):
    from transformers import AutoModelForCausalLM
    out, rep = hf_fp32
    assert rep["shards"] > 1 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    for name in ("model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.2.mlp.router.gate.weight",
                 "model.layers.1.mlp.expert_bias", "model.layers.2.mlp.shared_mlp.up_proj.weight"):
        assert name in index["weight_map"], name  # Hub (Hy3) names, as llama.cpp's converter expects
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["HYV3ForCausalLM"] and cfg["model_type"] == "hy_v3"
    assert cfg["bos_token_id"] == ckpt["tok"].bos_id and cfg["torch_dtype"] == "float32"
    assert "HYV3ForCausalLM" in open(os.path.join(out, "README.md")).read()  # the model card
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "HYV3ForCausalLM"
    assert hf.model.layers[1].mlp.gate.weight.dtype == torch.float32
    ours = M.load_checkpoint(ckpt["path"])
    idx = torch.randint(1, 400, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(idx), hf(idx).logits
    assert (a - b).abs().max().item() <= 1e-4


def test_model_card_names_the_tokens_generation_stops_at(ckpt, hf_fp32):
    """The card said generation stops at <|end|> or <|bos|>; generation_config.json stops at all five specials (a
    turn the model opens on its own too). The card's stop sentence names exactly the ids the settings hold."""
    import re
    gen = json.load(open(os.path.join(hf_fp32[0], "generation_config.json")))
    names = {name for name, i in ckpt["tok"].special_ids.items() if i in gen["eos_token_id"]}
    assert len(names) == len(gen["eos_token_id"]) == len(T.SPECIAL_TOKENS)
    card = open(os.path.join(hf_fp32[0], "README.md")).read()
    said = card[card.index("Generation stops"):].split("\n\n")[0]  # that paragraph, from the sentence on
    assert set(re.findall(r"<\|[a-z]+\|>", said)) == names, said


def test_hf_export_bf16_within_bf16_tolerance(ckpt):
    from transformers import AutoModelForCausalLM
    out = str(ckpt["dir"] / "hf16")
    run_export([ckpt["path"], "--format", "hf", "--out", out, "--dtype", "bfloat16"])
    assert os.path.isfile(os.path.join(out, "model.safetensors"))  # under 5GB: one file, no index
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert hf.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays fp32
    ref = M.load_checkpoint(ckpt["path"])
    idx = torch.randint(1, 400, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = ref(idx), hf(idx).logits.float()
    scale = a.abs().max().item()
    assert (a - b).abs().max().item() <= 0.05 * scale  # bf16 weights and activations: ~3 significant digits
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.9


def test_generation_config_has_no_penalty(hf_fp32):
    gen = json.load(open(os.path.join(hf_fp32[0], "generation_config.json")))
    assert gen.get("repetition_penalty", 1.0) == 1.0
    assert gen.get("no_repeat_ngram_size", 0) == 0
    assert gen.get("encoder_repetition_penalty", 1.0) == 1.0
    for k in ("presence_penalty", "frequency_penalty", "sequence_bias", "bad_words_ids", "exponential_decay_length_penalty"):
        assert gen.get(k) in (None, 0, 0.0), k
    from transformers import GenerationConfig
    gc = GenerationConfig.from_pretrained(hf_fp32[0])
    assert gc.repetition_penalty == 1.0 and not gc.no_repeat_ngram_size


def test_generation_stops_at_every_special_token_as_chat_does(ckpt, hf_fp32):
    """chat.py ends a reply at any special token; HF generation stopped at <|end|> and <|bos|> only and ran on into
    a <|user|> turn of its own."""
    from transformers import GenerationConfig
    gc = GenerationConfig.from_pretrained(hf_fp32[0])
    assert sorted(gc.eos_token_id) == sorted(ckpt["tok"].special_ids.values())


def test_hf_tokenizer_encodes_identically(ckpt, hf_fp32):
    from transformers import AutoTokenizer
    tok = ckpt["tok"]
    ht = AutoTokenizer.from_pretrained(hf_fp32[0])
    rng = random.Random(3)
    texts = SAMPLES + ["".join(rng.choice(WORDS + [" ", "  ", "\n", ",", "'s"]) for _ in range(30)) for _ in range(40)]
    for t in texts:
        ids = tok.encode(t)
        assert ht.encode(t, add_special_tokens=False) == ids, repr(t)
        assert ht.decode(ids) == tok.decode(ids)
    assert ht("hi").input_ids == [tok.bos_id] + tok.encode("hi")  # documents start with <|bos|>, as in training
    assert ht.convert_tokens_to_ids("<|end|>") == tok.special_ids["<|end|>"]
    # <|pad|> is id 0 (config.json's pad_token_id) and no real token's id: once it took the top BPE token's, which
    # transformers then decoded as <|pad|> or dropped with skip_special_tokens
    top = len(tok.token_bytes)
    assert ht.convert_tokens_to_ids("<|pad|>") == 0 == ht.pad_token_id
    assert ht.decode([top], skip_special_tokens=True) == tok.decode([top]) != ""
    every = list(range(1, top + 1))
    assert ht.convert_ids_to_tokens(every).count("<|pad|>") == 0
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = ht.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"
    ids = ht.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    sp = tok.special_ids
    assert ids == ([sp["<|bos|>"], sp["<|system|>"]] + tok.encode("Be brief.") + [sp["<|end|>"], sp["<|user|>"]]
                   + tok.encode("Hi") + [sp["<|end|>"], sp["<|assistant|>"]])
    # the tiktoken file travels with the export
    assert T.Tokenizer.load(os.path.join(hf_fp32[0], "picaflor_tokenizer.json")).hash == tok.hash
    with pytest.raises(ValueError, match="a Hugging Face tokenizers file, not picaflor's; pass the picaflor_tokenizer"):
        T.Tokenizer.load(os.path.join(hf_fp32[0], "tokenizer.json"))  # (was: "corrupt tokenizer file")


def test_hf_chat_template_marks_the_assistant_tokens_chat_py_trains_on(ckpt, hf_fp32):
    """TRL's assistant-only loss takes return_assistant_tokens_mask, which needs {% generation %} in the template:
    the mask must be chat.py's (an assistant's content and its <|end|>), and the rendering unchanged without it."""
    import chat
    from transformers import AutoTokenizer
    ht = AutoTokenizer.from_pretrained(hf_fp32[0])
    convs = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello there, don't worry"}, {"role": "user", "content": "café?"},
              {"role": "assistant", "content": "東京 😀"}],
             [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]]
    for msgs in convs:
        ids, mask = chat.render_conversation(ckpt["tok"], msgs)
        out = ht.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert list(out["input_ids"]) == ids
        assert list(out["assistant_masks"]) == mask
        plain = ht.apply_chat_template(msgs, tokenize=True, return_dict=True)
        assert list(plain["input_ids"]) == ids
        assert ht.apply_chat_template(msgs, tokenize=False) == "<|bos|>" + "".join(
            f"<|{m['role']}|>{m['content']}<|end|>" for m in msgs)
    # llama.cpp gets the template without the transformers-only tags, rendering the same text
    import jinja2
    assert "generation %}" not in export.GGUF_CHAT_TEMPLATE and "{% generation %}" in export.CHAT_TEMPLATE
    gguf_tmpl = jinja2.Environment().from_string(export.GGUF_CHAT_TEMPLATE)
    for msgs in convs:
        for gen in (False, True):
            assert gguf_tmpl.render(messages=msgs, bos_token="<|bos|>", add_generation_prompt=gen) == \
                ht.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def expected_gguf_tensors(c):
    """name -> shape in ggml order (ne0 first), as llama.cpp's hy_v3 loader creates them (src/models/hy-v3.cpp)."""
    hd, E, F, Fs = c.head_dim, c.n_experts, c.expert_ffn, c.n_shared * c.expert_ffn
    want = {"token_embd.weight": [c.d_model, c.vocab_size], "output_norm.weight": [c.d_model],
            "output.weight": [c.d_model, c.vocab_size]}
    for i in range(c.n_layer):
        b = f"blk.{i}."
        want.update({b + "attn_norm.weight": [c.d_model], b + "attn_q.weight": [c.d_model, c.n_head * hd],
                     b + "attn_k.weight": [c.d_model, c.n_kv_head * hd], b + "attn_v.weight": [c.d_model, c.n_kv_head * hd],
                     b + "attn_output.weight": [c.n_head * hd, c.d_model], b + "attn_q_norm.weight": [hd],
                     b + "attn_k_norm.weight": [hd], b + "ffn_norm.weight": [c.d_model]})
        if i < c.n_dense_layers:
            want.update({b + "ffn_gate.weight": [c.d_model, c.dense_ffn], b + "ffn_up.weight": [c.d_model, c.dense_ffn],
                         b + "ffn_down.weight": [c.dense_ffn, c.d_model]})
        else:
            want.update({b + "ffn_gate_inp.weight": [c.d_model, E], b + "exp_probs_b": [E],
                         b + "ffn_gate_exps.weight": [c.d_model, F, E], b + "ffn_up_exps.weight": [c.d_model, F, E],
                         b + "ffn_down_exps.weight": [F, c.d_model, E],
                         b + "ffn_gate_shexp.weight": [c.d_model, Fs], b + "ffn_up_shexp.weight": [c.d_model, Fs],
                         b + "ffn_down_shexp.weight": [Fs, c.d_model]})
    return want


def source_weights_as_gguf(path):
    """The checkpoint's tensors under their GGUF names (stacked experts split into gate / up), float32 numpy."""
    from safetensors.torch import load_file
    out = {}
    for name, t in load_file(os.path.join(path, "model.safetensors")).items():
        for gname, part in export.gguf_name(name):
            if part:
                half = t.shape[1] // 2
                t2 = t[:, :half] if part == "gate" else t[:, half:]
            else:
                t2 = t
            out[gname] = t2.float().numpy()
    return out


@pytest.mark.parametrize("gtype,tol", [("f16", 1e-3), ("bf16", 8e-3), ("q8_0", 0.02), ("q4_0", 0.25)])
def test_gguf_has_loader_names_keys_and_dequantizes(ckpt, gtype, tol):
    import gguf
    out = str(ckpt["dir"] / f"m_{gtype}.gguf")
    run_export([ckpt["path"], "--format", "gguf", "--out", out, "--gguf-type", gtype])
    r = gguf.GGUFReader(out)
    c = M.ModelConfig(**CFG)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert kv["general.architecture"] == "hy_v3"
    A = "hy_v3."
    need = {A + "context_length": c.max_seq_len, A + "embedding_length": c.d_model, A + "block_count": c.n_layer,
            A + "feed_forward_length": c.dense_ffn, A + "attention.head_count": c.n_head,
            A + "attention.head_count_kv": c.n_kv_head, A + "rope.dimension_count": c.head_dim,
            A + "expert_count": c.n_experts, A + "expert_used_count": c.top_k, A + "expert_shared_count": c.n_shared,
            A + "expert_feed_forward_length": c.expert_ffn,
            A + "expert_shared_feed_forward_length": c.n_shared * c.expert_ffn,
            A + "leading_dense_block_count": c.n_dense_layers, A + "expert_weights_norm": True,
            A + "expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.bos_token_id": ckpt["tok"].bos_id,
            "tokenizer.ggml.eos_token_id": ckpt["tok"].special_ids["<|end|>"],
            "tokenizer.ggml.eot_token_id": ckpt["tok"].special_ids["<|end|>"],
            "tokenizer.ggml.eom_token_id": ckpt["tok"].bos_id,  # llama.cpp's end-of-generation set: every special
            "tokenizer.ggml.fim_pad_token_id": ckpt["tok"].special_ids["<|user|>"],
            "tokenizer.ggml.fim_rep_token_id": ckpt["tok"].special_ids["<|assistant|>"],
            "tokenizer.ggml.fim_sep_token_id": ckpt["tok"].special_ids["<|system|>"]}
    assert not any(k in kv for k in ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id",
                                     "tokenizer.ggml.fim_mid_token_id"))  # so no infill uses those three
    for k, v in need.items():
        assert kv.get(k) == v, (k, kv.get(k), v)
    assert kv[A + "expert_weights_scale"] == pytest.approx(c.route_scale)
    assert kv[A + "rope.freq_base"] == pytest.approx(c.rope_theta)
    assert kv[A + "attention.layer_norm_rms_epsilon"] == pytest.approx(c.norm_eps)
    assert kv["tokenizer.ggml.pre"] == "llama-bpe"
    assert kv["tokenizer.chat_template"] == export.GGUF_CHAT_TEMPLATE  # (no transformers-only {% generation %})
    tokens = kv["tokenizer.ggml.tokens"]
    assert len(tokens) == c.vocab_size and len(kv["tokenizer.ggml.token_type"]) == c.vocab_size
    inv = {ch: b for b, ch in export.byte_to_unicode().items()}
    tok = ckpt["tok"]
    assert [bytes(inv[ch] for ch in tokens[i + 1]) for i in range(len(tok.token_bytes))] == tok.token_bytes
    assert tokens[tok.bos_id] == "<|bos|>"
    hf_merges = export.bpe_vocab_and_merges(tok)[1]
    assert kv["tokenizer.ggml.merges"] == [f"{a} {b}" for a, b in hf_merges]

    want = expected_gguf_tensors(c)
    got = {t.name: t for t in r.tensors}
    assert set(got) == set(want)  # nothing missing, nothing extra (llama.cpp rejects unused tensors)
    src = source_weights_as_gguf(ckpt["path"])
    for name, shape in want.items():
        t = got[name]
        assert [int(x) for x in t.shape] == shape, name
        deq = gguf.quants.dequantize(t.data, t.tensor_type).reshape(src[name].shape)
        if len(shape) == 1 or "ffn_gate_inp" in name:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
            np.testing.assert_array_equal(deq, src[name])
        else:
            err = np.abs(deq - src[name]).max() / max(np.abs(src[name]).max(), 1e-12)
            assert err <= tol, (name, err)


def test_gguf_pretokenizer_regex_is_llama3s(ckpt):
    """llama.cpp splits text with its 'llama-bpe' regex (llama-vocab.cpp, LLAMA3); ours must split the same."""
    import regex
    llama3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    ours = regex.compile(ckpt["tok"].pattern)
    rng = random.Random(4)
    pieces = WORDS + [" ", "  ", "\n", "\r\n", " \n ", "\t", "'s", "'LL", "...", "\n\n\n", "99999", "é'd"]
    texts = SAMPLES + ["".join(rng.choice(pieces) for _ in range(40)) for _ in range(200)]
    for t in texts:
        assert ours.findall(t) == regex.findall(llama3, t), repr(t)


def test_bad_manifest_is_one_line_error_naming_the_file(ckpt, tmp_path):
    import shutil
    bad = tmp_path / "step_0000007"
    shutil.copytree(ckpt["path"], bad)
    with open(bad / "model.safetensors", "r+b") as f:  # flip one byte of the weights
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(SystemExit) as e:
        run_export([str(bad), "--format", "hf", "--out", str(tmp_path / "o")])
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg and "model.safetensors" in msg and "sha256" in msg
    assert not os.path.exists(tmp_path / "o")
    (bad / "MANIFEST.json").write_text("{not json")
    with pytest.raises(SystemExit) as e:
        run_export([str(bad), "--format", "gguf", "--out", str(tmp_path / "o.gguf")])
    msg = str(e.value.code)
    assert "MANIFEST.json" in msg and "\n" not in msg
    assert not os.path.exists(tmp_path / "o.gguf")


def test_tied_embeddings_hf_and_gguf(ckpt, tmp_path):
    """tie_embeddings (config/tiny.py): no lm_head in the checkpoint; HF ties it, GGUF has no output.weight."""
    import gguf
    from transformers import AutoModelForCausalLM
    torch.manual_seed(1)
    m = M.Picaflor(M.ModelConfig(**{**CFG, "tie_embeddings": True})).eval()
    path = M.save_checkpoint(m, str(tmp_path / "run"), 1, tokenizer_file=os.path.join(ckpt["dir"], "tok.json"))
    run_export([path, "--format", "hf", "--out", str(tmp_path / "hf"), "--dtype", "float32"])
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    idx = torch.randint(1, 400, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (M.load_checkpoint(path)(idx) - hf(idx).logits).abs().max().item() <= 1e-4
    run_export([path, "--format", "gguf", "--out", str(tmp_path / "t.gguf"), "--gguf-type", "q8_0"])
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors}
    want = set(expected_gguf_tensors(m.cfg)) - {"output.weight"}  # llama.cpp falls back to token_embd
    assert names == want


def test_int4_export_writes_a_loadable_container(ckpt, tmp_path, capsys):
    import container
    import shlex
    import stream_infer
    out = str(tmp_path / "m.pcf4")
    rep = run_export([ckpt["run"], "--format", "int4", "--out", out, "--group-size", "32"])
    assert rep["format"] == "int4" and os.path.isfile(out)
    # after the JSON, stderr names the command that runs the export (it printed the JSON alone); that command runs
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("next: python stream_infer.py "), said
    cmd = shlex.split(said[len("next: "):].split(" (")[0])
    assert cmd[:3] == ["python", "stream_infer.py", out] and stream_infer.main(cmd[2:] + ["--max-new-tokens", "2"]) == 0
    assert "from_pretrained('o u t')" in export.next_step("hf", "o u t")
    assert export.next_step("gguf", "o u t").startswith("next: llama-cli -m 'o u t' --jinja")
    c = container.load_container(out)
    assert c.config == M.ModelConfig(**CFG) and c.group_size == 32
    sd = c.dequantized_state_dict()
    ref = M.load_checkpoint(ckpt["path"]).state_dict()
    w, q = ref["layers.1.mlp.experts.gate_up_proj"], sd["layers.1.mlp.experts.gate_up_proj"]
    assert (w - q).abs().max().item() <= 0.25 * w.abs().max().item()  # int4: coarse but close


def test_int4_measure_counts_the_padding_of_widths_no_multiple_of_the_group(ckpt, tmp_path):
    """container.py --measure printed 4 + 32 / g bits per weight whatever the shapes: at d_model 72 and expert_ffn 24
    the container pads every group to 128 columns (~2.5x the bytes), and the table still said 4.25 at group 128. Its
    bits are the container's bytes over the true weights now; widths that divide every group keep the nominal
    figure."""
    import container
    odd = {**CFG, "d_model": 72, "n_head": 3, "n_kv_head": 1, "expert_ffn": 24}
    for cfg, g, padded in ((CFG, 32, False), (odd, 128, True)):
        torch.manual_seed(0)
        run = M.save_checkpoint(M.Picaflor(M.ModelConfig(**cfg)), str(tmp_path / f"run{g}"), 1)
        for r in container.measure_quantization(run, group_sizes=(g,)):
            assert (r["bits_per_weight"] > 1.5 * (4 + 32 / g)) if padded else r["bits_per_weight"] == 4 + 32 / g, r


def test_quant_quality_bench_reports_both_perplexities(ckpt, tmp_path, capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import quant_quality
    toks = np.random.default_rng(0).integers(1, ckpt["tok"].bos_id, size=300).astype("<u2")
    toks.tofile(tmp_path / "toks.bin")
    res = quant_quality.main([ckpt["path"], "--tokens", str(tmp_path / "toks.bin"), "--seq-len", "32",
                              "--engine", "dequantize", "--dtype", "float32", "--json", str(tmp_path / "q.json")])
    assert res["tokens"] == (300 - 1) // 32 * 32 and res["int4_path"] == "dequantize"
    assert res["ppl_checkpoint"] > 1 and res["ppl_int4"] > 1
    assert abs(res["rel_increase"]) < 0.05  # random weights: int4 barely moves a near-uniform distribution
    assert json.load(open(tmp_path / "q.json"))["rel_increase"] == res["rel_increase"]
    # each stage says so as it starts (~40 s ran without a word), on stderr: stdout keeps the figures
    said = capsys.readouterr().err
    stages = ["scoring the checkpoint: 9 windows of 32 tokens", "writing its int4 container",
              "scoring the int4 container"]
    assert all(x in said for x in stages) and [said.find(x) for x in stages] == sorted(map(said.find, stages)), said


def gguf_forward(path, idx):
    """Logits computed from the GGUF file alone, following llama.cpp's hy_v3 graph (src/models/hy-v3.cpp:
    RMSNorm, per-head q/k RMSNorm, NEOX RoPE over rope.dimension_count, GQA, dense FFN for the leading
    blocks, sigmoid router + exp_probs_b for selection, weights normed then scaled, plus the shared expert)."""
    import gguf
    import torch.nn.functional as F
    r = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    W = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
         for t in r.tensors}
    A = "hy_v3."
    H, Hkv, hd = kv[A + "attention.head_count"], kv[A + "attention.head_count_kv"], kv[A + "attention.key_length"]
    eps, k_used, n_dense = kv[A + "attention.layer_norm_rms_epsilon"], kv[A + "expert_used_count"], kv[A + "leading_dense_block_count"]
    n_rot, base = kv[A + "rope.dimension_count"], kv[A + "rope.freq_base"]
    rms = lambda x, w: F.rms_norm(x, (x.shape[-1],), eps=eps) * w
    T = idx.shape[1]
    inv = 1.0 / base ** (torch.arange(0, n_rot, 2).float() / n_rot)
    ang = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    rope = lambda x: x * cos + torch.cat([-x[..., n_rot // 2:], x[..., :n_rot // 2]], -1) * sin  # NEOX
    x = W["token_embd.weight"][idx[0]]
    for i in range(kv[A + "block_count"]):
        b = lambda n: W[f"blk.{i}.{n}"]
        h = rms(x, b("attn_norm.weight"))
        q = rms((h @ b("attn_q.weight").T).view(T, H, hd), b("attn_q_norm.weight")).transpose(0, 1)
        k = rms((h @ b("attn_k.weight").T).view(T, Hkv, hd), b("attn_k_norm.weight")).transpose(0, 1)
        v = (h @ b("attn_v.weight").T).view(T, Hkv, hd).transpose(0, 1)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
        att = (q @ k.transpose(1, 2)) / hd ** 0.5 + torch.full((T, T), float("-inf")).triu(1)
        x = x + (att.softmax(-1) @ v).transpose(0, 1).reshape(T, H * hd) @ b("attn_output.weight").T
        h = rms(x, b("ffn_norm.weight"))
        ffn = lambda h, g, u, d: (F.silu(h @ g.T) * (h @ u.T)) @ d.T
        if i < n_dense:
            x = x + ffn(h, b("ffn_gate.weight"), b("ffn_up.weight"), b("ffn_down.weight"))
            continue
        probs = torch.sigmoid(h @ b("ffn_gate_inp.weight").T)
        sel = torch.topk(probs + b("exp_probs_b"), k_used, dim=-1).indices
        w = probs.gather(1, sel)
        if kv[A + "expert_weights_norm"]:
            w = w / w.sum(-1, keepdim=True)
        w = w * kv[A + "expert_weights_scale"]
        out = ffn(h, b("ffn_gate_shexp.weight"), b("ffn_up_shexp.weight"), b("ffn_down_shexp.weight"))
        for t in range(T):
            for j in range(k_used):
                e = sel[t, j]
                out[t] += w[t, j] * ffn(h[t:t + 1], b("ffn_gate_exps.weight")[e], b("ffn_up_exps.weight")[e],
                                        b("ffn_down_exps.weight")[e])[0]
        x = x + out
    x = rms(x, W["output_norm.weight"])
    return x @ W.get("output.weight", W["token_embd.weight"]).T


def test_gguf_alone_reproduces_the_logits(ckpt, tmp_path):
    """Every key and tensor the llama.cpp graph uses, read back from the file, gives picaflor's logits."""
    out = str(tmp_path / "m.gguf")
    run_export([ckpt["path"], "--format", "gguf", "--out", out, "--gguf-type", "f16"])
    idx = torch.randint(1, 400, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = M.load_checkpoint(ckpt["path"])(idx)[0]
        got = gguf_forward(out, idx)
    assert (ref - got).abs().max().item() <= 3e-3 * ref.abs().max().item()  # f16 weights (measured ~3e-4)
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean().item() >= 0.9


def test_hf_and_gguf_of_a_forked_shape_give_its_logits(ckpt, tmp_path):
    """Shapes CFG does not reach, together: MoE from layer 0, no GQA, 6 experts (no power of two) at top-3, a vocab no
    multiple of 64, route_scale 0.7; transformers and the GGUF (read back alone) give the checkpoint's logits."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(2)
    cfg = M.ModelConfig(**{**CFG, "n_dense_layers": 0, "n_kv_head": 4, "n_experts": 6, "top_k": 3, "vocab_size": 401,
                           "route_scale": 0.7})
    m = M.Picaflor(cfg).eval()
    with torch.no_grad():
        for moe in m.moe_layers():
            moe.e_score_correction_bias.normal_(0, 0.1)
    path = M.save_checkpoint(m, str(tmp_path / "run"), 1, tokenizer_file=str(ckpt["dir"] / "tok.json"))
    run_export([path, "--format", "hf", "--dtype", "float32", "--out", str(tmp_path / "hf")])
    run_export([path, "--format", "gguf", "--gguf-type", "f16", "--out", str(tmp_path / "m.gguf")])
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    idx = torch.randint(1, 401, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = m(idx)
        assert (hf(idx).logits - ref).abs().max().item() <= 1e-4
        got = gguf_forward(str(tmp_path / "m.gguf"), idx)
        assert (got - ref[0]).abs().max().item() <= 3e-3 * ref.abs().max().item()


def test_weights_not_matching_config_is_one_line_error(ckpt, tmp_path):
    import checkpoint
    from safetensors.torch import save_file
    m = M.Picaflor(M.ModelConfig(**CFG))
    sd = {k: v for k, v in m.state_dict().items() if not k.endswith("load_accum")}
    def saved(name, cfg):  # a step-1 checkpoint of sd under model_config cfg
        return checkpoint.save(str(tmp_path / name), 1, {
            "model.safetensors": lambda p: save_file(sd, p),
            "state.json": lambda p: open(p, "w").write(json.dumps({"step": 1, "model_config": cfg}))})
    # a config that lacks keys (CFG names no rope_theta / norm_eps): their defaults were exported as the model's
    path = saved("partial", CFG)
    with pytest.raises(SystemExit) as e:
        run_export([path, "--format", "hf", "--out", str(tmp_path / "hf")])
    msg = str(e.value.code)
    assert "state.json" in msg and "lacks keys" in msg and "rope_theta" in msg and "\n" not in msg, msg
    assert not os.path.exists(tmp_path / "hf")
    # (found by fuzzing) a max_seq_len past GGUF's 32-bit context_length, and a d_model whose tensors overflow torch's
    # sizes: a struct.error and a RuntimeError traceback
    for name, cfg, fmt, words in [("long", {**FULL_CFG, "max_seq_len": 2 ** 32}, "gguf", "32-bit context_length"),
                                  ("wide", {**FULL_CFG, "d_model": 10 ** 12}, "hf", "past torch's sizes")]:
        with pytest.raises(SystemExit) as e:
            run_export([saved(name, cfg), "--format", fmt, "--out", str(tmp_path / f"{name}.{fmt}"),
                        "--tokenizer", str(ckpt["dir"] / "tok.json")])
        assert words in str(e.value.code) and "\n" not in str(e.value.code), e.value.code
    del sd["layers.2.mlp.experts.down_proj"]  # a file that lost a tensor but has an intact manifest
    path = saved("run", FULL_CFG)
    with pytest.raises(SystemExit) as e:
        run_export([path, "--format", "gguf", "--out", str(tmp_path / "o.gguf")])
    msg = str(e.value.code)
    assert "model.safetensors" in msg and "layers.2.mlp.experts.down_proj" in msg and "\n" not in msg
    assert not os.path.exists(tmp_path / "o.gguf")


def test_gguf_from_int4_container_matches_the_container(ckpt, tmp_path):
    """A container (e.g. micro's random benchmark weights, which never existed in float) re-exported as GGUF:
    the GGUF's logits are the container's dequantized model's; other formats from a container are refused."""
    import container
    pcf = str(tmp_path / "m.pcf4")
    run_export([ckpt["path"], "--format", "int4", "--out", pcf, "--group-size", "32"])
    out = str(tmp_path / "from_int4.gguf")
    run_export([pcf, "--format", "gguf", "--out", out, "--gguf-type", "f16"])
    m = M.Picaflor(M.ModelConfig(**CFG))
    m.load_state_dict(container.load_container(pcf).dequantized_state_dict(), strict=False)
    idx = torch.randint(1, 400, (1, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref, got = m.eval()(idx)[0], gguf_forward(out, idx)
    assert (ref - got).abs().max().item() <= 3e-3 * ref.abs().max().item()
    with pytest.raises(SystemExit) as e:
        run_export([pcf, "--format", "hf", "--out", str(tmp_path / "hf")])
    msg = str(e.value.code)
    assert msg.startswith("error:") and pcf in msg and "--format gguf" in msg and "\n" not in msg


def test_out_never_replaces_the_source_or_a_foreign_folder(ckpt, tmp_path, capsys):
    """`--format hf` replaces its --out folder whole: given the run dir, or a folder of the user's, or `.`, it
    deleted it (checkpoints and all). Now only an earlier HF export is replaced; the rest is a one-line error."""
    import shutil
    run = str(tmp_path / "run")
    shutil.copytree(ckpt["run"], run)
    before = sorted(os.listdir(run))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("important")
    for out, fmt, want in [(run, "hf", "inside the source"), (str(mine), "hf", "has no picaflor_export.json"),
                           (os.path.join(run, "step_0000007", "x.gguf"), "gguf", "inside the source"),
                           (str(mine), "int4", "is a folder"),
                           # a file that is not an earlier export of that format (the run's LATEST was overwritten)
                           (os.path.join(run, "LATEST"), "int4", "not an earlier picaflor int4 export"),
                           (str(mine / "notes.txt"), "gguf", "not an earlier picaflor gguf export")]:
        latest = open(os.path.join(run, "LATEST")).read()
        with pytest.raises(SystemExit) as e:
            run_export([run, "--format", fmt, "--out", out])
        assert want in str(e.value) and "\n" not in str(e.value), e.value
        assert open(os.path.join(run, "LATEST")).read() == latest
    assert sorted(os.listdir(run)) == before and (mine / "notes.txt").read_text() == "important"
    # container.py's own CLI (`container.py CKPT --out PATH`) under the same rules: it overwrote a checkpoint's weights
    import container
    cfg_file = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config", "tiny.py")
    cfg_text = open(cfg_file).read()
    for args, want in [([run, "--out", os.path.join(run, "step_0000007", "model.safetensors")], "inside the source"),
                       ([run, "--out", str(mine)], "is a folder"),
                       ([run, "--out", str(tmp_path / "nope" / "x.pcf4")], "does not exist"),
                       (["--random-config", cfg_file, "--out", cfg_file], "is, holds or lies inside the source")]:
        capsys.readouterr()
        assert container.main(args) == 1
        err = capsys.readouterr().err
        assert want in err and len(err.strip().splitlines()) == 1, err
    assert open(cfg_file).read() == cfg_text
    import checkpoint
    checkpoint.verify(os.path.join(run, "step_0000007"))
    good = checkpoint.resolve(run)
    open(os.path.join(run, "LATEST"), "wb").write(b"PCFLINT4\xff\xfe")  # a LATEST something else overwrote
    assert checkpoint.resolve(run) == good  # the newest valid step, not a UnicodeDecodeError
    hf = str(tmp_path / "hf")
    os.mkdir(hf)  # an empty folder is fine
    run_export([run, "--format", "hf", "--out", hf])
    run_export([run, "--format", "hf", "--out", hf])  # an earlier export is replaced
    assert os.path.isfile(os.path.join(hf, "config.json"))
    # a downloaded HYV3 model has the same file names, and a user's notes may sit in an export: neither was spared
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "config.json").write_text(json.dumps({"architectures": ["HYV3ForCausalLM"]}))
    (hub / "model-00001-of-00080.safetensors").write_bytes(b"weights")
    (open(os.path.join(hf, "MY_NOTES.md"), "w")).write("mine")
    for out, want in [(str(hub), "has no picaflor_export.json"), (hf, "holds files an export does not write (MY_NOTES.md)")]:
        with pytest.raises(SystemExit) as e:
            run_export([run, "--format", "hf", "--out", out])
        assert want in str(e.value) and "\n" not in str(e.value), e.value
    assert sorted(os.listdir(hub)) == ["config.json", "model-00001-of-00080.safetensors"]
    assert open(os.path.join(hf, "MY_NOTES.md")).read() == "mine"
    # a GGUF file is replaced only when this export wrote it (any GGUF was: someone's 70B model)
    import gguf
    theirs = str(tmp_path / "theirs.gguf")
    w = gguf.GGUFWriter(theirs, arch="llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    ours = str(tmp_path / "ours.gguf")
    run_export([run, "--format", "gguf", "--out", ours])
    run_export([run, "--format", "gguf", "--out", ours])  # replaced
    with pytest.raises(SystemExit) as e:
        run_export([run, "--format", "gguf", "--out", theirs])
    assert "not an earlier picaflor gguf export" in str(e.value)
    assert gguf.GGUFReader(theirs).fields["general.architecture"].contents() == "llama"


def test_tokenizer_flag_reaches_the_int4_container_and_is_checked_for_hf(ckpt, tmp_path):
    """--tokenizer was ignored by --format int4 (the checkpoint's own was embedded), and --format hf wrote a
    tokenizer larger than the model's vocab (ids past the embedding: IndexError in transformers). Then --tokenizer
    replaced the checkpoint's own tokenizer with another of its vocab without a word (the export decoded to other
    text): that is refused now (by content: the same tokenizer elsewhere is fine), unless --force-tokenizer."""
    import container as C
    rng = random.Random(1)
    other = T.train_tokenizer([" ".join(rng.choice(WORDS[::-1]) for _ in range(12)) for _ in range(300)], 400)
    other_path = str(tmp_path / "other.json")
    other.save(other_path)
    own = os.path.join(checkpoint.resolve(ckpt["run"]), "tokenizer.json")
    out = str(tmp_path / "m.pcf4")
    with pytest.raises(SystemExit) as e:
        run_export([ckpt["run"], "--format", "int4", "--out", out, "--tokenizer", other_path])
    msg = str(e.value.code)
    assert other_path in msg and own in msg and "drop --tokenizer" in msg and "--force-tokenizer" in msg, msg
    assert "\n" not in msg and not os.path.exists(out)
    run_export([ckpt["run"], "--format", "int4", "--out", out, "--tokenizer", other_path, "--force-tokenizer"])
    assert C.load_container(out).tokenizer_json == open(other_path, encoding="utf-8").read()
    with pytest.raises(SystemExit) as e:  # (nothing to force: it was ignored)
        run_export([ckpt["run"], "--format", "int4", "--out", out + "3", "--force-tokenizer"])
    assert e.value.code == 2 and not os.path.exists(out + "3")
    # a container that carries a tokenizer is held to it too (re-exported as GGUF)
    with pytest.raises(SystemExit) as e:
        run_export([out, "--format", "gguf", "--out", str(tmp_path / "m.gguf"), "--tokenizer", str(ckpt["dir"] /
                                                                                                   "tok.json")])
    assert "--force-tokenizer" in str(e.value.code) and not os.path.exists(tmp_path / "m.gguf"), e.value.code
    # the checkpoint's own tokenizer from a corpus folder holding a copy, as prepare's --tokenizer takes (it said "no
    # such tokenizer file")
    os.makedirs(tmp_path / "corpus")
    shutil.copyfile(own, tmp_path / "corpus" / "tokenizer.json")
    run_export([ckpt["run"], "--format", "int4", "--out", out + "2", "--tokenizer", str(tmp_path / "corpus")])
    assert C.load_container(out + "2").tokenizer_json == open(own, encoding="utf-8").read()
    big = T.train_tokenizer([" ".join(rng.choice(WORDS) for _ in range(30)) + str(i) for i in range(3000)], 900)
    big_path = str(tmp_path / "big.json")
    big.save(big_path)
    if big.vocab_size > CFG["vocab_size"]:
        with pytest.raises(SystemExit) as e:
            run_export([ckpt["run"], "--format", "hf", "--out", str(tmp_path / "hf"), "--tokenizer", big_path,
                        "--force-tokenizer"])
        assert "tokenizer vocab" in str(e.value) and "pass the one its corpus was prepared with" in str(e.value)
        assert not os.path.exists(tmp_path / "hf")


def test_a_tokenizer_that_differs_only_in_line_endings_is_the_same_tokenizer(ckpt, tmp_path):
    """tokenizer.json checked out with CRLF (git autocrlf) is the same tokenizer: --tokenizer was refused for it (sha256
    of its bytes), a checkpoint carrying one wrote a container holding it with LF (the text read with universal
    newlines), and that container then refused the very checkpoint's tokenizer.json. The container holds the file's
    exact text now (its sha256 the manifest's), the check compares content, and another tokenizer is still refused."""
    import container as C
    own = os.path.join(checkpoint.resolve(ckpt["run"]), "tokenizer.json")
    crlf = tmp_path / "tok_crlf.json"
    crlf.write_bytes(open(own, "rb").read().replace(b"\n", b"\r\n"))
    assert export.Source(ckpt["run"], str(crlf)).tokenizer_path == own  # (what every format exports: its own bytes)
    # a checkpoint that carries the CRLF file
    ck2 = M.save_checkpoint(M.load_checkpoint(ckpt["path"]), str(tmp_path / "run2"), 7, tokenizer_file=str(crlf))
    out2 = str(tmp_path / "m2.pcf4")
    run_export([ck2, "--format", "int4", "--out", out2])
    held = C.load_container(out2).tokenizer_json.encode()
    assert C.CheckpointSource(ck2).tokenizer_json.encode() == held == crlf.read_bytes()  # (container.py CKPT --out)
    assert hashlib.sha256(held).hexdigest() == checkpoint.verify(ck2)["files"]["tokenizer.json"]["sha256"]
    run_export([out2, "--format", "gguf", "--out", str(tmp_path / "m.gguf"), "--tokenizer", os.path.join(ck2,
                                                                                                    "tokenizer.json")])
    assert T.Tokenizer.load(os.path.join(ck2, "tokenizer.json")).content_hash == ckpt["tok"].content_hash
    tok = ckpt["tok"]  # another tokenizer of the same vocab (its last two merges swapped), with CRLF too: refused
    other = T.Tokenizer(tok.pattern, tok.token_bytes[:-2] + tok.token_bytes[:-3:-1], tok.vocab_size)
    other_crlf = tmp_path / "other_crlf.json"
    other_crlf.write_bytes(other.to_bytes().replace(b"\n", b"\r\n"))
    for src in (ck2, out2):
        with pytest.raises(SystemExit) as e:
            run_export([src, "--format", "gguf", "--out", str(tmp_path / "o.gguf"), "--tokenizer", str(other_crlf)])
        assert "--force-tokenizer" in str(e.value.code) and not os.path.exists(tmp_path / "o.gguf")


def test_a_diverged_checkpoint_is_refused_by_every_format(ckpt, tmp_path):
    """One NaN made its whole int4 group NaN (the report said NaN, --check said ok); HF and GGUF wrote it as it was."""
    torch.manual_seed(0)
    m = M.Picaflor(M.ModelConfig(**CFG))
    with torch.no_grad():
        m.moe_layers()[0].experts.gate_up_proj[3, 5, 7] = float("nan")
    run = M.save_checkpoint(m, str(tmp_path / "run"), 1, tokenizer_file=str(ckpt["dir"] / "tok.json"))
    for fmt, out in (("int4", "x.pcf4"), ("hf", "hf"), ("gguf", "x.gguf")):
        with pytest.raises(SystemExit) as e:
            run_export([run, "--format", fmt, "--out", str(tmp_path / out)])
        msg = str(e.value.code)
        assert "gate_up_proj" in msg and "NaN or Inf" in msg and "earlier step_*" in msg and "\n" not in msg, msg
        assert not os.path.exists(tmp_path / out)


def test_shard_sizes_and_a_locale_without_utf8(ckpt, tmp_path):
    """5GiB was read as 5e9 and 0.5 as 0 bytes (a file per tensor); under LC_ALL=C the HF export died on
    tokenizer.json's byte-level characters with an error that named no file."""
    assert export.parse_size("5GB") == 5 * 10 ** 9 and export.parse_size("5GiB") == 5 << 30
    assert export.parse_size("2.5KiB") == 2560 and export.parse_size("123B") == 123
    assert export.parse_size("2000000") == 2000000
    for bad in ("0.5", "1iB", "0", "5XB"):
        with pytest.raises(export.ExportError):
            export.parse_size(bad)
    with pytest.raises(export.ExportError, match="a number without a unit is bytes"):  # "2" wrote ~200 shards of ~2 bytes
        export.parse_size("2")
    import subprocess
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
    r = subprocess.run([sys.executable, os.path.join(repo, "export.py"), ckpt["run"], "--format", "hf", "--out",
                        str(tmp_path / "hf"), "--no-progress"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.load(open(tmp_path / "hf" / "tokenizer.json", encoding="utf-8"))["model"]["vocab"]


def test_review_round_export_faults(ckpt, tmp_path, capsys, monkeypatch):
    """Review findings: a weight past float16's range became Inf in an fp16 HF or GGUF export (the source was checked,
    the output not); a library's short write on a full disk printed 'FILE: None'; a Ctrl-C between an HF export's
    two renames left no --out (the earlier export hidden as OUT.old-PID); a killed export's OUT.tmp-PID stayed for
    good (GBs at nano size); an int4 export without a tokenizer was silent, and stream_infer fed a trained model
    the prompt's bytes as token ids; --out x.pcf4/ failed on a temp file inside a folder that does not exist."""
    torch.manual_seed(0)
    m = M.Picaflor(M.ModelConfig(**CFG))
    with torch.no_grad():
        m.moe_layers()[0].shared_experts.down_proj.weight[1, 2] = 1e5
    run = M.save_checkpoint(m, str(tmp_path / "big"), 1, tokenizer_file=str(ckpt["dir"] / "tok.json"))
    for args, want in ((["--format", "hf", "--dtype", "float16", "--out", str(tmp_path / "f16")], "--dtype bfloat16"),
                       (["--format", "gguf", "--out", str(tmp_path / "f16.gguf")], "--gguf-type bf16")):
        with pytest.raises(SystemExit) as e:
            run_export([run] + args)
        msg = str(e.value.code)
        assert "down_proj" in msg and "float16's range" in msg and want in msg, msg
        assert not os.path.exists(args[-1]) and not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    # an --out on a read-only mount (or another user's folder): the line names the fix (it said none)
    def read_only(src, out, *a):
        raise OSError(30, "Read-only file system", out + ".tmp-1")
    real_int4 = export.export_int4
    monkeypatch.setattr(export, "export_int4", read_only)
    with pytest.raises(SystemExit) as e:
        run_export([ckpt["path"], "--format", "int4", "--out", str(tmp_path / "ro.pcf4")])
    assert e.value.code == f"error: {tmp_path}/ro.pcf4.tmp-1: Read-only file system; pass an --out you can write"
    def denied_input(src, out, *a):  # a checkpoint this user cannot read: another --out is no fix
        raise OSError(13, "Permission denied", "/ckpt/model.safetensors")
    monkeypatch.setattr(export, "export_int4", denied_input)
    with pytest.raises(SystemExit) as e:
        run_export([ckpt["path"], "--format", "int4", "--out", str(tmp_path / "ro.pcf4")])
    assert e.value.code == "error: /ckpt/model.safetensors: Permission denied"
    monkeypatch.setattr(export, "export_int4", real_int4)
    # a short write (no strerror), as gguf's writer raises it on a full disk
    line = checkpoint.os_error_line(OSError("139264 requested and 46880 written"), str(tmp_path / "g.gguf"))
    assert line.startswith(str(tmp_path / "g.gguf") + ": 139264 requested") and "None" not in line
    full = OSError(28, "No space left on device")
    assert "MB free on its disk" in checkpoint.os_error_line(full, str(tmp_path / "g.gguf"))
    # an HF export interrupted between its renames: the earlier export is put back
    out = str(tmp_path / "hf")
    run_export([ckpt["path"], "--format", "hf", "--out", out])
    first = sorted(os.listdir(out))
    real_replace, calls = os.replace, []

    def ctrl_c_on_second(a, b):
        calls.append((a, b))
        if len(calls) == 2 and b == out:
            raise KeyboardInterrupt
        return real_replace(a, b)
    monkeypatch.setattr(export.os, "replace", ctrl_c_on_second)
    with pytest.raises(SystemExit) as e:
        run_export([ckpt["path"], "--format", "hf", "--out", out])
    monkeypatch.setattr(export.os, "replace", real_replace)
    # exit 130 as every other script's Ctrl-C (it exited 1, an error's code), the one line on stderr
    assert e.value.code == 130 and "interrupted; " in capsys.readouterr().err and sorted(os.listdir(out)) == first
    assert not [n for n in os.listdir(tmp_path) if n.startswith("hf.")]
    # what a killed export left: temp output removed, a set-aside earlier export put back
    import container
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = container.writer_tag().rsplit("-", 1)[0]
    os.makedirs(tmp_path / f"hf.tmp-{host}-{dead.pid}")
    (tmp_path / f"x.pcf4.tmp-{host}-{dead.pid}").write_bytes(b"half")
    os.replace(out, tmp_path / f"hf.old-{host}-{dead.pid}")
    capsys.readouterr()
    export.clean_stale_outputs(out)
    export.clean_stale_outputs(str(tmp_path / "x.pcf4"))
    err = capsys.readouterr().err
    assert sorted(os.listdir(out)) == first and "put back" in err and err.count("left by a killed export") == 2
    assert sorted(os.listdir(tmp_path)) == sorted(n for n in os.listdir(tmp_path) if ".tmp" not in n and ".old-" not in n)
    os.makedirs(tmp_path / f"hf.tmp-{container.writer_tag()}")  # a live export's temp dir is left alone
    export.clean_stale_outputs(out)
    assert os.path.isdir(tmp_path / f"hf.tmp-{container.writer_tag()}")
    # no tokenizer: the int4 export says so, stream_infer refuses a text prompt for trained weights; --out x/ works
    notok = M.save_checkpoint(M.Picaflor(M.ModelConfig(**CFG)), str(tmp_path / "notok"), 1)
    rep = run_export([notok, "--format", "int4", "--out", str(tmp_path / "notok.pcf4") + "/"])
    assert rep["out"] == str(tmp_path / "notok.pcf4") and "has no tokenizer.json" in capsys.readouterr().err
    import stream_infer
    assert stream_infer.main([str(tmp_path / "notok.pcf4"), "--prompt", "hello", "--max-new-tokens", "2"]) == 1
    assert "has no tokenizer" in capsys.readouterr().err
    assert stream_infer.main([str(tmp_path / "notok.pcf4"), "--prompt", "5,6,7", "--max-new-tokens", "2"]) == 0
    # a request the engine refuses is refused before the prompt is echoed (it printed "hello" then the error)
    run_export([ckpt["path"], "--format", "int4", "--out", str(tmp_path / "tok.pcf4")])
    capsys.readouterr()
    assert stream_infer.main([str(tmp_path / "tok.pcf4"), "--prompt", "hello", "--experts-per-token", "99"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "99" in err, (out, err)


def test_a_container_without_a_tokenizer_exports_with_the_one_given(ckpt, tmp_path):
    """bench/vs_llamacpp.py writes its Q4_0 GGUF of a random container (which carries no tokenizer) with --tokenizer:
    export.py read the container's missing tokenizer first and died (AttributeError: 'NoneType' ... 'encode')."""
    notok = M.save_checkpoint(M.Picaflor(M.ModelConfig(**CFG)), str(tmp_path / "notok"), 1)
    pcf = str(tmp_path / "notok.pcf4")
    run_export([notok, "--format", "int4", "--out", pcf])
    rep = run_export([pcf, "--format", "gguf", "--gguf-type", "q4_0", "--tokenizer", str(ckpt["dir"] / "tok.json"),
                      "--out", str(tmp_path / "x.gguf")])
    assert rep["type"] == "q4_0" and os.path.getsize(tmp_path / "x.gguf") == rep["bytes"], rep


def test_an_option_for_another_format_is_refused(ckpt, tmp_path, capsys):
    """--format hf --gguf-type q4_0 wrote bf16 safetensors, --format int4 --dtype float32 an int4 container, silently."""
    for args in (["--format", "hf", "--gguf-type", "q4_0"], ["--format", "int4", "--dtype", "float32"],
                 ["--format", "gguf", "--group-size", "32"], ["--format", "hf", "--embed-bits", "4"],
                 ["--format", "int4", "--max-shard-size", "1GB"]):
        with pytest.raises(SystemExit) as e:
            run_export([ckpt["path"], *args, "--out", str(tmp_path / "x")])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and f"not {args[1]}" in err[-1] and args[2] in err[-1], err
        assert not os.listdir(tmp_path)
    with pytest.raises(SystemExit) as e:  # (its error named the output file, not the flag)
        run_export([ckpt["path"], "--format", "int4", "--group-size", "7", "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "--group-size 7: an even count" in capsys.readouterr().err and not os.listdir(tmp_path)


def test_hf_export_of_widths_grouped_mm_refuses_runs_in_transformers(ckpt, tmp_path):
    """expert_ffn 10 (no multiple of 8): the export loaded, and its first forward raised "strides should be multiple
    of 16 bytes" in transformers' default experts; it names the eager experts, and gives picaflor's logits."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    m = M.Picaflor(M.ModelConfig(**{**CFG, "expert_ffn": 10})).eval()
    path = M.save_checkpoint(m, str(tmp_path / "run"), 1, tokenizer_file=str(ckpt["dir"] / "tok.json"))
    run_export([path, "--format", "hf", "--dtype", "float32", "--out", str(tmp_path / "hf")])
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    idx = torch.randint(1, 400, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf(idx).logits - m(idx)).abs().max().item() <= 1e-4


def test_gguf_quant_type_says_which_rows_stay_f16(ckpt, tmp_path, capsys):
    """d_model 48 at q8_0: every matrix reading the residual stayed f16 (rows not a multiple of 32), without a word,
    and the report said q8_0; a model whose widths are multiples of 32 is quantized whole, and says nothing."""
    torch.manual_seed(0)
    m = M.Picaflor(M.ModelConfig(**{**CFG, "d_model": 48})).eval()
    path = M.save_checkpoint(m, str(tmp_path / "run"), 1, tokenizer_file=str(ckpt["dir"] / "tok.json"))
    rep = run_export([path, "--format", "gguf", "--gguf-type", "q8_0", "--out", str(tmp_path / "m.gguf")])
    err = capsys.readouterr().err
    assert rep["f16_fallback"] > 0 and "WARNING: --gguf-type q8_0:" in err and "(48 wide)" in err, err
    rep = run_export([ckpt["path"], "--format", "gguf", "--gguf-type", "q8_0", "--out", str(tmp_path / "ok.gguf")])
    assert rep["f16_fallback"] == 0 and "WARNING" not in capsys.readouterr().err


def test_gguf_refuses_what_llama_cpp_aborts_on_and_a_huge_stale_number_is_not_a_pid(ckpt, tmp_path):
    """An all-dense model with n_experts=0 wrote a GGUF (expert_count 0, expert_used_count 2) that llama.cpp's loader
    asserts on; OUT.tmp-<20 digits> beside --out crashed the stale-output cleanup with an OverflowError traceback."""
    dense = M.save_checkpoint(M.Picaflor(M.ModelConfig(**dict(CFG, n_dense_layers=3, n_experts=0))),
                              str(tmp_path / "dense"), 1, tokenizer_file=str(ckpt["dir"] / "tok.json"))
    with pytest.raises(SystemExit) as e:
        run_export([dense, "--format", "gguf", "--out", str(tmp_path / "d.gguf")])
    assert "n_experts=0" in str(e.value.code) and "--format hf" in str(e.value.code)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("d.gguf")]
    import container
    stray = tmp_path / (f"g.gguf.tmp-{container.writer_tag().rsplit('-', 1)[0]}-" + "9" * 20)
    stray.write_bytes(b"half")
    export.clean_stale_outputs(str(tmp_path / "g.gguf"))
    assert not stray.exists()


def test_a_weight_past_a_quantized_types_f16_scale_and_unreadable_weights(ckpt, tmp_path):
    """q8_0 and q4_0 keep one float16 scale per block of 32 (absmax / 127, absmax / 8): a weight of 1e7 gave an Inf
    scale, and the GGUF held Inf and NaN weights without a word (only f16 was checked). A model.safetensors that is
    no safetensors file (its manifest intact) raised a SafetensorError traceback in every format."""
    torch.manual_seed(0)
    m = M.Picaflor(M.ModelConfig(**CFG))
    with torch.no_grad():
        m.moe_layers()[0].shared_experts.down_proj.weight[1, 2] = 1e7
    run = M.save_checkpoint(m, str(tmp_path / "big"), 1, tokenizer_file=str(ckpt["dir"] / "tok.json"))
    for gtype in ("q8_0", "q4_0"):
        out = str(tmp_path / f"{gtype}.gguf")
        with pytest.raises(SystemExit) as e:
            run_export([run, "--format", "gguf", "--gguf-type", gtype, "--out", out])
        msg = str(e.value.code)
        assert "down_proj" in msg and "would be Inf" in msg and "--gguf-type bf16" in msg and "\n" not in msg, msg
        assert not [n for n in os.listdir(tmp_path) if n.startswith(f"{gtype}.gguf")]
    bad = checkpoint.save(str(tmp_path / "garbage"), 1, {  # its manifest is computed over these bytes: it verifies
        "model.safetensors": lambda p: open(p, "wb").write(b"\x10" * 100),
        "state.json": lambda p: open(p, "w").write(json.dumps({"step": 1, "model_config": FULL_CFG}))})
    for fmt, out in (("int4", "g.pcf4"), ("hf", "ghf"), ("gguf", "g.gguf")):
        with pytest.raises(SystemExit) as e:
            run_export([bad, "--format", fmt, "--out", str(tmp_path / out)])
        msg = str(e.value.code)
        assert msg.startswith("error: ") and "model.safetensors: not a readable safetensors" in msg, msg
        assert "\n" not in msg and not os.path.exists(tmp_path / out)


def test_stale_output_cleanup_judges_only_this_hosts_pids(tmp_path, capsys, monkeypatch):
    """clean_stale_outputs took OUT.tmp-PID for a killed export when PID was not alive here: on a shared filesystem
    another machine's running export was deleted under it (or its set-aside OUT.old-PID renamed back to --out). A temp
    name now holds the writer's host; another host's is left with a note, this host's is judged by its pid."""
    import socket
    import container
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node-7")
    assert container.writer_tag() == f"gpu-node-7-{os.getpid()}"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = str(tmp_path / "hf")
    for name in (f"hf.tmp-gpu-node-8-{dead.pid}", f"hf.old-gpu-node-8-{dead.pid}", f"hf.tmp-gpu-node-7-{dead.pid}",
                 f"hf.tmp-{container.writer_tag()}"):
        os.makedirs(tmp_path / name)
    export.clean_stale_outputs(out)
    err = capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == sorted([f"hf.tmp-gpu-node-8-{dead.pid}", f"hf.old-gpu-node-8-{dead.pid}",
                                                   f"hf.tmp-gpu-node-7-{os.getpid()}"]), os.listdir(tmp_path)
    assert err.count("on host gpu-node-8") == 2 and err.count("left by a killed export; removed") == 1, err


def test_stale_output_cleanup_leaves_a_users_own_look_alikes(tmp_path, capsys):
    """clean_stale_outputs also took OUT.tmpNNN, OUT.tmp-NNN and OUT.old-NNN (names of no writer of ours since they
    hold its host) for a killed export's whenever NNN was no live pid: a user's own hf.tmp2 was deleted, and their
    hf.old-7 renamed to --out. Only container.writer_tag's names (this host, a dead pid) are judged now."""
    import container
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = str(tmp_path / "hf")
    mine = [f"hf.tmp{dead.pid}", "hf.tmp2", f"hf.tmp-{dead.pid}", f"hf.old-{dead.pid}", "hf.tmp-", "hf.tmpdir"]
    for name in mine:
        os.makedirs(tmp_path / name)
        (tmp_path / name / "notes.txt").write_text("the user's")
    ours = f"hf.tmp-{container.writer_tag().rsplit('-', 1)[0]}-{dead.pid}"
    os.makedirs(tmp_path / ours)
    export.clean_stale_outputs(out)
    assert sorted(os.listdir(tmp_path)) == sorted(mine), os.listdir(tmp_path)
    assert "left by a killed export; removed" in capsys.readouterr().err


def test_two_hf_exports_to_one_out_at_once_both_finish(ckpt, tmp_path, monkeypatch):
    """Two exports to one --out at once (two terminals): both found no out, then the second rename of a folder onto
    the first's failed (ENOTEMPTY) after all its work. The swap is one export at a time: both finish, out whole."""
    import threading
    out = str(tmp_path / "hf")
    both_renaming = threading.Barrier(2, timeout=1)  # each waits here between its look at out and its rename
    real_replace, real_tag = os.replace, export.container.writer_tag

    def replace(a, b):
        if b == out and ".tmp-" in str(a):
            with contextlib.suppress(threading.BrokenBarrierError):  # (the swap held by the other: it times out)
                both_renaming.wait()
        return real_replace(a, b)
    monkeypatch.setattr(os, "replace", replace)
    # the second export's temp names those of another live process (its own pid's: the first one's)
    monkeypatch.setattr(export.container, "writer_tag", lambda: real_tag() if threading.current_thread().name
                        != "second" else real_tag().rsplit("-", 1)[0] + f"-{os.getppid()}")
    errors = []

    def one_export():
        try:
            export.export_hf(export.Source(ckpt["run"]), out, "float32", progress=False)
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=one_export, name=n) for n in ("first", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(os.listdir(tmp_path)) == ["hf"] and os.path.exists(os.path.join(out, "model.safetensors"))
