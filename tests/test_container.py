"""int4 container: round trip, expert blobs, corrupt files (tiny random models, CPU, a few seconds)."""
import json
import os
import sys
from dataclasses import asdict

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import container as C  # noqa: E402
from model import ModelConfig, Picaflor, save_checkpoint  # noqa: E402

TINY = dict(vocab_size=300, n_layer=3, n_dense_layers=1, d_model=64, n_head=4, n_kv_head=2, dense_ffn=96,
            n_experts=8, expert_ffn=48, n_shared=1, top_k=2, max_seq_len=64, tie_embeddings=False)


def make_ckpt(tmp_path, seed=0, **over):
    torch.manual_seed(seed)
    m = Picaflor(ModelConfig(**{**TINY, **over}))
    with torch.no_grad():  # a non-zero selection bias, so a lost or reordered bias would show
        for moe in m.moe_layers():
            moe.e_score_correction_bias.normal_(0, 0.01)
    tok = tmp_path / "tok.json"
    tok.write_text('{"format": "not-really-a-tokenizer"}')
    return m, save_checkpoint(m, str(tmp_path / "run"), 1, tokenizer_file=str(tok))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ct")
    m, ck = make_ckpt(tmp)
    out = str(tmp / "m.pcf4")
    rep = C.write_container(ck, out, group_size=32, progress=False)
    return m, ck, out, rep


@pytest.mark.parametrize("shape,g", [((64, 128), 32), ((40, 100), 32), ((33, 7), 16), ((96, 256), 128)])
@pytest.mark.parametrize("sym", [False, True])
def test_int4_round_trip_error_bound(shape, g, sym):
    torch.manual_seed(1)
    w = torch.randn(shape)
    p, sz = C.quantize_int4(w, g, sym)
    d = C.dequantize_int4(p, sz, shape, g)
    assert d.shape == w.shape
    # uniform quantizer: |error| <= scale / 2 per weight (plus bf16 rounding of scale/zero); relative RMS ~ 8-11%
    rel = ((d - w).pow(2).mean() / w.pow(2).mean()).sqrt().item()
    assert rel < 0.13, rel
    gw = torch.nn.functional.pad(w, (0, (-shape[1]) % g)).view(shape[0], -1, g)
    # asym: step = range / 15, error <= step / 2; sym (Q4_0): step = absmax / 8 and the extreme opposite to the
    # absmax may clip from +8 to +7 steps, so error <= one step
    step = (gw.amax(-1) - gw.amin(-1)) / 15 if not sym else gw.abs().amax(-1) / 8
    step = step.repeat_interleave(g, dim=1)[:, :shape[1]]
    assert ((d - w).abs() <= (1.0 if sym else 0.5) * step * 1.02 + 1e-6).all()


def test_packed_layout_is_torch_cpu_kernel_layout():
    q = torch.randint(0, 16, (64, 96), dtype=torch.int32)
    q[:, ::32], q[:, 1::32] = 0, 15  # every group spans 0..15: scale 1, zero 0
    w = q.float() - 8.0  # weights that quantize exactly to q
    p, sz = C.quantize_int4(w, 32)
    assert torch.equal(C.unpack_int4(p, 64, 96).int(), q)
    ref = torch._convert_weight_to_int4pack_for_cpu(q, 1).flatten()
    # torch's AVX2 build packs as we store (the bytes are used as read); its AVX-512 build packs 64-row blocks, and
    # stream_infer repacks for it: on any CPU the kernel gets exactly the bytes torch itself would have packed
    import kernels
    assert kernels.int4pack_same_layout() == torch.equal(ref, p)
    assert torch.equal(kernels.to_int4pack_layout(p.clone(), (64, 96), 32), ref)
    # the repack goes a run of rows at a time (bounded scratch memory), tails included: the same bytes
    q = torch.randint(0, 16, (352, 64), dtype=torch.int32)
    q[:, ::32], q[:, 1::32] = 0, 15
    p, _ = C.quantize_int4(q.float() - 8.0, 32)
    ref = torch._convert_weight_to_int4pack_for_cpu(q, 1).flatten()
    for rows in (64, 128, 4096):
        assert torch.equal(kernels.to_int4pack_layout(p.clone(), (352, 64), 32, rows_at_a_time=rows), ref), rows


