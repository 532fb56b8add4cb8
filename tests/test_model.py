"""Tests for model.py: HYV3 parity, grouped dispatch vs the reference loop, balancing, KV cache, sizes,
checkpoints. CPU only, tiny configs (d_model 32-64)."""

import os
import subprocess
import sys
from dataclasses import asdict, replace

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpoint  # noqa: E402
import model as M  # noqa: E402



@pytest.fixture(autouse=True)
def one_thread():
    # tiny shapes: one thread is fastest, and on a loaded shared box 2 threads can be 30x slower (spinning)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

PARITY_CFG = M.ModelConfig(vocab_size=211, n_layer=4, n_dense_layers=2, d_model=64, n_head=4, n_kv_head=2,
                           dense_ffn=96, n_experts=8, expert_ffn=32, n_shared=2, top_k=2, route_scale=2.5,
                           rope_theta=500.0, max_seq_len=64, norm_eps=1e-6)


def randomise(model, seed=0):
    """Random weights everywhere, norms and the selection bias included, so that nothing hides behind ones/zeros."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for m in model.moe_layers():
            m.e_score_correction_bias.copy_(0.1 * torch.randn(m.e_score_correction_bias.shape, generator=g))
    return model


def hf_model(cfg, **extra):
    import transformers
    return transformers.HYV3ForCausalLM(transformers.HYV3Config(**M.to_hf_config(cfg, **extra))).eval()


# ----------------------------------------------------------------------------------------------------------
# HYV3 interop

@pytest.mark.parametrize("top_k", [2, 1])
def test_hf_parity_picaflor_to_hf(top_k):
    torch.manual_seed(0)
    pf = randomise(M.Picaflor(PARITY_CFG)).eval()
    # top_k=1 is served: the model is built (trained) at top_k=2 and lowered with set_top_k
    pf.set_top_k(top_k)
    hf = hf_model(replace(PARITY_CFG, top_k=top_k))
    missing, unexpected = hf.load_state_dict(M.to_hf_state_dict(pf.state_dict()), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    bias_pf = pf.layers[3].mlp.e_score_correction_bias
    assert torch.equal(hf.model.layers[3].mlp.e_score_correction_bias, bias_pf) and bias_pf.abs().sum() > 0
    idx = torch.randint(0, PARITY_CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = pf(idx)
        b = hf(input_ids=idx, use_cache=False).logits
    assert a.dtype == b.dtype == torch.float32
    assert (a - b).abs().max().item() <= 1e-4
    assert a.abs().max().item() > 0.1  # not a trivially small output


def test_hf_parity_top1_differs_from_top2():
    # guards the test above against a set_top_k that does nothing
    pf = randomise(M.Picaflor(PARITY_CFG)).eval()
    idx = torch.randint(0, PARITY_CFG.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = pf(idx)
        pf.set_top_k(1)
        b = pf(idx)
    assert (a - b).abs().max().item() > 1e-3
    with pytest.raises(ValueError):
        pf.set_top_k(PARITY_CFG.n_experts + 1)


def test_set_top_k_on_a_model_without_moe_layers():
    """An all-dense model (n_dense_layers == n_layer) routes nothing: n_experts=0 is a legal config, and set_top_k
    (chat.py --experts-per-token) refused every k with "top_k=1 must be in [1, 0]"; any k is the same model there."""
    dense = M.Picaflor(replace(PARITY_CFG, n_dense_layers=PARITY_CFG.n_layer, n_experts=0)).eval()
    idx = torch.randint(0, PARITY_CFG.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = dense(idx)
        dense.set_top_k(1)
        assert torch.equal(dense(idx), a)
    with pytest.raises(ValueError):
        dense.set_top_k(0)


def test_hf_parity_hf_to_picaflor():
    torch.manual_seed(3)
    hf = hf_model(PARITY_CFG)
    with torch.no_grad():  # HF inits the bias to zeros: randomise it and the norms
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        for layer in hf.model.layers[PARITY_CFG.n_dense_layers:]:
            layer.mlp.e_score_correction_bias.copy_(0.1 * torch.randn(PARITY_CFG.n_experts))
    cfg = M.from_hf_config(hf.config)
    expect = asdict(PARITY_CFG)
    got = asdict(cfg)
    expect.pop("bias_update_rate"), got.pop("bias_update_rate")  # a training knob HF does not carry
    assert got == expect
    assert M.from_hf_config(M.to_hf_config(PARITY_CFG)) == cfg  # dict form too
    pf = M.Picaflor(cfg).eval()
    pf.load_state_dict(M.from_hf_state_dict(hf.state_dict()), strict=False)
    sd_pf = pf.state_dict()
    for k, v in M.from_hf_state_dict(hf.state_dict()).items():
        assert torch.equal(sd_pf[k], v), k
    idx = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (pf(idx) - hf(input_ids=idx, use_cache=False).logits).abs().max().item() <= 1e-4


def test_to_hf_config_of_integer_valued_floats_loads_in_transformers():
    """ModelConfig accepts route_scale=2 / norm_eps=1 / rope_theta=10000 as ints (a state.json written by hand, or
    ModelConfig(route_scale=2)); to_hf_config wrote them to config.json as ints and transformers' strict HYV3Config
    refused the whole export ("router_scaling_factor expected float, got int"), where GGUF took them."""
    import json
    import transformers
    cfg = replace(PARITY_CFG, route_scale=2, norm_eps=1, rope_theta=500)
    d = json.loads(json.dumps(M.to_hf_config(cfg)))  # as config.json holds it
    hf = transformers.HYV3Config(**d)
    assert hf.router_scaling_factor == 2.0 and hf.rms_norm_eps == 1.0 and hf.rope_parameters["rope_theta"] == 500.0
    assert M.from_hf_config(hf) == cfg


def test_from_hf_config_rejects_interleaved_layer_types():
    d = M.to_hf_config(PARITY_CFG)
    d["mlp_layer_types"] = ["dense", "sparse", "dense", "sparse"]
    with pytest.raises(ValueError, match="dense layers first"):
        M.from_hf_config(d)
    # RoPE: the older top-level rope_theta is read; none at all, or a scaled variant, is refused (10000 was assumed)
    d = M.to_hf_config(PARITY_CFG)
    d.pop("rope_parameters")
    d["rope_theta"] = 500.0
    assert M.from_hf_config(d).rope_theta == 500.0
    d.pop("rope_theta")
    with pytest.raises(ValueError, match="no rope_theta"):
        M.from_hf_config(d)
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ValueError, match="plain RoPE only"):
        M.from_hf_config(d)


# ----------------------------------------------------------------------------------------------------------
# the model against a plain reference written from DESIGN.md / REFERENCES.md (head by head, token by token)

def reference_logits(model, idx):
    """Logits of a Picaflor computed the slow, obvious way from its state dict. Independent of model.py's code paths:
    query head h reads kv head h // (n_head // n_kv_head); RoPE rotates dims (i, i + hd/2) by pos * theta^(-2i/hd);
    the router's bias only selects, the weights are the unbiased sigmoids normalised then times route_scale."""
    c, sd, hd = model.cfg, model.state_dict(), model.cfg.head_dim
    T = idx.shape[1]

    def norm(x, w):
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps)

    def rope(x):  # (T, hd)
        half = hd // 2
        ang = torch.arange(T, dtype=torch.float64)[:, None] * c.rope_theta ** (-2 * torch.arange(half) / hd)
        cos, sin, a, b = ang.cos().float(), ang.sin().float(), x[:, :half], x[:, half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=1)

    def swiglu(x, gate, up, down):
        return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T

    out = []
    for row in idx:
        x = sd["embed_tokens.weight"][row]
        for layer in range(c.n_layer):
            p = f"layers.{layer}."
            h = norm(x, sd[p + "input_layernorm.weight"])
            q, k, v = (h @ sd[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
            heads = []
            for i in range(c.n_head):
                j = i // (c.n_head // c.n_kv_head)
                qi = rope(norm(q[:, i * hd:(i + 1) * hd], sd[p + "self_attn.q_norm.weight"]))
                kj = rope(norm(k[:, j * hd:(j + 1) * hd], sd[p + "self_attn.k_norm.weight"]))
                s = (qi @ kj.T / hd ** 0.5).masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
                heads.append(s.softmax(-1) @ v[:, j * hd:(j + 1) * hd])
            x = x + torch.cat(heads, dim=1) @ sd[p + "self_attn.o_proj.weight"].T
            h = norm(x, sd[p + "post_attention_layernorm.weight"])
            if layer < c.n_dense_layers:
                x = x + swiglu(h, *(sd[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")))
                continue
            f = swiglu(h, *(sd[p + f"mlp.shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down")))
            for t in range(T):
                s = torch.sigmoid(sd[p + "mlp.gate.weight"] @ h[t])
                chosen = torch.topk(s + sd[p + "mlp.e_score_correction_bias"], c.top_k).indices
                for e in chosen:
                    gu = sd[p + "mlp.experts.gate_up_proj"][e] @ h[t]
                    y = sd[p + "mlp.experts.down_proj"][e] @ (F.silu(gu[:c.expert_ffn]) * gu[c.expert_ffn:])
                    f[t] = f[t] + s[e] / s[chosen].sum() * c.route_scale * y
            x = x + f
        out.append(norm(x, sd["norm.weight"]) @ sd["lm_head.weight"].T)
    return torch.stack(out)


def test_forward_and_cached_decode_equal_a_plain_reference():
    """GQA groups of 3 over 2 kv heads, a norm_eps large enough to matter (the HF parity tests use HF's default 1e-6,
    so a QK norm with a hard-coded eps passed them), rope_theta, top-3 of 6 with a random selection bias."""
    cfg = M.ModelConfig(vocab_size=50, n_layer=3, n_dense_layers=1, d_model=48, n_head=6, n_kv_head=2, dense_ffn=40,
                        n_experts=6, expert_ffn=16, n_shared=2, top_k=3, route_scale=1.7, rope_theta=300.0,
                        max_seq_len=16, norm_eps=0.25)
    model = randomise(M.Picaflor(cfg), seed=7).eval()
    idx = torch.randint(1, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference_logits(model, idx)
        torch.testing.assert_close(model(idx), want, atol=2e-5, rtol=0)
        cache = M.KVCache(cfg, 2, 9, "cpu", torch.float32)  # one token at a time: RoPE offsets and the T == 1 path
        torch.testing.assert_close(torch.cat([model(idx[:, t:t + 1], cache=cache) for t in range(9)], 1), want,
                                   atol=2e-5, rtol=0)


def test_init_scales():
    """GPT-2 init: N(0, 0.02), the residual-output projections (attention o_proj, dense / shared / routed down_proj)
    N(0, 0.02 / sqrt(2 n_layer)), norms 1, selection bias 0."""
    cfg = M.ModelConfig(vocab_size=256, n_layer=8, n_dense_layers=1, d_model=64, n_head=4, n_kv_head=2, dense_ffn=128,
                        n_experts=8, expert_ffn=32, n_shared=2, max_seq_len=16)
    torch.manual_seed(0)
    model = M.Picaflor(cfg)
    out_std = 0.02 / (2 * cfg.n_layer) ** 0.5
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            want = out_std if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")) else 0.02
            assert abs(p.float().std().item() / want - 1) < 0.1 and abs(p.float().mean().item()) < want / 10, name
    assert all(torch.equal(m.e_score_correction_bias, torch.zeros(cfg.n_experts)) for m in model.moe_layers())


# ----------------------------------------------------------------------------------------------------------
# grouped dispatch vs the plain per-expert loop

MOE_CFG = M.ModelConfig(vocab_size=64, n_layer=2, n_dense_layers=1, d_model=48, n_head=4, n_kv_head=2,
                        dense_ffn=64, n_experts=8, expert_ffn=24, n_shared=1, top_k=2, route_scale=1.7)


def make_moe(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    moe = M.MoE(MOE_CFG)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.15)
        moe.e_score_correction_bias.normal_(0.0, 0.05)
    moe.to(dtype)
    moe.gate.float()
    moe.e_score_correction_bias.data = moe.e_score_correction_bias.data.float()
    return moe


def fwd_bwd(fn, moe, x, gy):
    moe.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    y.backward(gy)
    grads = {n: p.grad.detach().clone() for n, p in moe.named_parameters()}
    return y.detach(), x.grad.detach(), grads


def assert_dispatch_matches_reference(moe, x, atol, rtol=0.0):
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(x.dtype)
    y, gx, gp = fwd_bwd(moe, moe, x, gy)
    y_ref, gx_ref, gp_ref = fwd_bwd(lambda t: M.moe_reference(moe, t), moe, x, gy)
    assert y.dtype == x.dtype
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(gx, gx_ref, atol=atol, rtol=rtol)
    assert set(gp) == {n for n, _ in moe.named_parameters()} and len(gp) == 6
    for n in gp:
        torch.testing.assert_close(gp[n], gp_ref[n], atol=atol, rtol=rtol, msg=lambda m: f"{n}: {m}")
    assert gp["gate.weight"].abs().max() > 0  # the router learns through the mixing weights


@pytest.mark.parametrize("n_tokens", [40, 3])  # 3 tokens x top-2 leave most experts empty
def test_grouped_dispatch_equals_reference_fp32(n_tokens, monkeypatch):
    monkeypatch.setattr(M, "CPU_EXPERT_PARALLEL", False)  # torch._grouped_mm, the CUDA path, on CPU
    moe = make_moe()
    x = torch.randn(1, n_tokens, MOE_CFG.d_model, generator=torch.Generator().manual_seed(1))
    assert M.grouped_mm_ok(x.view(-1, MOE_CFG.d_model), moe.experts.gate_up_proj)
    assert_dispatch_matches_reference(moe, x, atol=2e-5)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_grouped_dispatch_backward_from_sum(expert_parallel, monkeypatch):
    # .sum() hands back a zero-stride gradient, which torch._grouped_mm's backward rejects unless made contiguous
    monkeypatch.setattr(M, "CPU_EXPERT_PARALLEL", expert_parallel)
    moe = make_moe(seed=3)
    x = torch.randn(2, 9, MOE_CFG.d_model, requires_grad=True)
    moe(x).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    g_experts = moe.experts.gate_up_proj.grad.clone()
    moe.zero_grad(set_to_none=True)
    M.moe_reference(moe, x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=2e-5, rtol=0)
    torch.testing.assert_close(g_experts, moe.experts.gate_up_proj.grad, atol=2e-5, rtol=0)


def test_cpu_expert_parallel_under_inference_mode():
    """eval.py runs the model under torch.inference_mode: the expert threads write into its inference tensors
    (inference mode is thread-local, as grad mode is), and the result equals a no_grad forward."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        moe = make_moe(seed=6)
        x = torch.randn(1, 40, MOE_CFG.d_model, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            want = moe(x)
        with torch.inference_mode():
            got = moe(x)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("n_tokens,threads", [(40, 2), (3, 2), (40, 1), (64, 3)])
def test_cpu_expert_parallel_equals_reference(n_tokens, threads, monkeypatch):
    """The CPU path: experts dealt to threads, single-threaded GEMMs each; forward and every grad."""
    calls = []
    orig = M.ExpertFFNCPU.forward
    monkeypatch.setattr(M.ExpertFFNCPU, "forward", staticmethod(lambda *a: calls.append(1) or orig(*a)))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        moe = make_moe(seed=4)
        x = torch.randn(1, n_tokens, MOE_CFG.d_model, generator=torch.Generator().manual_seed(5))
        assert_dispatch_matches_reference(moe, x, atol=2e-5)
        assert torch.get_num_threads() == threads  # the thread count is restored after each expert region
    finally:
        torch.set_num_threads(before)
    assert calls


def test_padded_bmm_fallback_equals_reference(monkeypatch):
    monkeypatch.setattr(M, "CPU_EXPERT_PARALLEL", False)
    calls = []
    monkeypatch.setattr(M, "grouped_mm_ok", lambda xs, w: calls.append(1) and False)
    moe = make_moe(seed=1)
    x = torch.randn(2, 17, MOE_CFG.d_model, generator=torch.Generator().manual_seed(2))
    assert_dispatch_matches_reference(moe, x, atol=2e-5)
    assert calls  # the fallback path really ran


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_grouped_dispatch_bf16_cpu(expert_parallel, monkeypatch):
    monkeypatch.setattr(M, "CPU_EXPERT_PARALLEL", expert_parallel)
    moe = make_moe(torch.bfloat16, seed=2)
    assert moe.experts.gate_up_proj.dtype == torch.bfloat16 and moe.gate.weight.dtype == torch.float32
    x = torch.randn(2, 20, MOE_CFG.d_model, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert_dispatch_matches_reference(moe, x, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_dispatch_under_bf16_autocast_runs_experts_in_bf16_and_routes_in_fp32(expert_parallel, monkeypatch):
    """train.py's CUDA runs are fp32 weights under bf16 autocast: the router stays fp32 (its top-k picks and weights
    those of an fp32 forward) and the experts' slots are cast to the autocast dtype (torch._grouped_mm on the card).
    The same code reads the autocast of x's device: CPU autocast drives it here."""
    monkeypatch.setattr(M, "CPU_EXPERT_PARALLEL", expert_parallel)
    moe = make_moe(seed=4)
    x = torch.randn(2, 15, MOE_CFG.d_model, generator=torch.Generator().manual_seed(6), requires_grad=True)
    slot_dtypes, apply = [], M.GatherSlots.apply
    monkeypatch.setattr(M.GatherSlots, "apply", lambda xs, *a: slot_dtypes.append(xs.dtype) or apply(xs, *a))
    w32, idx32 = moe.route(x.detach().view(-1, MOE_CFG.d_model))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w, idx = moe.route(x.detach().view(-1, MOE_CFG.d_model))
        y = moe(x)
    assert w.dtype == torch.float32 and torch.equal(w, w32) and torch.equal(idx, idx32)
    assert slot_dtypes == [torch.bfloat16] and y.dtype == torch.float32
    ref = M.moe_reference(moe, x.detach())
    torch.testing.assert_close(y.detach(), ref, atol=3e-2 * ref.abs().max().item(), rtol=0)
    y.square().sum().backward()  # fp32 grads for the fp32 weights, through the bf16 experts
    assert moe.experts.gate_up_proj.grad.dtype == torch.float32 and moe.experts.gate_up_proj.grad.abs().max() > 0


def test_grouped_mm_on_cuda_only_for_bf16_on_sm90(monkeypatch):
    """Where the CUDA training path takes torch._grouped_mm (bf16 on a Hopper-or-later card, 16-byte row strides, a
    bf16 trace under compile) and where the padded bmm (fp32 or fp16, an sm80 card, odd widths): the decision alone,
    on stand-ins for CUDA tensors (the bmm itself: test_padded_bmm_fallback_equals_reference)."""
    from types import SimpleNamespace
    major = [9]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (major[0], 0))

    def on_cuda(dtype):
        return SimpleNamespace(dtype=dtype, device=torch.device("cuda", 0),
                               element_size=lambda: torch.empty(0, dtype=dtype).element_size())
    w, odd = torch.empty(8, 32, 64), torch.empty(8, 32, 36)
    assert M.grouped_mm_ok(on_cuda(torch.bfloat16), w)
    assert not M.grouped_mm_ok(on_cuda(torch.float32), w) and not M.grouped_mm_ok(on_cuda(torch.float16), w)
    assert not M.grouped_mm_ok(on_cuda(torch.bfloat16), odd)  # 36 bf16 = 72 bytes: not a multiple of 16
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert M.grouped_mm_ok(on_cuda(torch.bfloat16), w) and not M.grouped_mm_ok(on_cuda(torch.float32), w)
    major[0] = 8  # an A100
    assert not M.grouped_mm_ok(on_cuda(torch.bfloat16), w)


@pytest.mark.parametrize("dtype,d_model,expert_ffn", [(torch.bfloat16, 36, 16), (torch.float32, 32, 9)])
def test_grouped_dispatch_with_widths_grouped_mm_refuses(dtype, d_model, expert_ffn, monkeypatch):
    """torch._grouped_mm (the CUDA training path) wants 16-byte row strides: d_model 100 in bf16 or expert_ffn 33 was
    "strides should be multiple of 16 bytes" at the first step; such widths take the padded bmm instead."""
    monkeypatch.setattr(M, "CPU_EXPERT_PARALLEL", False)
    cfg = replace(MOE_CFG, d_model=d_model, n_head=2, expert_ffn=expert_ffn)
    torch.manual_seed(8)
    moe = M.MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.15)
    moe.to(dtype)
    moe.gate.float()
    x = torch.randn(2, 11, d_model, generator=torch.Generator().manual_seed(9)).to(dtype)
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-5
    assert_dispatch_matches_reference(moe, x, atol=tol, rtol=tol)


def test_compile_model_on_cpu_keeps_dispatch_eager(monkeypatch):
    """train.py's --compile on CPU: compile_model equals the eager model (loss and grads), and its MoE layers run
    the eager ExpertFFNCPU path (traced, the dispatch broke the graph at bincount and .item(), 22 graphs against 7
    here, and the padded bmm it compiled trained tiny ~30% slower than this). The aot_eager backend: the graph breaks
    and the compiled autograd are dynamo's and AOTAutograd's; inductor's C++ build of the same graphs cost the suite
    50 s on a cold cache and checks torch, not picaflor."""
    import copy
    import functools
    import torch._dynamo
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    calls = []
    fwd = M.ExpertFFNCPU.forward
    monkeypatch.setattr(M.ExpertFFNCPU, "forward", staticmethod(lambda *a: calls.append(1) or fwd(*a)))
    eager = randomise(M.Picaflor(PARITY_CFG), seed=3).train()
    compiled = M.compile_model(copy.deepcopy(eager), "cpu")
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        idx = torch.randint(0, PARITY_CFG.vocab_size, (2, 24), generator=g)  # new tokens: new routing each step
        losses = []
        for m in (eager, compiled):
            m.zero_grad()
            del calls[:]
            loss = m(idx, targets=torch.roll(idx, -1, 1))[1]
            loss.backward()
            losses.append(loss)
            assert len(calls) == len(eager.moe_layers())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)

    # compile_model on CUDA compiles the MoE dispatch too (on CPU it stays eager): traced, a chat batch's padding
    # rows (load_rows, from load_mask) are routed but kept out of load_accum, and the outputs are the eager ones.
    # Dynamo's tracing of the dispatch is the same on any device (its eager backend here: inductor's CUDA kernels need
    # a GPU, bench/gpu_run.sh); an fp32 trace takes the padded bmm there too (grouped_mm_ok: bf16 only when tracing).
    torch._dynamo.reset()
    eager = make_moe(seed=1).train()
    traced = copy.deepcopy(eager)
    compiled = M.compile_model(traced, "cuda")  # (torch.compile: aot_eager, patched above)
    x = torch.randn(26, MOE_CFG.d_model, generator=torch.Generator().manual_seed(2))
    rows = torch.ones(26, dtype=torch.bool)
    rows[19:] = False  # the last 7 rows: padding
    ys = []
    for moe, fn in ((eager, eager), (traced, compiled)):
        moe.load_rows = rows
        del calls[:]
        with torch.no_grad():  # (autograd.Functions traced for a backward: 3 s here, for what the CPU test checks)
            ys.append(fn(x))
        assert moe.load_accum.sum() == 19 * MOE_CFG.top_k and moe.last_load.sum() == 26 * MOE_CFG.top_k
        assert bool(calls) == (fn is eager)  # the traced dispatch took the compiled path, not ExpertFFNCPU
    torch.testing.assert_close(ys[1], ys[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(traced.load_accum, eager.load_accum)


def test_moe_counts_load_in_training_only():
    moe = make_moe()
    x = torch.randn(30, MOE_CFG.d_model)
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert moe.load_accum.sum() == 0 and moe.last_load.sum() == 30 * MOE_CFG.top_k
    moe.train()
    moe(x)
    moe(x[:10])
    assert moe.load_accum.sum() == 40 * MOE_CFG.top_k
    moe.to(torch.bfloat16)  # counts stay exact in a bf16 model
    moe.load_accum += 255
    moe(x.to(torch.bfloat16)[:1])
    assert moe.load_accum.sum() == 40 * MOE_CFG.top_k + 8 * 255 + MOE_CFG.top_k


# ----------------------------------------------------------------------------------------------------------
# balancing (aux-loss-free bias update)

BAL_CFG = M.ModelConfig(vocab_size=96, n_layer=2, n_dense_layers=1, d_model=32, n_head=4, n_kv_head=2,
                        dense_ffn=64, n_experts=8, expert_ffn=16, n_shared=1, top_k=2, bias_update_rate=0.02,
                        max_seq_len=64)


def skewed_model(seed=0):
    """Every token embedding carries a large shared component u and the router rows of experts 0 and 1
    point along u, so nearly all tokens pick experts 0 and 1 at init (tokens still differ: std-1 embeddings,
    std-0.3 router rows, so a bias can spread them)."""
    torch.manual_seed(seed)
    model = M.Picaflor(BAL_CFG)
    with torch.no_grad():
        u = F.normalize(torch.randn(BAL_CFG.d_model), dim=0)
        model.embed_tokens.weight.normal_(0.0, 1.0).add_(3.0 * u)
        gate = model.layers[1].mlp.gate.weight
        gate.normal_(0.0, 0.3)
        gate[:2] += 3.0 * u
    return model


def train_tiny(model, steps, bias_update, lr=2e-3):
    g = torch.Generator().manual_seed(7)
    data = torch.randint(1, BAL_CFG.vocab_size, (8, 33), generator=g)  # one fixed random batch: memorisable
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses, cvs = [], []
    for _ in range(steps):
        _, loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        load = model.take_expert_load()
        cvs.append(M.load_stats(load)[0].item())
        if bias_update:
            model.update_router_bias(load)
        losses.append(loss.item())
    return losses, cvs


@pytest.mark.parametrize("seed", [0, 1])
def test_bias_update_balances_skewed_router_while_loss_falls(seed):
    losses, cvs = train_tiny(skewed_model(seed), 30, bias_update=True)
    start_cv = cvs[0]
    assert start_cv > 1.4, start_cv  # the skew is real: 2 of 8 experts take nearly everything
    end_cv = sum(cvs[-10:]) / 10
    assert end_cv < 0.3 * start_cv, (start_cv, end_cv)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, (losses[0], losses[-5:])


def test_without_bias_update_cv_stays_high():
    losses, cvs = train_tiny(skewed_model(0), 30, bias_update=False)
    assert sum(cvs[-10:]) / 10 > 0.6 * cvs[0], (cvs[0], cvs[-10:])
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5  # the same training, only the bias update is off


def test_bias_update_per_layer_and_centred():
    cfg = replace(BAL_CFG, n_layer=3, n_dense_layers=1)
    model = M.Picaflor(cfg)
    load = torch.tensor([[10., 0, 0, 0, 0, 0, 0, 6], [1., 1, 1, 1, 1, 1, 1, 9]])
    model.update_router_bias(load, gamma=0.1)
    b1, b2 = (m.e_score_correction_bias for m in model.moe_layers())
    for b, l in ((b1, load[0]), (b2, load[1])):
        delta = 0.1 * torch.sign(l.mean() - l)
        torch.testing.assert_close(b, delta - delta.mean())
        assert abs(b.sum().item()) < 1e-6
    assert not torch.allclose(b1, b2)
    assert b1[0] < 0 and b1[1] > 0 and b2[7] < 0 and b2[0] > 0  # overloaded down, underloaded up
    # default gamma is the config's
    model.update_router_bias(load)
    torch.testing.assert_close(b1[0], torch.tensor(-1.5 * (0.1 + cfg.bias_update_rate)))  # -g - g * 4/8, twice


def test_load_stats():
    cv, dead = M.load_stats(torch.tensor([[4., 4, 4, 4], [16., 0, 0, 0]]))
    torch.testing.assert_close(cv, torch.tensor([0.0, 3 ** 0.5]))
    torch.testing.assert_close(dead, torch.tensor([0.0, 0.75]))


# ----------------------------------------------------------------------------------------------------------
# generation and the KV cache

SMALL_CFG = M.ModelConfig(vocab_size=128, n_layer=3, n_dense_layers=1, d_model=32, n_head=4, n_kv_head=2,
                          dense_ffn=64, n_experts=8, expert_ffn=16, n_shared=1, top_k=2, max_seq_len=64)


def test_generate_with_cache_equals_without():
    model = randomise(M.Picaflor(SMALL_CFG), seed=4).eval()
    prompt = torch.randint(0, SMALL_CFG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    a = model.generate(prompt, 20, temperature=0, use_cache=True)
    b = model.generate(prompt, 20, temperature=0, use_cache=False)
    assert a.shape == (2, 27) and torch.equal(a[:, :7], prompt)
    assert torch.equal(a, b)
    assert len(set(a[0, 7:].tolist())) > 1  # a degenerate constant sequence would prove little


def test_generate_stops_each_row_at_eos_and_refuses_an_empty_prompt(monkeypatch):
    """Batch generation stopped only when every row drew eos at the same step, so a row done early ran on with
    made-up text and the batch never ended early; an empty prompt failed with a reshape error deep in attention."""
    model = randomise(M.Picaflor(SMALL_CFG), seed=4).eval()
    prompt = torch.randint(1, SMALL_CFG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    eos = 3
    draws = iter([[eos, 9], [7, 11], [8, eos], [5, 6], [5, 6]])
    monkeypatch.setattr(M, "sample_next", lambda *a, **k: torch.tensor(next(draws)).view(2, 1))
    out = model.generate(prompt, 5, eos_id=eos)
    assert out[:, 5:].tolist() == [[eos, eos, eos], [9, 11, eos]]  # row 0 keeps eos; both done after step 3
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 3)


def test_generate_may_fill_the_whole_context():
    """The last new token is never fed back, so generation needs prompt + max_new_tokens - 1 positions (stream_infer's
    engine serves a prompt of max_seq_len with one new token); generate refused every request one position short."""
    model = randomise(M.Picaflor(SMALL_CFG), seed=4).eval()
    L = SMALL_CFG.max_seq_len
    full = torch.randint(1, SMALL_CFG.vocab_size, (1, L), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(full)[0, -1].argmax()
    for use_cache in (True, False):
        assert model.generate(full, 1, temperature=0, use_cache=use_cache)[0, -1] == want
        out = model.generate(full[:, :L - 4], 5, temperature=0, use_cache=use_cache)
        assert out.shape == (1, L + 1) and torch.equal(out[:, :L - 4], full[:, :L - 4])
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model.generate(full, 2)


def test_loss_is_the_mean_over_targets_and_zero_without_any():
    """A window whose targets are all masked (an SFT window of prompt tokens) has loss 0, not NaN (which stopped
    training as a non-finite loss); otherwise the mean over the targets left, as cross_entropy's ignore_index."""
    m = randomise(M.Picaflor(SMALL_CFG), seed=4).eval()
    idx = torch.randint(1, SMALL_CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(1, SMALL_CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 8, dtype=torch.uint8)
    mask[0, 3:] = 1
    logits, loss = m(idx, targets, loss_mask=mask)
    want = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.masked_fill(mask == 0, -1).view(-1),
                           ignore_index=-1)
    assert torch.allclose(loss, want, atol=1e-6)
    _, none = m(idx, targets, loss_mask=torch.zeros_like(mask))
    assert none.item() == 0.0


def test_chunked_prefill_equals_full_forward():
    model = randomise(M.Picaflor(SMALL_CFG), seed=5).eval()
    idx = torch.randint(0, SMALL_CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)
        cache = M.KVCache(SMALL_CFG, 2, 32, "cpu", torch.float32)
        parts = [model(idx[:, :6], cache=cache), model(idx[:, 6:13], cache=cache),  # chunk after a cache
                 model(idx[:, 13:14], cache=cache), model(idx[:, 14:], cache=cache)]
    assert cache.pos == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="KV cache full"), torch.no_grad():
        model(idx, cache=cache)


def test_sample_next_greedy_and_topk():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9], [3.0, 0.0, 0.0, 0.0]])
    assert M.sample_next(logits, temperature=0).flatten().tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    draws = {M.sample_next(logits[:1], temperature=1.0, top_k=2, generator=g).item() for _ in range(200)}
    assert draws == {1, 3}
    draws = {M.sample_next(logits[:1], temperature=1.0, top_p=0.3, generator=g).item() for _ in range(50)}
    assert draws == {1}


# ----------------------------------------------------------------------------------------------------------
# sizes

def test_param_counts_by_hand():
    c = SMALL_CFG
    D, hd = c.d_model, c.head_dim
    attn = D * c.n_head * hd * 2 + D * c.n_kv_head * hd * 2 + 2 * hd  # q, o, k, v, q_norm, k_norm
    norms = 2 * D
    dense = 3 * D * c.dense_ffn
    routed = c.n_experts * 3 * D * c.expert_ffn
    moe = c.n_experts * D + routed + 3 * D * c.n_shared * c.expert_ffn
    n_moe = c.n_layer - c.n_dense_layers
    body = c.n_layer * (attn + norms) + c.n_dense_layers * dense + n_moe * moe + D
    emb = c.vocab_size * D
    model = M.Picaflor(c)
    assert model.num_params() == body + 2 * emb
    inactive = n_moe * (c.n_experts - c.top_k) * 3 * D * c.expert_ffn
    assert model.active_params() == body + 2 * emb - inactive
    assert model.active_params(top_k=1) == model.active_params() - n_moe * 3 * D * c.expert_ffn
    assert model.active_params(include_embedding=False) == body + emb - inactive
    tied = M.Picaflor(replace(c, tie_embeddings=True))
    assert tied.num_params() == body + emb
    assert tied.active_params(include_embedding=False) == body + emb - inactive  # the lm_head still works



def test_flops_per_token_is_palms_formula_by_hand():
    """MFU's numerator (PaLM app. B, REFERENCES): 6 x active matmul params (lm_head in, embedding lookup, norms and the
    k routed experts not chosen out) + 12 x n_layer x n_head x head_dim x seq_len."""
    c = SMALL_CFG
    D, hd = c.d_model, c.head_dim
    attn = D * c.n_head * hd * 2 + D * c.n_kv_head * hd * 2
    n_moe = c.n_layer - c.n_dense_layers
    moe = c.n_experts * D + c.top_k * 3 * D * c.expert_ffn + 3 * D * c.n_shared * c.expert_ffn
    matmul = c.n_layer * attn + c.n_dense_layers * 3 * D * c.dense_ffn + n_moe * moe + c.vocab_size * D
    for T in (1, 48):
        assert M.Picaflor(c).flops_per_token(T) == 6 * matmul + 12 * c.n_layer * c.n_head * hd * T
    assert M.Picaflor(replace(c, tie_embeddings=True)).flops_per_token(48) == M.Picaflor(c).flops_per_token(48)

def test_meta_model_matches_and_skips_random_init():
    """meta_model: the same tree and shapes as Picaflor, tied weights tied, and no random init on meta tensors, which
    would import torch._dynamo (+180 MB RSS, paid out of stream_infer's --ram-budget); a fresh interpreter checks."""
    import subprocess
    for cfg in (PARITY_CFG, replace(PARITY_CFG, tie_embeddings=True)):
        with torch.device("meta"):
            ref = {k: v.shape for k, v in M.Picaflor(cfg).state_dict().items()}
        m = M.meta_model(cfg)
        assert {k: v.shape for k, v in m.state_dict().items()} == ref
        assert all(p.is_meta for p in m.parameters())
        assert (m.lm_head.weight is m.embed_tokens.weight) == cfg.tie_embeddings
    code = ("import sys, model; model.meta_model(model.ModelConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, "
            "n_kv_head=1, dense_ffn=32, n_experts=4, expert_ffn=16, top_k=2)); "
            "print('dynamo' if 'torch._dynamo' in sys.modules else 'clean')")
    out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         capture_output=True, text=True, check=True).stdout.split()[-1]
    assert out == "clean"


# ----------------------------------------------------------------------------------------------------------
# checkpoints

def test_checkpoint_round_trip(tmp_path):
    model = randomise(M.Picaflor(SMALL_CFG), seed=6).eval()
    path = M.save_checkpoint(model, str(tmp_path), step=12, state={"tokens": 99})
    assert os.path.basename(path) == "step_0000012"
    loaded = M.load_checkpoint(str(tmp_path))  # the run dir (LATEST) works as well as the step dir
    assert not loaded.training and loaded.cfg == model.cfg
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert set(sd) == set(sd2)
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    idx = torch.randint(0, SMALL_CFG.vocab_size, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(idx), loaded(idx))
    # the weights are as readable as the step's other files (safetensors made them 0600: a group read all but them)
    modes = {f: os.stat(os.path.join(path, f)).st_mode & 0o777 for f in ("model.safetensors", "state.json")}
    assert modes["model.safetensors"] == modes["state.json"], modes


def test_checkpoint_tied_and_bf16(tmp_path):
    model = randomise(M.Picaflor(replace(SMALL_CFG, tie_embeddings=True)), seed=7)
    M.save_checkpoint(model, str(tmp_path), step=1)
    loaded = M.load_checkpoint(os.path.join(str(tmp_path), "step_0000001"), dtype=torch.bfloat16)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    assert loaded.embed_tokens.weight.dtype == torch.bfloat16
    for m in loaded.moe_layers():
        assert m.experts.gate_up_proj.dtype == torch.bfloat16
        assert m.gate.weight.dtype == torch.float32 and m.e_score_correction_bias.dtype == torch.float32
        assert m.e_score_correction_bias.abs().sum() > 0
    for m, m0 in zip(loaded.moe_layers(), model.moe_layers()):
        assert torch.equal(m.e_score_correction_bias, m0.e_score_correction_bias)  # bias exact, not rounded
    idx = torch.randint(0, SMALL_CFG.vocab_size, (1, 9))
    with torch.no_grad():
        out = loaded(idx)
        ref = model.eval()(idx)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_checkpoint_tampered_file_is_refused(tmp_path):
    model = M.Picaflor(SMALL_CFG)
    path = M.save_checkpoint(model, str(tmp_path), step=5)
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) - 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(checkpoint.CheckpointError, match="model.safetensors"):
        M.load_checkpoint(path)