def test_container_round_trip_and_report(built):
    m, ck, out, rep = built
    c = C.load_container(out)
    assert c.config == m.cfg
    assert c.tokenizer_json == '{"format": "not-really-a-tokenizer"}'
    assert c.header["random_weights"] is False
    sd = c.dequantized_state_dict()
    ref = {k: v for k, v in m.state_dict().items() if not k.endswith("load_accum")}
    assert set(sd) == set(ref)
    for k, v in ref.items():
        rel = ((sd[k] - v.float()).pow(2).sum() / v.float().pow(2).sum().clamp_min(1e-30)).sqrt().item()
        if k.endswith(("norm.weight", "layernorm.weight", "mlp.gate.weight", "e_score_correction_bias")):
            assert torch.equal(sd[k], v.float()), k  # router, bias and norms kept exact (fp32)
        elif k.startswith(("embed_tokens", "lm_head")):
            assert rel < 0.01, (k, rel)  # int8 per row
        else:
            assert rel < 0.12, (k, rel)
    assert sd["layers.1.mlp.e_score_correction_bias"].abs().sum() > 0
    r = json.load(open(out + ".report.json"))
    assert set(r["relative_rms_error"]) == {"experts", "attention", "shared", "dense", "embeddings"}
    assert 0.03 < r["relative_rms_error"]["experts"] < 0.12
    assert r["relative_rms_error"]["embeddings"] < 0.01
    # every blob aligned
    for t in c.header["tensors"].values():
        assert t["offset"] % 4096 == 0
    for ents in c.header["experts"].values():
        assert all(e["offset"] % 4096 == 0 for e in ents)


def test_dequantized_model_runs_close_to_original(built):
    m, ck, out, rep = built
    c = C.load_container(out)
    q = Picaflor(c.config)
    q.load_state_dict(c.dequantized_state_dict(), strict=False)
    q.eval()
    idx = torch.randint(1, 300, (1, 16))
    with torch.no_grad():
        a, b = m.eval()(idx), q(idx)
    assert (a - b).abs().max() < 0.15 * a.abs().max()


def test_expert_blob_alone_equals_whole_file_view(built):
    m, ck, out, rep = built
    c = C.load_container(out)
    whole = open(out, "rb").read()
    for layer, e in [(1, 0), (2, 7), (1, 5)]:
        blob = c.read_expert_blob(layer, e)
        ent = c.header["experts"][str(layer)][e]
        assert bytes(blob) == whole[ent["offset"]:ent["offset"] + c.expert_nbytes]
        w = c.expert_weights(layer, e)
        from_whole = c.decode_expert(bytearray(whole[ent["offset"]:ent["offset"] + c.expert_nbytes]))
        for k, v in from_whole.items():
            assert torch.equal(w[k], C.dequantize_int4(v["packed"], v["sz"], v["shape"], v["group_size"]))
        orig = getattr(m.layers[layer].mlp.experts, "gate_up_proj")[e].detach()
        assert ((w["gate_up_proj"] - orig).pow(2).mean() / orig.pow(2).mean()).sqrt() < 0.12


def test_streaming_writer_matches_random_source_and_tied(tmp_path):
    cfg = ModelConfig(**{**TINY, "tie_embeddings": True})
    src = C.RandomSource(cfg, seed=3)
    out = str(tmp_path / "r.pcf4")
    C.write_container(None, out, group_size=32, progress=False, source=src, embed_bits=4, dense_bits=8)
    c = C.load_container(out)
    assert c.header["random_weights"] is True
    assert "lm_head.weight" not in c.header["tensors"]
    assert c.header["tensors"]["embed_tokens.weight"]["kind"] == "int4"
    assert c.header["tensors"]["layers.0.self_attn.q_proj.weight"]["kind"] == "int8"
    w = c.expert_weights(2, 3)["down_proj"]
    ref = src.get_expert("layers.2.mlp.experts.down_proj", 3)
    assert ((w - ref).pow(2).mean() / ref.pow(2).mean()).sqrt() < 0.12
    sd = c.dequantized_state_dict()
    assert sd["lm_head.weight"] is sd["embed_tokens.weight"]