def test_checkpoint_of_another_config_is_one_checkpoint_error(tmp_path, monkeypatch):
    """A state.json from a newer picaflor (a config key this one lacks) raised ValueError, weights whose shapes
    differ from the config RuntimeError: eval.py and chat.py catch CheckpointError, so the user saw a traceback.
    A config missing a key is refused too: every picaflor checkpoint holds them all."""
    import json
    path = M.save_checkpoint(M.Picaflor(SMALL_CFG), str(tmp_path), step=5)
    state_path, man_path = os.path.join(path, "state.json"), os.path.join(path, "MANIFEST.json")
    state, man = json.load(open(state_path)), json.load(open(man_path))

    def rewrite(model_config):  # a consistent checkpoint (manifest and all) that holds this config
        json.dump(dict(state, model_config=model_config), open(state_path, "w"))
        man["files"]["state.json"] = {"sha256": checkpoint.sha256_file(state_path), "bytes": os.path.getsize(state_path)}
        json.dump(man, open(man_path, "w"))
    meta = M.meta_model
    monkeypatch.setattr(M, "meta_model", lambda cfg: meta(cfg) if cfg.n_layer < 100 else pytest.fail("built"))
    for model_config, words in [(dict(state["model_config"], qk_gate=True), "state.json: no model config"),
                                (dict(state["model_config"], expert_ffn=2 * SMALL_CFG.expert_ffn), "does not fit"),
                                # a config without a key: the field's default stood in for the model's value, silently
                                ({k: v for k, v in state["model_config"].items() if k != "rope_theta"},
                                 r"state.json: no model config.*lacks keys \['rope_theta'\]"),
                                # (found by fuzzing) a TypeError traceback in range(); to_empty asking for 2^48 bytes
                                # (a RuntimeError traceback); a meta model of 10^12 layers built until memory ran out
                                (dict(state["model_config"], n_dense_layers=0.5), "n_dense_layers=0.5 is not of its"),
                                (dict(state["model_config"], vocab_size=2 ** 40), "does not fit.*embed_tokens.weight"),
                                (dict(state["model_config"], n_layer=10 ** 12), "does not fit.*n_layer 1000000000000"),
                                # inf in the float32 the model computes in (the GGUF export's OverflowError), and
                                # tensors past torch's sizes (a RuntimeError traceback)
                                (dict(state["model_config"], rope_theta=1e308), r"rope_theta=1e\+308 must be a finite"),
                                (dict(state["model_config"], d_model=10 ** 12), "does not fit.*past torch's sizes")]:
        rewrite(model_config)
        with pytest.raises(checkpoint.CheckpointError, match=words):
            M.load_checkpoint(path)