def _one_line_error(fn):
    with pytest.raises(C.ContainerError) as ei:
        fn()
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_corrupt_containers_give_one_line_errors(built, tmp_path):
    m, ck, out, rep = built
    data = open(out, "rb").read()
    # wrong magic
    bad = tmp_path / "bad_magic.pcf4"
    bad.write_bytes(b"GGUF" + data[4:])
    msg = _one_line_error(lambda: C.load_container(str(bad)))
    assert "not a picaflor int4 container" in msg and str(bad) in msg
    # truncated (cut the last expert blob in half)
    tr = tmp_path / "trunc.pcf4"
    tr.write_bytes(data[:len(data) - 6000])
    msg = _one_line_error(lambda: C.load_container(str(tr)))
    assert "truncated" in msg and str(tr) in msg
    # truncated inside the header
    tr2 = tmp_path / "trunc2.pcf4"
    tr2.write_bytes(data[:100])
    assert "truncated" in _one_line_error(lambda: C.load_container(str(tr2)))
    # the fix is said whatever the cut: inside the header, inside its fixed prefix (a 12-byte copy was "wrong
    # magic"), or an empty file
    for n in (100, 12, 3, 0):
        tr2.write_bytes(data[:n])
        msg = _one_line_error(lambda: C.load_container(str(tr2)))
        assert "truncated" in msg and msg.endswith("re-export or re-copy it"), (n, msg)
    # one flipped byte inside layer 2 expert 5
    c = C.load_container(out)
    off = c.header["experts"]["2"][5]["offset"] + 123
    fl = tmp_path / "flip.pcf4"
    fl.write_bytes(data[:off] + bytes([data[off] ^ 0x10]) + data[off + 1:])
    cf = C.load_container(str(fl))
    cf.read_expert_blob(2, 4)  # neighbours are fine
    msg = _one_line_error(lambda: cf.read_expert_blob(2, 5))
    assert "checksum mismatch" in msg and "layer 2 expert 5" in msg and str(fl) in msg
    # corrupt header JSON
    hj = tmp_path / "hdr.pcf4"
    hj.write_bytes(data[:30] + b"\x00\x01" + data[32:])
    assert "corrupt container header" in _one_line_error(lambda: C.load_container(str(hj)))
    # missing file
    assert "no such file" in _one_line_error(lambda: C.load_container(str(tmp_path / "nope.pcf4")))


def test_header_edits_are_caught(built, tmp_path, monkeypatch):
    """The header's crc32 (in the prefix's once-reserved field) catches an edit that still parses: rope_theta
    changed in place loaded and decoded differently, and `--check` said ok. Without the crc (a container written
    before it: the field is 0) a header that lost a field, has a non-hex crc32 or a wrong shape is still a one-line
    error, not a KeyError / ValueError / RuntimeError later."""
    m, ck, out, rep = built
    data = bytearray(open(out, "rb").read())
    _, _, crc, hlen = C.PREFIX.unpack(bytes(data[:C.PREFIX.size]))
    raw = bytes(data[C.PREFIX.size:C.PREFIX.size + hlen])
    assert crc == C.zlib.crc32(raw) != 0

    def edited(name, old, new, crc_field="old"):  # the header edited; its crc field as it was, 0, or made to fit
        h = raw.replace(old, new, 1)
        assert h != raw and len(h) == len(raw)
        f = tmp_path / name
        field = {"old": crc, "zero": 0, "fit": C.zlib.crc32(h)}[crc_field]
        f.write_bytes(C.PREFIX.pack(C.MAGIC, C.VERSION, field, hlen) + h + bytes(data[C.PREFIX.size + hlen:]))
        return str(f)
    theta = str(m.cfg.rope_theta).encode()
    rope = edited("rope.pcf4", b'"rope_theta":' + theta, b'"rope_theta":' + theta.replace(b"1", b"9", 1))
    assert "corrupt container header" in _one_line_error(lambda: C.load_container(rope))
    # the same edit with the crc field zeroed: it loaded (0 meant unchecked), --check said ok
    msg = _one_line_error(lambda: C.load_container(edited("rope0.pcf4", b'"rope_theta":' + theta,
                                                          b'"rope_theta":' + theta.replace(b"1", b"9", 1), "zero")))
    assert "has no crc32" in msg and "re-export" in msg
    # a header whose crc fits and that lost a field, has a non-hex crc32 or a group size of 0 is one line, not a
    # KeyError / ValueError / ZeroDivisionError later
    ent = C.load_container(out).header["experts"]["1"][0]
    group = b'"group_size":%d' % m_group(raw)
    for name, old, new in [("key.pcf4", b'"offset":%d' % ent["offset"], b'"offsex":%d' % ent["offset"]),
                           ("crc.pcf4", ent["crc32"].encode(), b"zz" + ent["crc32"].encode()[2:]),
                           ("group.pcf4", group, b'"group_size":' + b" " * (len(group) - len(b'"group_size":') - 1) + b"0")]:
        msg = _one_line_error(lambda: C.load_container(edited(name, old, new, "fit")))
        assert "corrupt container header" in msg and ("group_size 0" in msg or name != "group.pcf4"), (name, msg)
    # fields the reader trusted, edited with the crc made to fit: --check said ok, then stream_infer decoded an
    # "int3" tensor as int4, or raised a ValueError / ZeroDivisionError / RuntimeError traceback
    first = next(n for n, t in C.json.loads(raw)["tensors"].items() if t["kind"] == "int8")

    def rewritten(name, edit):
        h = C.json.loads(raw)
        edit(h)
        new = C.json.dumps(h, separators=(",", ":")).encode()
        assert len(new) <= hlen
        new += b" " * (hlen - len(new))
        f = tmp_path / name
        f.write_bytes(C.PREFIX.pack(C.MAGIC, C.VERSION, C.zlib.crc32(new), hlen) + new + bytes(data[C.PREFIX.size + hlen:]))
        return str(f)
    edits = {"kind": lambda h: h["tensors"][first].update(kind="int3"),
             "kind_f32": lambda h: h["tensors"][first].update(kind="f32"),
             "part_size": lambda h: h["expert_layout"]["parts"][0]["packed"].__setitem__(1, 10 ** 8),
             "part_group": lambda h: h["expert_layout"]["parts"][0].update(group_size=0),
             "part_shape": lambda h: h["expert_layout"]["parts"][0].update(shape=[64, 64]),
             "tensor_part": lambda h: h["tensors"][first]["parts"]["q"].__setitem__(1, 10 ** 7),
             "file_bytes": lambda h: h.update(file_bytes=-1),
             # an exporter's header without a model field: the field's default decoded the model, silently
             "no_rope_theta": lambda h: h["model_config"].pop("rope_theta"),
             # values of the wrong type (found by fuzzing): TypeError / IndexError / OverflowError / KeyError
             # tracebacks at load or at the tensor's first read, or a NaN max_seq_len that loaded
             "n_dense_float": lambda h: h["model_config"].update(n_dense_layers=0.5),
             "seq_len_nan": lambda h: h["model_config"].update(max_seq_len=float("nan")),
             "shape_empty": lambda h: h["tensors"][first].update(shape=[]),
             "offset_inf": lambda h: h["tensors"][first].update(offset=float("inf")),
             "nbytes_str": lambda h: h["tensors"][first].update(nbytes=str(h["tensors"][first]["nbytes"])),
             "no_tensor_crc": lambda h: h["tensors"][first].pop("crc32"),
             # a header's n_layer of 10^12 built a meta model that large (minutes, then out of memory)
             "n_layer_huge": lambda h: h["model_config"].update(n_layer=10 ** 12)}
    shapes = C.expected_shapes
    monkeypatch.setattr(C, "expected_shapes", lambda cfg: shapes(cfg) if cfg.n_layer < 100 else pytest.fail("built"))
    for name, edit in edits.items():
        path = rewritten(name + ".pcf4", edit)
        msg = _one_line_error(lambda: C.load_container(path))
        assert "corrupt container header" in msg and path in msg, (name, msg)
    assert C.load_container(rewritten("same.pcf4", lambda h: None)).header["tensors"][first]["kind"] == "int8"
    # an index that lost a tensor or an expert, or an offset off the 4096-byte grid: the error said no fix
    for name, edit in [("unaligned", lambda h: h["tensors"][first].update(offset=h["tensors"][first]["offset"] + 1)),
                       ("lost_tensor", lambda h: h["tensors"].pop(first)),
                       ("lost_expert", lambda h: h["experts"]["1"].pop())]:
        path = rewritten(name + ".pcf4", edit)
        msg = _one_line_error(lambda: C.load_container(path))
        assert "corrupt header: re-export it" in msg and path in msg, (name, msg)
    # write_container's own checks of its arguments named the output but no fix
    for kw, want in [({"group_size": 7}, "pass an even --group-size"), ({"embed_bits": 5}, "--embed-bits 5")]:
        with pytest.raises(C.ContainerError, match=want):
            C.write_container(ck, str(tmp_path / "never.pcf4"), **kw)