def test_model_cli_and_config_checks(tmp_path, monkeypatch, capsys):
    """python model.py CONFIG: a typo of a model field printed the defaults' counts; a missing file or a bad shape
    was a traceback. n_shared=0 built a model the HF export cannot write (HF reads 0 as its dense width)."""
    with pytest.raises(ValueError, match="n_shared=0 must be at least 1"):
        replace(SMALL_CFG, n_shared=0).validate()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    typo, bad = tmp_path / "typo.py", tmp_path / "bad.py"
    typo.write_text("n_layers = 4\nd_model = 128\nout_dir = 'out/x'\n")
    bad.write_text("n_head = 5\n")
    float_layers = tmp_path / "float.py"  # a field of another type was a TypeError traceback (or a compare's)
    float_layers.write_text("n_layer = 4.5\n")
    cases = [(typo, "n_layers (did you mean n_layer?)"), (tmp_path / "nope.py", "No such file"),
             (bad, "not divisible by n_head=5"), (float_layers, "n_layer must be an int")]
    r = subprocess.run([sys.executable, os.path.join(repo, "model.py"), str(typo)], capture_output=True, text=True)
    assert r.returncode != 0 and cases[0][1] in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    import runpy  # the rest in this process (a subprocess spends ~2 s importing torch only to refuse its file)
    for path, words in cases[1:]:
        monkeypatch.setattr(sys, "argv", ["model.py", str(path)])
        capsys.readouterr()
        with pytest.raises(SystemExit) as ei:
            runpy.run_path(os.path.join(repo, "model.py"), run_name="__main__")
        msg = ei.value.code  # a str: exit 1, printed alone on stderr
        assert isinstance(msg, str) and words in msg and "\n" not in msg and not capsys.readouterr().err, msg


def test_model_cli_prints_small_models_in_millions(monkeypatch, capsys):
    """python model.py config/tiny.py printed "total params 0.003B, active per token 0.002B": every figure in B
    rounded a model under 0.1B to nothing; there it prints M (train.py's unit), while nano keeps its 2.604B."""
    import runpy
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for config, unit, scale in (("tiny.py", "M", 1e6), ("nano.py", "B", 1e9)):
        monkeypatch.setattr(sys, "argv", ["model.py", os.path.join(repo, "config", config)])
        runpy.run_path(os.path.join(repo, "model.py"), run_name="__main__")
        printed = capsys.readouterr().out
        g = {}
        exec(open(os.path.join(repo, "config", config)).read(), g)
        m = M.meta_model(M.ModelConfig.from_dict({k: g[k] for k in M.ModelConfig.__dataclass_fields__ if k in g}))
        total, active = m.num_params() / scale, m.active_params() / scale
        digits = 1 if unit == "M" else 3
        assert f"total params {total:.{digits}f}{unit}, active per token {active:.{digits}f}{unit}" in printed, printed
        assert float(f"{total:.{digits}f}") > 1, printed  # not a figure rounded toward zero


def test_device_problem_names_what_cannot_run_here(monkeypatch):
    """chat, eval and stream_infer refuse a device with this one check: a typo, a device kind torch would take but the
    scripts never run on, and a CUDA index past the machine's GPUs all get a reason; cpu and a present GPU get None."""
    from model import device_problem
    assert device_problem("cpu") is None
    for bad in ("gpu", "mps", "cuda:x", "cuda:", "CPU"):
        assert "use cpu, cuda or cuda:N" in device_problem(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU is visible" in device_problem("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_problem("cuda") is None and device_problem("cuda:1") is None
    assert "2 CUDA device(s)" in device_problem("cuda:2")


def test_doc_ids_keep_each_packed_document_to_itself():
    # a row packing two documents: with doc_ids the second one's logits are those of it alone (RoPE is relative);
    # two kv heads, so the masked path's k/v repeat must map query heads to kv heads as the unmasked GQA path does
    torch.manual_seed(0)
    cfg = M.ModelConfig(vocab_size=64, n_layer=2, n_dense_layers=1, d_model=32, n_head=4, n_kv_head=2, dense_ffn=64,
                        n_experts=4, expert_ffn=16, n_shared=1, max_seq_len=32, tie_embeddings=True)
    m = M.Picaflor(cfg).eval()
    a, b = torch.randint(1, 64, (1, 7)), torch.randint(1, 64, (1, 9))
    row = torch.cat([a, b], 1)
    docs = torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        packed = m(row, doc_ids=docs)
        alone_a, alone_b = m(a), m(b)
        plain = m(row)
        assert torch.allclose(packed[:, :7], alone_a, atol=1e-5) and torch.allclose(packed[:, 7:], alone_b, atol=1e-5)
        assert not torch.allclose(plain[:, 7:], alone_b, atol=1e-3)  # without them b attends to a
        assert torch.allclose(m(row, doc_ids=torch.zeros_like(docs)), plain, atol=1e-5)  # one document: causal as ever