def test_weights_near_fp32s_limit_quantize_or_are_refused():
    """mx - mn overflowed fp32 above 1.7e38: an inf scale, a NaN zero, and a container --check passed."""
    w = torch.randn(64, 64)
    w[0, 0], w[0, 1] = 3e38, -3e38
    _, wq = C.encode_blob("int4", w, 32)
    assert torch.isfinite(wq).all() and abs(float(wq[0, 0]) / 3e38 - 1) < 0.01
    w[0, 0] = 3.4e38  # past bf16's largest scale: refused, naming the tensor
    with pytest.raises(C.ContainerError, match="layers.1.x.*beyond what int4"):
        C.encode_blob("int4", w, 32, what="ckpt: layers.1.x")


def test_int8_rows_of_tiny_values_keep_their_relative_error():
    """quantize_int8 floored every row's scale at 1e-12: a row of values under ~1e-12 (a nearly dead lm_head row)
    came back all zeros, one around 1e-11 with 3% error instead of <0.4%. Ordinary rows quantize as before."""
    torch.manual_seed(3)
    w = torch.randn(6, 64)
    w[1] *= 1e-11
    w[2] *= 1e-13
    w[3] *= 1e-30
    w[4] = 0.0
    q, scale = C.quantize_int8(w)
    d = C.dequantize_int8(q, scale, w.shape)
    amax = w.abs().amax(dim=1)
    # round to nearest of a step amax / 127: |error| <= half a step, in every row (all zeros: exactly zeros)
    assert ((d - w).abs().amax(dim=1) <= amax / 254 * 1.001).all(), ((d - w).abs().amax(dim=1) / amax).tolist()
    assert torch.equal(d[4], w[4]) and torch.isfinite(scale).all() and (scale > 0).all()
    # the bf16 copy of the scales (the int8pack path) keeps them non-zero too
    assert (scale.to(torch.bfloat16) > 0).all()
    big = [0, 5]  # ordinary rows: the scale amax / 127, as before
    assert torch.equal(scale[big], amax[big] / 127.0)
    assert torch.equal(q.view(w.shape)[big], torch.round(w[big] / scale[big, None]).to(torch.int8))


def m_group(raw):
    return C.json.loads(raw)["quant"]["group_size"]


def test_expert_blob_checked_once_unless_the_file_changes(built, tmp_path, monkeypatch):
    """A blob's crc32 is computed on its first read only; a re-read is trusted while the open file is unchanged,
    and a file rewritten in place since is a one-line error, not a silently different expert."""
    m, ck, out, rep = built
    copy = tmp_path / "copy.pcf4"
    copy.write_bytes(open(out, "rb").read())
    calls = []
    real = C.crc32
    monkeypatch.setattr(C, "crc32", lambda b, *a: calls.append(len(b)) or real(b, *a))
    c = C.load_container(str(copy))
    first = bytes(c.read_expert_blob(1, 3))
    assert len(calls) == 1
    assert bytes(c.read_expert_blob(1, 3)) == first and len(calls) == 1  # re-read: no second crc
    c.read_expert_blob(1, 4)
    assert len(calls) == 2
    # rewrite one byte of the checked blob in place (mtime moves): the re-read refuses
    with open(copy, "r+b") as f:
        for e in (3, 5):  # and a blob not read yet: its crc fails, but the file is not corrupt (a new one copied in)
            off = c.header["experts"]["1"][e]["offset"] + 7
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 1]))
    st = os.stat(copy)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    for e in (3, 5):
        msg = _one_line_error(lambda: c.read_expert_blob(1, e))
        assert "changed on disk" in msg and "restart" in msg and str(copy) in msg, msg
    # a fresh open checks again and finds the flipped byte; verify_all re-checks blobs already read
    assert "checksum mismatch" in _one_line_error(lambda: C.load_container(str(copy)).read_expert_blob(1, 3))
    c2 = C.load_container(out)
    c2.read_expert_blob(1, 0)
    n = len(calls)
    c2.verify_all()
    assert len(calls) - n == sum(len(v) for v in c2.header["experts"].values()) + len(c2.header["tensors"])


def test_cli_check_and_errors(built, tmp_path, capsys):
    m, ck, out, rep = built
    assert C.main(["--check", out]) == 0  # every checksum verified (in process: a subprocess costs ~9 s here)
    assert "ok" in capsys.readouterr().out
    bad = tmp_path / "x.pcf4"
    bad.write_bytes(b"hello world" * 10)
    assert C.main(["--check", str(bad)]) == 1  # main catches ContainerError: one line on stderr, no traceback
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not a picaflor int4 container" in err
    assert C.main(["--random-config", str(tmp_path / "nope.py"), "--out", str(tmp_path / "o.pcf4")]) == 1
    assert "cannot read config file" in capsys.readouterr().err


def test_a_group_size_that_pads_the_widths_is_said(built, tmp_path, capsys):
    """--group-size 4096 on a 128-wide model made the file 5x larger without a word (widths pad to the group)."""
    m, ck, out, rep = built
    C.write_container(ck, str(tmp_path / "g16.pcf4"), group_size=16, progress=False)
    assert "WARNING" not in capsys.readouterr().err  # 16 divides every width of this model
    C.write_container(ck, str(tmp_path / "g.pcf4"), group_size=96, progress=False)
    err = capsys.readouterr().err
    assert "group size 96 does not divide input widths" in err and "more int4 weights" in err
    assert os.path.getsize(tmp_path / "g.pcf4") > os.path.getsize(out)
    odd = ModelConfig(**{**asdict(m.cfg), "expert_ffn": 33})  # it said "a group size dividing 1 avoids it"
    ck_odd = save_checkpoint(Picaflor(odd), str(tmp_path / "odd"), 1)
    C.write_container(ck_odd, str(tmp_path / "odd.pcf4"), group_size=16, progress=False)
    err = capsys.readouterr().err
    assert "33" in err and "no group size avoids it" in err and "dividing 1 " not in err, err


def test_a_malformed_config_or_checkpoint_is_one_line_error(tmp_path, capsys):
    """A config file with a syntax error, an undefined name or a size given as a string raised a traceback from
    `--random-config`, and so did a checkpoint whose state.json has no model_config or whose model.safetensors (its
    manifest intact) is no safetensors file; nothing was written."""
    from safetensors.torch import save_file
    import checkpoint
    for name, text, want in [("syn.py", "n_layer = 2\nd_model = 64 +\n", "syn.py:2: syntax error"),
                             ("name.py", "d_model = foo\n", "NameError: name 'foo' is not defined; fix the config"),
                             ("str.py", 'n_layer = "2"\n', "n_layer must be an int"),
                             ("typo.py", "n_layers = 3\nbatch_size = 8\n", "'n_layers' is no model field; did you mean "
                                                                           "'n_layer'?")]:
        (tmp_path / name).write_text(text)
        out = tmp_path / (name + ".pcf4")
        assert C.main(["--random-config", str(tmp_path / name), "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert want in err and str(tmp_path / name) in err and len(err.strip().splitlines()) == 1, err
        assert err.count("fix the config") == 1 and not out.exists(), err
    sd = {k: v for k, v in Picaflor(ModelConfig(**TINY)).state_dict().items() if not k.endswith("load_accum")}
    for name, state, weights, want in [
            ("nocfg", {"step": 1}, lambda p: save_file(sd, p), "state.json: no usable model_config"),
            ("garbage", {"step": 1, "model_config": asdict(ModelConfig(**TINY))},
             lambda p: open(p, "wb").write(b"\x10" * 100), "model.safetensors: not a readable safetensors file"),
            # a saved config without a field: the default stood in for the model's value, silently
            ("lacks", {"step": 1, "model_config": {k: v for k, v in asdict(ModelConfig(**TINY)).items() if k != "norm_eps"}},
             lambda p: save_file(sd, p), "state.json: no usable model_config (model config lacks keys ['norm_eps'])")]:
        state_file = lambda p, s=state: open(p, "w").write(json.dumps(s))  # noqa: E731
        ck = checkpoint.save(str(tmp_path / name), 1, {"model.safetensors": weights, "state.json": state_file})
        assert C.main([ck, "--out", str(tmp_path / (name + ".pcf4"))]) == 1
        err = capsys.readouterr().err
        assert want in err and ck in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / (name + ".pcf4")).exists()


def test_int4_asymmetric_never_clips_a_groups_extremes():
    """zero = min + 8 * scale is rounded to bf16 (2^-9 of |zero|): for a group far from 0 relative to its spread that
    shift exceeded a step and its min was clipped by 3.7 steps; a 1e-8 scale floor lost tiny groups whole."""
    ramp = torch.arange(32).float() / 31
    for w in (1.0 + 0.01 * ramp, -3.1 + 0.004 * ramp, 1e-9 * (ramp - 0.3), torch.full((32,), 0.37)):
        w = w.repeat(32, 1)
        p, sz = C.quantize_int4(w, 32)
        err = (C.dequantize_int4(p, sz, w.shape, 32) - w).abs().max().item()
        # half a step, the step widened by the bf16 zero's own rounding (2^-9 of it) to reach both ends
        bound = 0.5 * ((w.max() - w.min()).item() / 15 + w.abs().max().item() * 2 ** -9 / 7) * 1.1
        assert err <= bound, (w[0, 0].item(), err, bound)


def test_checkpoint_tensors_not_matching_its_config_are_one_line_errors(tmp_path, capsys, monkeypatch):
    """container.py CKPT --out on a model.safetensors (its manifest intact) that lost a tensor raised a SafetensorError
    traceback half-way through the write; routed experts two rows short were zero-padded into a container that loaded
    (gate and up split at the wrong row), and a stray tensor was ignored. export.py refused all three in one line."""
    from safetensors.torch import save_file
    import checkpoint
    sd = {k: v for k, v in Picaflor(ModelConfig(**TINY)).state_dict().items() if not k.endswith("load_accum")}
    lost = {k: v for k, v in sd.items() if k != "layers.2.mlp.experts.down_proj"}
    narrow = {**sd, "layers.1.mlp.experts.gate_up_proj": sd["layers.1.mlp.experts.gate_up_proj"][:, :-2].contiguous()}
    extra = {**sd, "layers.9.mlp.gate.weight": torch.zeros(8, 64)}
    state = {"step": 1, "model_config": asdict(ModelConfig(**TINY))}
    for name, weights, want in [("lost", lost, "layers.2.mlp.experts.down_proj"),
                                ("narrow", narrow, "layers.1.mlp.experts.gate_up_proj"),
                                ("extra", extra, "layers.9.mlp.gate.weight")]:
        ck = checkpoint.save(str(tmp_path / name), 1, {"model.safetensors": lambda p, w=weights: save_file(w, p),
                                                       "state.json": lambda p: open(p, "w").write(json.dumps(state))})
        assert C.main([ck, "--out", str(tmp_path / (name + ".pcf4"))]) == 1
        err = capsys.readouterr().err
        assert want in err and "model.safetensors" in err and len(err.strip().splitlines()) == 1, err
        assert not any(n.startswith(name + ".pcf4") for n in os.listdir(tmp_path))
    # a state.json whose n_layer is 10^12 (its manifest made to fit) built a meta model of it until memory ran out
    huge = {**state, "model_config": {**state["model_config"], "n_layer": 10 ** 12}}
    ck = checkpoint.save(str(tmp_path / "huge"), 1, {"model.safetensors": lambda p: save_file(sd, p),
                                                     "state.json": lambda p: open(p, "w").write(json.dumps(huge))})
    import model
    shapes = C.expected_shapes
    for module in (C, model):  # (container's own call, and weights_misfit's)
        monkeypatch.setattr(module, "expected_shapes",
                            lambda cfg: shapes(cfg) if cfg.n_layer < 100 else pytest.fail("built"))
    assert C.main([ck, "--out", str(tmp_path / "huge.pcf4")]) == 1
    err = capsys.readouterr().err
    assert "n_layer 1000000000000" in err and "model.safetensors" in err and len(err.strip().splitlines()) == 1, err


def test_ctrl_c_while_building_is_one_line_and_keeps_the_earlier_container(tmp_path, capsys, monkeypatch):
    """Ctrl-C while `container.py --random-config` (or CKPT --out) built a container was a traceback; now one line
    saying --out is as it was (exit 130): the temp file is removed, an earlier container kept whole."""
    cfg = tmp_path / "tiny.py"
    cfg.write_text("".join(f"{k} = {v!r}\n" for k, v in TINY.items()))
    out = tmp_path / "r.pcf4"
    assert C.main(["--random-config", str(cfg), "--out", str(out), "--group-size", "32"]) == 0
    before = out.read_bytes()
    capsys.readouterr()
    real, calls = C.RandomSource.random_blob, []

    def ctrl_c_midway(self, *a, **k):  # the second layer's blobs: a Ctrl-C in the middle of the file
        calls.append(1)
        if len(calls) == 12:
            raise KeyboardInterrupt
        return real(self, *a, **k)
    monkeypatch.setattr(C.RandomSource, "random_blob", ctrl_c_midway)
    assert C.main(["--random-config", str(cfg), "--out", str(out), "--group-size", "32", "--seed", "1"]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"interrupted; {out} is as it was" and "Traceback" not in err, err
    assert out.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["r.pcf4", "r.pcf4.report.json", "tiny.py"]


def test_two_writers_of_one_out_both_finish(tmp_path, monkeypatch):
    """Two container.py runs to one --out at once: the report both removed before the swap was gone for the one that
    came second, a FileNotFoundError traceback after its whole write. Each writer ends with a whole container."""
    out = str(tmp_path / "r.pcf4")
    src = C.RandomSource(ModelConfig(**TINY), seed=3)
    C.write_container(None, out, group_size=32, progress=False, source=src)
    real = os.remove

    def the_other_writer_first(path):
        if path == out + ".report.json" and os.path.exists(path):
            real(path)  # the other writer's remove, between this one's look and its own remove
        return real(path)
    monkeypatch.setattr(os, "remove", the_other_writer_first)
    C.write_container(None, out, group_size=32, progress=False, source=C.RandomSource(ModelConfig(**TINY), seed=3))
    assert C.load_container(out).header["random_weights"] and os.path.exists(out + ".report.json")
