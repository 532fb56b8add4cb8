"""stream_infer: budgeted == resident output, RSS under budget, counters, kernels, bad input (tiny models, CPU)."""
import ctypes
import json
import os
import re
import statistics
import subprocess
import signal
import time
import sys
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import container as C  # noqa: E402
import expert_cache as EC  # noqa: E402
import stream_bench as B  # noqa: E402
import kernels  # noqa: E402
import stream_infer as S  # noqa: E402
from model import ModelConfig, Picaflor, save_checkpoint  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """2 threads on the shared 2-core machine stall in OpenMP barriers (see stream_infer --threads). For this
    module only: set at import, it leaked into every test of the suite."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


CFG = dict(vocab_size=300, n_layer=4, n_dense_layers=1, d_model=64, n_head=4, n_kv_head=2, dense_ffn=96,
           n_experts=16, expert_ffn=64, n_shared=1, top_k=2, max_seq_len=128)


def random_container(tmp, name, cfg):
    """A random model of cfg (seed 0, router biases spread as training leaves them) and its container tmp/name.pcf4."""
    torch.manual_seed(0)
    m = Picaflor(ModelConfig(**cfg))
    with torch.no_grad():
        for moe in m.moe_layers():
            moe.e_score_correction_bias.normal_(0, 0.02)
    path = str(tmp / f"{name}.pcf4")
    C.write_container(save_checkpoint(m, str(tmp / "run"), 1), path, group_size=32, progress=False)
    return m, path


def dequantized_model(c):
    """The model of container c's dequantized weights, in eval mode: what the engine's logits are compared to."""
    q = Picaflor(c.config)
    q.load_state_dict(c.dequantized_state_dict(), strict=False)
    return q.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return random_container(tmp_path_factory.mktemp("si"), "tiny", CFG)


def test_engine_equals_dequantized_model(tiny):
    m, path = tiny
    c = C.load_container(path)
    q = dequantized_model(c)
    ids = torch.randint(1, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = q(ids)
        for kernel, tol in (("reference", 1e-5), ("native", 2e-2), ("int4pack", 2e-2)):
            eng = S.load(path, kernel=kernel)
            got = eng.logits(eng.forward(ids))
            assert (got - ref).abs().max() < tol * ref.abs().max(), kernel
            # KV-cached decoding gives the same last-position logits as a full forward
            kv = S.KVCache(eng.cfg, 1, 24, "cpu", torch.float32)
            eng.forward(ids[:, :20], kv)
            for t in range(20, 24):
                h = eng.forward(ids[:, t:t + 1], kv)
            assert (eng.logits(h[:, -1]) - got[:, -1]).abs().max() < 1e-4


def test_engine_equals_dequantized_model_at_other_top_k_and_the_whole_context(tiny):
    """What test_engine_equals_dequantized_model leaves out: serving with fewer or more experts per token than
    training (weights renormalised over the picks, as model.set_top_k and HF's HYV3 router do), and a prompt that
    fills max_seq_len exactly (its one new token is never fed back; one more is refused)."""
    m, path = tiny
    c = C.load_container(path)
    q = dequantized_model(c)
    eng = S.load(path, kernel="reference")
    ids = torch.randint(1, 300, (1, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        for k in (1, 3):
            q.set_top_k(k)
            ref = q(ids)
            want = q.generate(ids, 4, temperature=0)[0, 20:].tolist()
            eng.set_experts_per_token(k)
            got = eng.logits(eng.forward(ids))
            assert (got - ref).abs().max() < 1e-5 * ref.abs().max(), k
            eng.set_experts_per_token(None)
            assert eng.generate(ids[0].tolist(), 4, experts_per_token=k) == want, k
        q.set_top_k(CFG["top_k"])
        full = torch.randint(1, 300, (1, CFG["max_seq_len"]), generator=torch.Generator().manual_seed(7))
        assert eng.generate(full[0].tolist(), 1) == [int(q(full)[0, -1].argmax())]
    with pytest.raises(S.StreamError, match="exceeds the reserved context"):
        eng.generate(full[0].tolist(), 2)


def test_native_decode_past_4096_positions_matches_the_prompt_pass(tmp_path):
    """The riskiest long-position path: the native decode step (attn_decode in int4_cpu.cpp: its own RoPE'd cache
    writes at j * max_len + pos and its own softmax over pos + 1 keys, threaded once T * H * hd >= 2^16, i.e. past
    1024 positions here and never in the 128-position tests) after a prompt prefilled in chunks of 256 (a chunk ends
    exactly at 4096), decoding positions 4100-4127: the same logits as one prompt pass through model.py's attention,
    and the dequantized model's within the native kernel's tolerance. Attention made peaky (QK norm weights x3) so a
    position off by any amount changes the logits; model.py, HF and the prompt pass matched to ~1e-5 up to 8192."""
    cfg = dict(CFG, n_layer=2, n_experts=4, max_seq_len=4128, rope_theta=10000.0)
    torch.manual_seed(0)
    m = Picaflor(ModelConfig(**cfg))
    with torch.no_grad():
        for block in m.layers:
            block.self_attn.q_norm.weight.mul_(3)
            block.self_attn.k_norm.weight.mul_(3)
    path = str(tmp_path / "long.pcf4")
    C.write_container(save_checkpoint(m, str(tmp_path / "run"), 1), path, group_size=32, progress=False)
    ids = torch.randint(1, 300, (1, 4128), generator=torch.Generator().manual_seed(2))
    eng = S.load(path, kernel="native")
    assert eng.decode_plan is not None and eng.prefill_chunk == 256
    with torch.no_grad():
        full = eng.logits(eng.forward(ids))
        kv = S.KVCache(eng.cfg, 1, 4128, "cpu", torch.float32)
        eng.forward(ids[:, :4100], kv)
        steps = torch.cat([eng.logits(eng.forward(ids[:, t:t + 1], kv, last_only=True)) for t in range(4100, 4128)], 1)
        ref = dequantized_model(C.load_container(path))(ids)[:, 4100:]
    assert (steps - full[:, 4100:]).abs().max() < 1e-4 * full.abs().max()  # measured 5e-7; a position off by one: 0.45
    assert (steps - ref).abs().max() < 3e-2 * ref.abs().max()  # int8 activations (measured 1.6e-2)


FORKED_SHAPES = {  # shapes a fork sets that CFG does not reach (model.ModelConfig.validate allows each)
    "all-dense-no-experts": dict(n_dense_layers=4, n_experts=0),
    "moe-from-layer-0-mha": dict(n_dense_layers=0, n_kv_head=4),
    "odd-widths-6-experts-top3": dict(d_model=72, n_head=3, n_kv_head=1, dense_ffn=100, n_experts=6, expert_ffn=24,
                                      n_shared=2, top_k=3, route_scale=1.7, n_dense_layers=2, vocab_size=301),
}


@pytest.mark.parametrize("shape", FORKED_SHAPES)
def test_engine_equals_dequantized_model_for_forked_shapes(tmp_path, shape):
    """Each kernel's prompt pass and KV-cached decode steps give the dequantized model's logits, and greedy decoding
    its tokens, at the training top_k and at 1. An all-dense model (n_experts=0) refused every request with
    "--experts-per-token 2: must be in 1..0" (a flag nobody gave); d_model 72 has its untied int8 lm_head
    K % 16 != 0."""
    cfg = dict(CFG, **FORKED_SHAPES[shape])
    _, path = random_container(tmp_path, "f", cfg)
    c = C.load_container(path)
    q = dequantized_model(c)
    ids = torch.randint(1, 300, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = q(ids)
        want = {}
        for k in [1, c.config.top_k] if q.moe_layers() else [None, 1]:  # (no MoE layer: any k is the same model)
            if k is not None:
                q.set_top_k(k)
            want[k] = q.generate(ids, 4, temperature=0)[0, 12:].tolist()
        q.set_top_k(c.config.top_k)
        for kernel, tol in (("reference", 1e-5), ("native", 3e-2), ("int4pack", 3e-2)):
            eng = S.load(path, kernel=kernel)
            assert (eng.logits(eng.forward(ids)) - ref).abs().max() < tol * ref.abs().max(), kernel
            kv = S.KVCache(eng.cfg, 1, 12, "cpu", torch.float32)
            eng.forward(ids[:, :9], kv)
            for t in range(9, 12):
                h = eng.forward(ids[:, t:t + 1], kv)
            assert (eng.logits(h[:, -1]) - ref[:, -1]).abs().max() < tol * ref.abs().max(), kernel
            if kernel == "reference":
                for k, tokens in want.items():
                    assert eng.generate(ids[0].tolist(), 4, experts_per_token=k) == tokens, k


def test_budget_counts_only_the_ffns_and_experts_the_model_has(tmp_path, monkeypatch):
    """A fork's config keeps the widths of FFNs its model does not have (expert_ffn when all-dense, dense_ffn when MoE
    from layer 0); the working-memory estimate counted them, and the cache floor asked 2 x top_k experts of a model
    whose one MoE layer has no next layer to guess for: a --ram-budget that works was refused as below the need."""
    monkeypatch.setattr(S, "rss_bytes", lambda: 200 << 20)  # the process's RSS held still: thresholds compare exactly

    def least_budget(path):
        with pytest.raises(S.StreamError) as e:
            S.load(path, ram_budget="64M", kernel="reference")
        return e.value.least_budget, str(e.value)

    ids = list(range(5, 11))
    for name, lean, unused in (("dense", dict(n_dense_layers=4, n_experts=0), dict(expert_ffn=512, n_shared=16)),
                               ("moe0", dict(n_dense_layers=0, n_experts=4), dict(dense_ffn=16384))):
        _, lean_path = random_container(tmp_path, name + "-lean", dict(CFG, **lean))
        _, wide_path = random_container(tmp_path, name + "-wide", dict(CFG, **lean, **unused))
        need, _ = least_budget(wide_path)
        assert need == least_budget(lean_path)[0], name
        # a run at that budget (below the old figure, which counted the unused widths) loads and decodes
        eng = S.load(wide_path, ram_budget=need, kernel="reference")
        assert eng.generate(ids, 2) == S.load(wide_path, kernel="reference").generate(ids, 2), name
    # n_experts=2, top_k=2 in a single MoE layer: its own two picks, not four
    _, path = random_container(tmp_path, "one-moe", dict(CFG, n_dense_layers=3, n_experts=2))
    need, msg = least_budget(path)
    assert ">= 2 experts" in msg
    assert S.load(path, kernel="reference").min_cache == 2 * C.load_container(path).expert_nbytes
    eng = S.load(path, ram_budget=need, kernel="reference")
    assert eng.generate(ids, 2) == S.load(path, kernel="reference").generate(ids, 2)
    _, path = random_container(tmp_path, "two-moe", dict(CFG, n_dense_layers=2, n_experts=2))
    assert ">= 4 experts" in least_budget(path)[1]  # two MoE layers: the next one's guesses too


def test_an_all_dense_container_with_top_k_0_serves_and_scores(tmp_path):
    """An all-dense config may say top_k=0 (nothing is routed: ModelConfig checks top_k only with MoE layers); its
    engine refused every request, generate and loglikelihood, with "--experts-per-token 0", a flag nobody gave."""
    _, path = random_container(tmp_path, "d", dict(CFG, n_dense_layers=4, n_experts=0, top_k=0))
    eng = S.load(path, kernel="reference")
    ids = list(range(5, 17))
    assert eng.generate(ids, 3) == eng.generate(ids, 3, experts_per_token=1)
    assert eng.loglikelihood(ids[:8], ids[8:]) == eng.loglikelihood(ids[:8], ids[8:], experts_per_token=2)


def test_budgeted_greedy_equals_resident_token_for_token(tiny):
    m, path = tiny
    prompt = list(range(5, 25))
    full = S.load(path)
    ref = full.generate(prompt, 16)
    assert full.cache.stats()["capacity_experts"] >= 48  # everything fits: a fully resident run ...
    assert full.preloaded and full.cache.stats()["reads"] == 0  # ... read at load, so decoding reads nothing
    assert S.compute_threads(full) == (os.cpu_count() or 1) and S.compute_threads(full, "3") == 3
    small = S.load(path, prefetch=True, preload=False)
    small.cache.budget = 8 * small.container.expert_nbytes  # 8 of 48 experts (the container has 48), 2 of them guesses
    c, real_get = small.cache, small.cache.get

    def checked_get(key, protect):  # after every lookup: within budget, each key in one place only
        e = real_get(key, protect)
        places = [set(c.entries), set(c.inflight), set(c.guesses)]
        assert c.used <= c.budget and all(not (a & b) for i, a in enumerate(places) for b in places[i + 1:])
        return e

    c.get = checked_get
    assert small.generate(prompt, 16) == ref
    st = small.cache.stats()
    assert st["misses"] > 20 and st["cached_experts"] <= 8 and st["prefetch_reads"] > 0 and st["prefetch_hits"] > 0
    assert small.cache.used <= small.cache.budget
    nopf = S.load(path, prefetch=False, preload=False)
    nopf.cache.budget = 4 * nopf.container.expert_nbytes
    assert S.compute_threads(nopf) == (os.cpu_count() or 1)  # streaming too (buffers are recycled)
    assert nopf.generate(prompt, 16) == ref
    # top-1 serving and sampling run, sampling reproducible with a seed
    assert len(full.generate(prompt, 5, experts_per_token=1)) == 5
    a = full.generate(prompt, 8, temperature=0.9, top_p=0.9, seed=3)
    assert a == full.generate(prompt, 8, temperature=0.9, top_p=0.9, seed=3)


class CudaNamedCpu(str):
    """A device string the engine's CUDA branches take for "cuda" (its .startswith) while torch reads "cpu": drives
    the GPU-only accounting on a machine without one (CI), every tensor on the CPU."""

    def startswith(self, prefix, *a):
        return prefix == "cuda" or str.startswith(self, prefix, *a)

    def __str__(self):
        return self


def test_gpu_expert_cache_leaves_the_kv_reserve_free(tiny, monkeypatch):
    """On CUDA the expert cache is capped by the GPU's free memory (torch.cuda.mem_get_info) less working memory and
    512 MiB; the KV cache for the whole context, allocated on the GPU per request after the cache filled, was not
    taken off: a long --context filled the card with experts and its first long prompt ran out of GPU memory."""
    m, path = tiny
    calls = []
    eng = S.load(path, kernel="reference", preload=False)
    slack = 512 << 20

    def fake_free(free):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append(device) or (free, 80 << 30))

    reserve = eng.kv_bytes + eng.working_bytes + slack
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # model.device_problem's check of a "cuda" device
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    fake_free(reserve + eng.min_cache + 3 * eng.container.expert_nbytes)  # room for fewer experts than the model has
    gpu = S.load(path, kernel="reference", preload=False, device=CudaNamedCpu("cpu"))
    assert calls and str(calls[0]) == "cpu"  # asked about the engine's own device
    assert gpu.min_cache <= gpu.cache.budget < gpu.every_expert_bytes
    assert gpu.cache.budget + gpu.kv_bytes + gpu.working_bytes + slack <= reserve + eng.min_cache + \
        3 * eng.container.expert_nbytes
    ids = [5, 6, 7, 8]
    assert gpu.generate(ids, 3) == eng.generate(ids, 3)  # the rest of the "GPU" engine's path runs as the CPU one
    fake_free(reserve + eng.min_cache - 1)  # one byte short of the smallest cache once the KV reserve is kept
    with pytest.raises(S.StreamError, match=r"free for experts after the resident part; it needs at least .*free GPU"):
        S.load(path, kernel="reference", preload=False, device=CudaNamedCpu("cpu"))


def test_budgeted_hidden_states_equal_resident_bit_for_bit(tiny, monkeypatch):
    """Under a budget a layer computes its cached experts while the missing ones are read, then sums every expert in
    the fixed order: the hidden states equal fully resident ones exactly, step by step (not only the argmax)."""
    m, path = tiny
    if kernels.native_int4() is None:
        pytest.fail("int4_cpu.cpp did not build: install g++ and ninja (pip install -r requirements.txt)")
    calls, real = {"mix_outputs": 0}, kernels.native_int4()

    class Counting:  # counts the native ops StreamedMoE calls
        def __getattr__(self, name):
            op = getattr(real, name)
            if name in calls:
                def counted(*a):
                    calls[name] += 1
                    return op(*a)
                return counted
            return op

    full, small = S.load(path), S.load(path, preload=False)
    small.cache.budget = 6 * small.container.expert_nbytes  # 6 of 48 experts
    monkeypatch.setattr(kernels, "NATIVE", Counting())
    ids = torch.randint(1, 300, (1, 24), generator=torch.Generator().manual_seed(5))
    kv_full, kv_small = (S.KVCache(e.cfg, 1, 24, "cpu", torch.float32) for e in (full, small))
    assert torch.equal(full.forward(ids[:, :8], kv_full), small.forward(ids[:, :8], kv_small))
    for t in range(8, 24):
        assert torch.equal(full.forward(ids[:, t:t + 1], kv_full), small.forward(ids[:, t:t + 1], kv_small)), t
    st = small.cache.stats()
    assert calls["mix_outputs"] > 0 and st["hits"] > 0 and st["misses"] > 0  # the mixed path ran


def test_tied_int4_embeddings_under_every_cpu_kernel(tmp_path):
    """A tied int4 embedding table is read as the container stores it by the embedding and multiplied by the
    lm_head: --kernel int4pack repacks the lm_head's copy (on AVX-512 torch packs differently), never the bytes the
    embedding reads. Every kernel gives the reference's embeddings exactly and its logits within int4 kernel error."""
    torch.manual_seed(0)
    m = Picaflor(ModelConfig(**dict(CFG, tie_embeddings=True)))
    ck = save_checkpoint(m, str(tmp_path / "run"), 1)
    path = str(tmp_path / "tied4.pcf4")
    C.write_container(ck, path, group_size=32, embed_bits=4, progress=False)
    ids = torch.tensor([[5, 7, 9, 11, 200]])
    ref = S.load(path, kernel="reference")
    assert ref.container.header["tensors"]["embed_tokens.weight"]["kind"] == "int4"
    with torch.no_grad():
        want_emb, want = ref.model.embed_tokens(ids), ref.logits(ref.forward(ids))
        for kernel in ("native", "int4pack"):
            eng = S.load(path, kernel=kernel)
            assert torch.equal(eng.model.embed_tokens(ids), want_emb), kernel
            assert (eng.logits(eng.forward(ids)) - want).abs().max() < 2e-2 * want.abs().max(), kernel


def test_partial_preload_fills_the_cache_evenly(tiny):
    m, path = tiny
    ref = S.load(path).generate(list(range(5, 25)), 8)
    eng = S.load(path, preload=False)
    eng.cache.budget = 7 * eng.container.expert_nbytes  # 7 of 48 experts: 2 per MoE layer (3 layers) fit evenly
    eng.preload_experts(partial=True)
    layers = sorted(k[0] for k in eng.cache.entries)
    assert layers == [1, 1, 2, 2, 3, 3] and eng.preloaded_experts == 6 and not eng.preloaded
    assert eng.cache.stats()["reads"] == 0  # counters start after the preload
    assert eng.generate(list(range(5, 25)), 8) == ref and eng.cache.used <= eng.cache.budget


def test_evicted_buffers_are_recycled_unless_held(tiny):
    m, path = tiny
    eng = S.load(path, prefetch=False, preload=False)
    cache = eng.cache
    cache.budget = 2 * eng.container.expert_nbytes
    a = cache.get((1, 0), set())
    a_buf, a_bytes = a.buf, bytes(a.buf)
    del a
    cache.get((1, 1), set())
    b = cache.get((1, 2), set())  # evicts (1, 0), whose buffer nobody holds: the read goes into it
    assert b.buf is a_buf and bytes(b.buf) != a_bytes and len(cache.free_bufs) == 0
    held = cache.get((1, 3), set())  # evicts (1, 1)
    held_bytes = bytes(held.buf)
    cache.get((1, 4), set())  # evicts (1, 2)
    cache.get((1, 5), set())  # evicts `held`, which the caller still holds: not reused, its bytes stay intact
    assert bytes(held.buf) == held_bytes and held.buf is not cache.entries[(1, 5)].buf
    assert cache.used <= cache.budget
    # the blob read into a recycled buffer is the right one (crc checked) and decodes to the same weights
    fresh = S.Expert(eng.container, eng.container.read_expert_blob(1, 2), "reference")
    x = torch.randn(1, eng.cfg.d_model)
    assert torch.equal(S.Expert(eng.container, b.buf, "reference")(x), fresh(x))


def test_buffers_let_go_after_leaving_the_cache_give_their_memory_back(tiny):
    """An expert evicted while a caller holds it leaves the cache's count; once the caller lets go, its buffer's
    pages go back to the system (read as zeros) and the slot serves a later read, so rounds of held-and-released
    experts do not grow the process past its budget (the chunks' slots were touched anew each round)."""
    m, path = tiny
    eng = S.load(path, prefetch=False, preload=False)
    cache, blobs = eng.cache, eng.cache.blob_buffers
    cache.budget = 2 * cache.nbytes
    cache.get((1, 0), set())
    cache.get((1, 1), set())
    for rnd in range(3):
        held = cache.get((2, rnd), set())
        addr, slot_id = ctypes.addressof(held.buf), id(held.buf)  # a slot is a ctypes array
        cache.get((3, 2 * rnd), set())
        cache.get((3, 2 * rnd + 1), set())  # evicts `held`: its buffer leaves the cache, still the caller's
        assert slot_id in cache.orphans and any(cache_bytes_at(addr, cache.nbytes))
        cache.request([(1, 0)], set())
        assert slot_id in cache.orphans  # still held: its bytes stay
        del held
        cache.request([(1, 0)], set())  # let go: the next request gives its pages back
        assert not cache.orphans and not any(cache_bytes_at(addr, cache.nbytes)), rnd  # zeros: the pages went back
    assert len(blobs.slots) - len(blobs.fresh) <= 4 and cache.used <= cache.budget


def test_a_buffers_views_serve_its_next_blobs_unless_held(tiny):
    m, path = tiny
    eng = S.load(path, prefetch=False, preload=False)
    cache, c = eng.cache, eng.container
    assert cache.reuse_views
    cache.budget = 2 * c.expert_nbytes
    x = torch.randn(1, eng.cfg.d_model)
    fresh = (lambda key: S.Expert(c, c.read_expert_blob(*key), eng.kernel)(x))  # noqa: E731  (its own views)
    a = cache.get((1, 0), set())
    a_views = [id(t) for t in a.tensors]
    del a
    cache.get((1, 1), set())
    b = cache.get((1, 2), set())  # into (1, 0)'s buffer, over the same view tensors, which now show the new blob
    assert [id(t) for t in b.tensors] == a_views and len(cache.views_of_buf) == 2
    assert torch.equal(b(x), fresh((1, 2))) and not torch.equal(b(x), fresh((1, 0)))
    del b
    # whatever a caller keeps of an expert keeps its buffer: the expert, its kernel arguments, a slice of a tensor
    for keep in (lambda e: e, lambda e: e.mix_args, lambda e: e.tensors[0][:8]):
        kept = keep(cache.get((1, 3), set()))
        held = cache.entries[(1, 3)].tensors[0]
        held_bytes, held_ptr = bytes(held.numpy()), held.data_ptr()
        del held
        cache.get((1, 4), set())
        cache.get((1, 5), set())  # evicts (1, 3): its buffer is not read into again
        cache.get((1, 6), set())
        assert all(t.data_ptr() != held_ptr for e in cache.entries.values() for t in e.tensors)
        assert torch.equal(torch.frombuffer(bytearray(held_bytes), dtype=torch.uint8),
                           torch.frombuffer(cache_bytes_at(held_ptr, len(held_bytes)), dtype=torch.uint8))
        assert cache.used <= cache.budget and len(cache.views_of_buf) <= 2
        del kept
    # off, every miss decodes its own views (the A/B's baseline), and recycling still works
    cache.reuse_views, cache.views_of_buf = False, {}
    e7 = cache.get((1, 7), set())
    assert not cache.views_of_buf and torch.equal(e7(x), fresh((1, 7)))


def test_int4pack_experts_reuse_their_buffers_views(tiny):
    """--kernel int4pack made fresh tensor views for every miss (the other CPU kernels reuse a buffer's views): their
    small long-lived allocations among the forward's big freed temporaries kept glibc's heap from shrinking, and a
    group-16 container ran 50-85 MiB of anonymous memory above the reference kernel at the same budget. Its repack
    is in place over the buffer, redone for each blob read into it, so the views serve it as they are."""
    m, path = tiny
    eng = S.load(path, kernel="int4pack", prefetch=False, preload=False)
    cache, c = eng.cache, eng.container
    assert cache.reuse_views
    cache.budget = 2 * c.expert_nbytes
    x = torch.randn(1, eng.cfg.d_model)
    for e in range(5):  # each after the second is read into a recycled buffer and repacked there, over its views
        got = cache.get((1, e), set())(x)
        assert torch.equal(got, S.Expert(c, c.read_expert_blob(1, e), "int4pack")(x)), e
    assert len(cache.views_of_buf) == 2 and cache.used <= cache.budget


def test_a_failed_read_takes_its_buffers_views_along(tiny, tmp_path):
    """A read that fails (a bad blob, Ctrl-C while waiting) drops its buffer from the cache: its views must not
    keep it alive outside the budget's count (one 3.5 MB buffer per failure, for the rest of a chat session)."""
    m, path = tiny
    flip = copy_with_flipped_bits(path, tmp_path, [(1, e, 100, 0x01) for e in range(2, 8)])  # layer 1's 2..7 corrupt
    eng = S.load(str(flip), prefetch=False, preload=False)
    cache = eng.cache
    cache.budget = 2 * cache.nbytes
    cache.get((1, 0), set())
    cache.get((1, 1), set())
    for e in range(2, 8):  # each evicts a good expert and reads into its recycled buffer, then fails
        with pytest.raises(C.ContainerError, match=f"layer 1 expert {e}"):
            cache.get((1, e), set())
    assert len(cache.views_of_buf) * cache.nbytes <= cache.used <= cache.budget
    assert cache.get((2, 0), set()) is not None and cache.used <= cache.budget  # and the cache still works


def copy_with_flipped_bits(path, tmp_path, flips):
    """A copy of the container at path with bits flipped: flips = [(layer, expert, byte in its blob, xor mask)]."""
    import shutil
    cont = C.load_container(path)
    flip = tmp_path / "flip.pcf4"
    shutil.copy(path, flip)
    with open(flip, "r+b") as f:
        for layer, e, at, mask in flips:
            off = cont.header["experts"][str(layer)][e]["offset"] + at
            f.seek(off)
            byte = f.read(1)[0]
            f.seek(off)
            f.write(bytes([byte ^ mask]))
    return flip


def cache_bytes_at(ptr, n):
    """n bytes at address ptr (memory a test knows is still mapped)."""
    import ctypes
    return bytearray(ctypes.string_at(ptr, n))


def test_hit_rate_and_bytes_agree_with_independent_count(tiny):
    m, path = tiny
    eng = S.load(path, prefetch=False, preload=False, cache_policy="lru")
    cap = 7
    eng.cache.budget = cap * eng.container.expert_nbytes
    eng.generate([3, 4], 2)
    assert eng.cache.trace == []  # off unless asked for: it would grow by every lookup
    eng.cache.record_trace = True
    eng.cache.reset_counters()
    rb0, rc0 = S.io_counters()
    eng.generate(list(range(3, 13)), 16)
    rb1, rc1 = S.io_counters()
    st = eng.cache.stats()
    # replay the demanded (layer, expert) trace through an independent LRU of the same capacity
    lru, misses = OrderedDict(), 0
    for key in eng.cache.trace:
        if key in lru:
            lru.move_to_end(key)
        else:
            misses += 1
            lru[key] = True
            if len(lru) > cap:
                lru.popitem(last=False)
    assert st["lookups"] == len(eng.cache.trace)
    assert st["misses"] == misses and st["hits"] == len(eng.cache.trace) - misses
    assert st["bytes_read"] == misses * eng.container.expert_nbytes
    # the kernel's own count of bytes this process read: at least the expert bytes (rchar counts every read)
    assert rc1 - rc0 >= st["bytes_read"]
    if eng.container.direct_fd is not None:  # O_DIRECT reads bypass the page cache: storage saw them all
        assert rb1 - rb0 >= st["bytes_read"]


def test_score_policy_agrees_with_independent_replay(tiny):
    """Policy "score" (the default) from a cache filled at load, prefill included: the engine's misses, lookups and
    final cached set equal bench/cache_replay.py's replay of the router's selection keys (which starts unseen
    layers at -inf and breaks equal scores by age), and the keys it was fed are the ones that chose the experts."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from cache_replay import replay  # it judges policies in the README: it must count as the engine
    m, path = tiny
    for cap, prompt in ((7, [3, 4, 5]), (9, [9, 2, 7, 1]), (13, [5, 5, 6, 30, 2, 8])):
        eng = S.load(path, prefetch=False, preload=False)
        assert eng.cache.policy == "score"
        c = eng.cache
        c.budget = cap * eng.container.expert_nbytes
        eng.preload_experts(partial=True)
        layers = [moe.layer for moe in eng.moes]
        start = EC.partial_preload_keys(layers, eng.cfg.n_experts, cap)
        assert list(c.entries) == start
        c.record_trace = True
        c.reset_counters()
        eng.generate(prompt, 17)
        assert len(c.observed) == 17 * len(layers) and c.misses > 0
        starts = [i for i, _, _ in c.observed] + [len(c.trace)]
        for n, (i, layer, s) in enumerate(c.observed):  # each pass demanded only its layer's experts
            window = c.trace[i:starts[n + 1]]
            assert all(layer == k[0] for k in window)
            if n >= len(layers):  # decode: one token, exactly its top-k keys
                assert sorted(e for _, e in window) == sorted(sorted(range(len(s)), key=lambda e: -s[e])[:eng.cfg.top_k])
        misses, lookups, final = replay("score", start, {}, c.observed, c.trace, cap)
        assert (c.misses, c.lookups) == (misses, lookups) and set(c.entries) == final, cap
        lru = replay("lru", start, {}, c.observed, c.trace, cap)
        assert lru[2] != final  # the policies keep different experts
        # belady (the reference) misses least; counting from a later lookup counts fewer
        assert replay("belady", start, {}, c.observed, c.trace, cap)[0] <= misses
        assert replay("score", [], {}, c.observed, c.trace, cap, count_from=10)[1] == lookups - 10
    with pytest.raises(ValueError, match="needs more experts"):  # a pass wider than the cache: said, not a crash
        replay("score", [], {}, [(0, 1, [0.0] * 16)], [(1, 0), (1, 1), (1, 2)], 2)


def test_decode_step_equals_the_modules(tiny):
    """Engine._decode_step (a decode token's layers as one loop over the native ops) gives the hidden states of
    the module path (Block, NativeAttention, QLinear, ...) bit for bit, and leaves the same KV cache, fully resident
    and under a budget that misses; prefill and a full cache take the module path."""
    m, path = tiny
    ids = torch.randint(1, 300, (1, 20), generator=torch.Generator().manual_seed(9))
    for preload in ("auto", False):
        eng = S.load(path, preload=preload)
        assert eng.decode_plan is not None and len(eng.decode_plan) == eng.cfg.n_layer
        if preload is False:
            eng.cache.budget = 6 * eng.container.expert_nbytes
        plan, step, taken = eng.decode_plan, eng._decode_step, []
        eng._decode_step = lambda *a: taken.append(1) or step(*a)
        kv = [S.KVCache(eng.cfg, 1, 20, "cpu", torch.float32) for _ in range(2)]
        for side in range(2):
            eng.decode_plan = plan if side == 0 else None
            eng.forward(ids[:, :8], kv[side])
        for t in range(8, 20):
            outs = []
            for side in range(2):
                eng.decode_plan = plan if side == 0 else None
                outs.append(eng.forward(ids[:, t:t + 1], kv[side]))
            assert torch.equal(outs[0], outs[1]), t
        assert all(torch.equal(a, b) for a, b in zip(kv[0].k + kv[0].v, kv[1].k + kv[1].v))
        assert len(taken) == 12  # every decode token with the plan, none in prefill
        eng.decode_plan = plan
        calls = []
        eng._decode_step = lambda *a: calls.append(1)  # not taken: 2 tokens, or no room left in the cache
        eng.forward(ids[:, :2], S.KVCache(eng.cfg, 1, 4, "cpu", torch.float32))
        assert not calls
    other = S.load(path, kernel="int4pack") if kernels.cpu_int4pack_ok() else None
    assert other is None or other.decode_plan is None  # other kernels: the modules


def test_native_score_bookkeeping_equals_numpy():
    """int4_cpu.cpp's observe_scores / score_victim (policy "score" in decode) equal the numpy versions bit for bit:
    the decayed average rounded as numpy rounds it (no fused multiply-add), the victim with the same tie-break."""
    op = kernels.native_int4()
    assert op is not None, "int4_cpu.cpp did not build (see the warning above)"
    gen = torch.Generator().manual_seed(0)
    row, want = torch.full((64,), -float("inf"), dtype=torch.float64), None
    for step in range(40):
        keys = torch.rand(1, 64, generator=gen) * 2 - 0.5
        s = keys[0].double().numpy()
        want = s.copy() if want is None else want * EC.SCORE_DECAY + (1.0 - EC.SCORE_DECAY) * s
        op.observe_scores(row, keys, EC.SCORE_DECAY, step == 0)
        assert np.array_equal(row.numpy(), want), step
    cache = EC.ExpertCache.__new__(EC.ExpertCache)
    for trial in range(200):
        L, E = 3, 8
        cache.score_tab = np.round(torch.rand(L, E, generator=gen).double().numpy() * 4) / 4  # many equal scores
        cache.score_tab[trial % L] = -np.inf  # a layer not routed yet
        cache.stamp = torch.randperm(L * E, generator=gen).reshape(L, E).numpy().astype(np.int64)
        cache.stamp[torch.rand(L, E, generator=gen).numpy() < 0.4] = -1  # not cached
        cache.score_t, cache.stamp_t = torch.from_numpy(cache.score_tab), torch.from_numpy(cache.stamp)
        cached = list(zip(*np.nonzero(cache.stamp >= 0)))
        protect = {(int(a), int(b)) for a, b in cached[:trial % 5]}
        cache.score_ops, cache.native_score = op, True
        got = cache._score_victim(protect)
        assert got == cache._score_victim_numpy(protect), trial
        if len(protect) == len(cached):
            assert got is None


def test_score_victim_with_nan_scores_and_reads_that_cannot_start(tiny):
    """A NaN router score (a router fed a NaN) crashed the numpy victim search (argmin of nothing); it counts as the
    lowest, as the native search has it. A read that cannot start gives its buffer back (it leaked, outside the
    budget's count); a miss keeps the caller's other experts of the pass; the API checks n_readers itself."""
    cache = EC.ExpertCache.__new__(EC.ExpertCache)
    cache.score_tab = np.array([[0.5, np.nan, 0.2], [np.nan, 0.1, 0.3]])
    cache.stamp = np.array([[3, 1, 2], [4, 5, 6]], dtype=np.int64)
    assert cache._score_victim_numpy(set()) == (0, 1)  # NaNs first, the older of them
    assert cache._score_victim_numpy({(0, 1)}) == (1, 0)
    assert cache._score_victim_numpy({(0, 1), (1, 0)}) == (1, 1)
    op = kernels.native_int4()
    if op is not None:
        cache.score_t, cache.stamp_t = torch.from_numpy(cache.score_tab), torch.from_numpy(cache.stamp)
        cache.score_ops, cache.native_score = op, True
        for protect in (set(), {(0, 1)}, {(0, 1), (1, 0)}):
            assert cache._score_victim(protect) == cache._score_victim_numpy(protect), protect
    m, path = tiny
    eng = S.load(path, prefetch=False, preload=False, cache_policy="lru")
    c = eng.cache
    c.budget = 2 * eng.container.expert_nbytes
    c.get((1, 0), {(1, 0), (1, 1)})
    c.get((1, 1), {(1, 0), (1, 1)})
    c.get((1, 2), {(1, 0), (1, 2)})  # LRU's victim is (1, 0), which the caller still uses: (1, 1) goes
    assert set(c.entries) == {(1, 0), (1, 2)}
    real, started = c._read, []

    def refused(key, buf, guess=False):
        started.append(buf)
        raise OSError(24, "Too many open files")
    c._read = refused
    n_free, reads = len(c.free_bufs), c.reads
    with pytest.raises(OSError):
        c.get((1, 3), {(1, 3)})
    assert c.free_bufs[-1] is started[0] and len(c.free_bufs) == n_free + 1 and c.reads == reads
    assert c.used <= c.budget
    c._read = real
    x = torch.randn(1, eng.cfg.d_model)
    cont = C.load_container(path)
    assert torch.equal(c.get((1, 3), {(1, 3)})(x), S.Expert(cont, cont.read_expert_blob(1, 3), eng.kernel)(x))
    assert c.free_bufs == [] and c.used <= c.budget
    for bad in (0, 65, "4"):
        with pytest.raises(S.StreamError, match="1 to 64 expert reader threads"):
            S.load(path, n_readers=bad)


def test_a_read_in_flight_at_exit_ends_quietly(tiny, tmp_path):
    """A read still in flight when the interpreter exits is waited for by the atexit hook; the NativeRead's own
    __del__ then found a dropped ticket (and module globals gone): 'Exception ignored' tracebacks at every exit.
    Asked for after the hook, it is a one-line error, not a hang or a wrong status."""
    m, path = tiny
    script = tmp_path / "exit_mid_read.py"
    script.write_text(f"""
import mmap, sys
sys.path.insert(0, {ROOT!r})
import container as C, expert_cache as EC, kernels
ops = kernels.native_reader()
assert ops is not None
cont = C.load_container({str(path)!r})
ops.reader_delay_us(0, 300_000)
held = [EC.NativeRead(cont, (1, k), mmap.mmap(-1, cont.expert_nbytes), 0, 4, ops) for k in range(3)]
EC._wait_reads_in_flight()
try:
    held[0].result()
except C.ContainerError as e:
    print("ERR", e)
held.append(EC.NativeRead(cont, (2, 0), mmap.mmap(-1, cont.expert_nbytes), 0, 4, ops))
print("exiting")
""")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ended at interpreter exit" in r.stdout and "layer 1 expert 0" in r.stdout and "exiting" in r.stdout
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_decode_profile_script(tiny, tmp_path, monkeypatch, capsys):
    """bench/decode_profile.py runs on a container and splits a token's time into its parts (the per-op lines sum
    to no more than the token); a missing container is one line and a non-zero exit."""
    m, path = tiny
    script = os.path.join(ROOT, "bench", "decode_profile.py")
    r = subprocess.run([sys.executable, script, path, "--ram-budget", "4G", "--tokens", "6", "--threads", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    head = r.stdout.splitlines()[0]
    token_ms = float(head.split(" ms a token")[0].split(", ")[-1])
    parts = {m_[1]: float(m_[2]) for m_ in (re.match(r"  (\S.*?)\s+([\d.]+) ms/token", line)
                                            for line in r.stdout.splitlines()[1:5])}
    assert set(parts) == {"waiting for reads", "int4_cpu.cpp ops", "cache bookkeeping", "everything else"}, parts
    assert parts["int4_cpu.cpp ops"] > 0 and 0 <= parts["waiting for reads"] <= token_ms
    # the token is printed to 0.1 ms (+-0.05) and each part to 0.01 (+-0.005): 0.05 alone flaked at 1.35 vs 1.3
    assert sum(parts.values()) == pytest.approx(token_ms, abs=0.05 + 4 * 0.005 + 1e-9)
    assert "swiglu_mix" in r.stdout and "attn_block" in r.stdout
    decode_profile = bench_script("decode_profile")
    assert "no such container" in refusal(decode_profile, [tmp_path / "nope.pcf4", "--ram-budget", "1G"], monkeypatch,
                                          capsys)


def bench_script(name):
    """bench/NAME.py as a module: its main() run here, where torch is imported already (a subprocess spends ~2 s
    importing it only to refuse its arguments)."""
    import importlib.util
    from unittest import mock
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ):  # (token_ab's OMP_WAIT_POLICY, set at import, reached every later subprocess)
        spec.loader.exec_module(mod)
    return mod


def refusal(mod, args, monkeypatch, capsys):
    """mod.main() on these arguments: the message it exits with (a non-zero exit), after checking it is one line and
    all that was printed to stderr."""
    monkeypatch.setattr(sys, "argv", [mod.__file__, *map(str, args)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as ei, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")  # what the script's own process would print: a second line of its stderr
        for quiet in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", quiet)  # (Python's defaults)
        mod.main()
    msg = ei.value.code
    assert isinstance(msg, str) and "\n" not in msg.strip() and not capsys.readouterr().err, msg  # str: exit 1
    assert not warned, [str(w.message) for w in warned]
    return msg


def test_token_ab_script(tiny, tmp_path, monkeypatch, capsys):
    """bench/token_ab.py alternates a cache setting every decode token: each value gets its share of the tokens
    (the first value of each prompt rotates); a malformed --set is one line and a non-zero exit."""
    m, path = tiny
    script = os.path.join(ROOT, "bench", "token_ab.py")
    r = subprocess.run([sys.executable, script, path, "--ram-budget", "4G", "--set", "n_parts=1,2,3", "--prompts", "2",
                        "--tokens", "7"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    counts = {int(v): int(n) for v, n in re.findall(r"n_parts=(\d): (\d+) tokens", r.stdout)}
    assert counts == {1: 4, 2: 4, 3: 4}, r.stdout  # 2 prompts x 6 tokens over 3 values
    r = subprocess.run([sys.executable, script, path, "--ram-budget", "4G", "--set", "prefetch=0,1", "--prompts", "1",
                        "--tokens", "5"], capture_output=True, text=True, timeout=300)  # an engine setting
    assert r.returncode == 0 and re.search(r"prefetch=False: 2 tokens.*guesses 0\.00 a token", r.stdout), r.stdout
    assert "prefetch=True: 2 tokens" in r.stdout, r.stdout
    token_ab = bench_script("token_ab")
    for args, msg in ((["--set", "n_parts=4"], "at least two values"),
                      (["--set", "n_parts=1,2", "--prompts", "1", "--tokens", "2"], "one decode token per value"),
                      # 2 x 2 tokens but the values cycle from each prompt's index: n_parts=4 got none (a traceback)
                      (["--set", "n_parts=1,2,3,4", "--prompts", "2", "--tokens", "3"], "--prompts + --tokens >= 6")):
        assert msg in refusal(token_ab, [path, "--ram-budget", "4G", *args], monkeypatch, capsys)
    assert token_ab.parse_set("native_reads=1,0") == ("native_reads", [True, False])
    assert token_ab.parse_set("prefetch=0,true") == ("prefetch", [False, True])
    for bad, msg in (("budget=1,2", "NAME one of"), ("n_parts=a,b", "positive int"), ("n_parts=0,2", "positive int"),
                     ("native_reads=maybe,1", "0/1/true/false"), ("n_parts", "NAME=V1,V2")):
        with pytest.raises(SystemExit, match=msg):
            token_ab.parse_set(bad)


def bench_main(mod, args, monkeypatch):
    """mod.main() on these arguments, in this process."""
    monkeypatch.setattr(sys, "argv", [mod.__file__, *map(str, args)])
    mod.main()


def test_prefetch_ab_script_smoke(tiny, tmp_path, monkeypatch, capsys):
    """bench/prefetch_ab.py runs off / on / auto on one engine to its medians (its 4 s interference phase cut short);
    nothing in CI ran it, so a renamed engine attribute would have surfaced only on the next measuring session."""
    prefetch_ab = bench_script("prefetch_ab")
    interference = prefetch_ab.interference
    monkeypatch.setattr(prefetch_ab, "interference", lambda path, n: interference(path, n, secs=0.02))
    out = tmp_path / "ab.json"
    bench_main(prefetch_ab, [tiny[1], "--ram-budget", "4G", "--reps", "1", "--tokens", "3", "--threads", "1",
                             "--json", out], monkeypatch)
    res = json.loads(out.read_text())
    assert {len(runs) for runs in res["runs"].values()} == {1} and res["median_tok_s_prefetch_auto"] > 0, res
    assert res["interference"]["gemv_alone_gb_s"] > 0 and "median decode tok/s at 4G" in capsys.readouterr().out


def test_prefill_chunk_script_smoke(tiny, tmp_path, monkeypatch):
    """bench/prefill_chunk.py times a prompt's prefill at each chunk size to its medians (unrun by CI before)."""
    prefill_chunk = bench_script("prefill_chunk")
    out = tmp_path / "chunks.json"
    bench_main(prefill_chunk, [tiny[1], "--ram-budget", "4G", "--chunks", "4,16", "--prompt-tokens", "16", "--reps",
                               "1", "--threads", "1", "--json", out], monkeypatch)
    res = json.loads(out.read_text())
    assert res["median_prefill_tok_s_chunk_4"] > 0 and res["median_prefill_tok_s_chunk_16"] > 0, res


def test_int4_gemv_script_smoke(tmp_path, monkeypatch):
    """bench/int4_gemv.py times every native loop this CPU has (and torch's packed kernels) on int4 and int8 rows
    (unrun by CI before); a shape of the smallest sizes its options allow."""
    int4_gemv = bench_script("int4_gemv")
    out = tmp_path / "gemv.json"
    bench_main(int4_gemv, ["--shape", "64x128", "--mb", "1", "--threads", "1", "--int8-shape", "64x128", "--reps",
                           "1", "--json", out], monkeypatch)
    res = json.loads(out.read_text())
    assert res["rows"] and all(r["cold_gb_s"] > 0 for r in res["rows"]) and res["int8_rows"], res


def test_train_step_script_takes_tokens_with_quick(monkeypatch, capsys):
    """bench/train_step.py --quick --tokens N timed 512 tokens (--quick's), silently; --rounds already won over it.
    The timing itself (transformers at nano width, minutes) is stubbed out: what is checked is what it is asked."""
    train_step = bench_script("train_step")
    asked = []

    class Asked(Exception):
        pass

    def moe_layer(tokens, rounds, warmup, hf_variants):
        asked.append((tokens, rounds))
        raise Asked  # (stop here: the rest times the 4-layer model)
    monkeypatch.setattr(train_step, "bench_moe_layer", moe_layer)
    monkeypatch.setattr(train_step, "matmul_peak_gflops", lambda: 1.0)
    for args in (["--quick", "--tokens", "64"], ["--quick"], ["--tokens", "96", "--rounds", "3"]):
        with pytest.raises(Asked):
            bench_main(train_step, ["--no-malloc-tune", *args], monkeypatch)
    assert asked == [(64, 2), (512, 2), (96, 3)], asked
    assert "--tokens: at least 1" in refusal_of_argparse(train_step, ["--tokens", "0"], monkeypatch, capsys)


def refusal_of_argparse(mod, args, monkeypatch, capsys):
    """The error line argparse exits with (exit status 2) when mod.main() is given these arguments."""
    monkeypatch.setattr(sys, "argv", [mod.__file__, *map(str, args)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as ei:
        mod.main()
    assert ei.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_cache_replay_cli_bad_input(tmp_path, monkeypatch, capsys):
    """bench/cache_replay.py: a missing container or a malformed list is one line and a non-zero exit (the script
    itself once, the rest its main() here)."""
    script = os.path.join(ROOT, "bench", "cache_replay.py")
    r = subprocess.run([sys.executable, script, str(tmp_path / "nope.pcf4")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no such container" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    cache_replay = bench_script("cache_replay")
    for args, msg in (([tmp_path, "--capacities", "3,x"], "comma-separated numbers"),
                      ([tmp_path, "--decays", "1.5"], "--decays in [0, 1)")):
        assert msg in refusal(cache_replay, args, monkeypatch, capsys)


def test_route_guess_names_the_next_layers_picks(tmp_path, monkeypatch, capsys):
    """bench/route_guess.py: where nothing changes the hidden state between two MoE layers (attention and experts
    write zeros, norms alike) the next router on this layer's input names every pick; a router whose bias favours
    two experts makes them the popular guess; a config file measures its random model alone."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import route_guess
    torch.manual_seed(0)
    m = Picaflor(ModelConfig(**dict(CFG, n_layer=3, n_dense_layers=1))).eval()
    windows = torch.randint(1, CFG["vocab_size"], (2, 16))
    mixed = route_guess.measure(m, windows, batch_size=2)["1->2"]
    with torch.no_grad():
        for blk in m.layers[1:]:
            blk.self_attn.o_proj.weight.zero_()
            blk.mlp.experts.down_proj.zero_()
            blk.mlp.shared_experts.down_proj.weight.zero_()
        m.layers[2].mlp.e_score_correction_bias[[3, 5]] = 10.0
    r = route_guess.measure(m, windows, batch_size=2)["1->2"]
    assert r["moe_input_top_k"] == 1.0 and r["residual_top_k"] == 1.0 and r["popular_top_k"] == 1.0, r
    assert mixed["moe_input_top_k"] < 1.0 and mixed["moe_input_top_k"] <= mixed["moe_input_top_2k"], mixed
    assert route_guess.recall(torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1, 4], [5, 6]])) == 0.25
    cfg_file = tmp_path / "cfg.py"
    cfg_file.write_text("".join(f"{k} = {v!r}\n" for k, v in CFG.items()))
    save_checkpoint(m, str(tmp_path / "run"), 1)
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "route_guess.py"), str(src), "--tokens", "64",
                               "--seq-len", "16"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for src in (cfg_file, tmp_path / "run")]  # both at once: two single-threaded children, two cores
    (out_cfg, err_cfg), (out_run, err_run) = (p.communicate(timeout=120) for p in procs)
    assert procs[0].returncode == 0 and "random init" in out_cfg and "trained" not in out_cfg, out_cfg + err_cfg
    assert procs[1].returncode == 0 and "trained" in out_run and "random init" in out_run, out_run + err_run
    weights = next((tmp_path / "run").glob("step_*/model.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    (tmp_path / "bad.py").write_text("n_layer = 'x'\n")
    for source, msg in ((tmp_path / "nope", "no such checkpoint or config"), (tmp_path / "run", "no valid checkpoint"),
                        (tmp_path / "bad.py", "bad.py")):
        assert msg in refusal(route_guess, [source], monkeypatch, capsys)


def test_prefetch_oracle_refuses_runs_that_leave_a_variant_without_a_token(tiny, monkeypatch, capsys):
    """bench/prefetch_oracle.py: prompt r's tokens cycle the variants from variant r, so 2 prompts x 4 tokens reach 6
    of off + 2 x 3 guessed ones; the 7th got none and the summary died on an empty mean."""
    prefetch_oracle = bench_script("prefetch_oracle")
    args = [tiny[1], "--ram-budget", "4G", "--right", "1.0,0.8,0.6", "--prompts", "2", "--tokens", "5"]
    assert "--prompts + --tokens >= 9" in refusal(prefetch_oracle, args, monkeypatch, capsys)


def test_prefetch_oracle_guesses_from_the_recorded_future(tiny):
    """bench/prefetch_oracle.py: guesses taken from a first pass's routing, all right, leave only the first MoE
    layer of a token to miss (fewer misses than off or all wrong); off, nothing is guessed; the engine is as it was
    after (the run itself checks that both passes decoded the same tokens)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import prefetch_oracle
    m, path = tiny
    eng = S.load(path, preload=False)
    eng.cache.budget = 16 * eng.cache.nbytes  # 16 of 48 experts: misses in every layer
    variants = [None, (1, 1.0), (1, 0.0)]
    lat, miss, wait, guessed = prefetch_oracle.run(eng, variants, prompts=3, tokens=10)
    assert [len(lat[v]) for v in range(3)] == [9, 9, 9]
    assert sum(guessed[0]) == 0 and sum(guessed[1]) > 0 and sum(guessed[2]) > 0, guessed
    top_k = eng.cfg.top_k
    assert max(miss[1]) <= top_k and statistics.mean(miss[1]) < min(statistics.mean(miss[0]),
                                                                     statistics.mean(miss[2])), miss
    assert not eng.moes[0].prefetch and "guess_next" not in vars(eng.moes[0]) and eng.cache.n_slots == 0


def guess_model_container(tmp_path, name, o_proj_scale=None):
    """A tiny container whose guesses are all right (attention and experts after the first MoE layer write
    zeros: the hidden state the next router sees is the one this layer's guess used), or with o_proj_scale
    {layer: factor}: attention that outweighs the residual there, so guesses across it are mostly wrong."""
    torch.manual_seed(1)
    m = Picaflor(ModelConfig(**CFG)).eval()
    with torch.no_grad():
        for blk in m.layers[1:]:
            blk.self_attn.o_proj.weight.zero_()
            blk.mlp.experts.down_proj.zero_()
            blk.mlp.shared_experts.down_proj.weight.zero_()
        for layer, factor in (o_proj_scale or {}).items():
            m.layers[layer].self_attn.o_proj.weight.normal_(0, 0.02 * factor)
    path = str(tmp_path / f"{name}.pcf4")
    C.write_container(save_checkpoint(m, str(tmp_path / name), 1), path, group_size=32, progress=False)
    return path


def test_prefetch_auto_reads_ahead_only_while_guesses_are_right(tmp_path, monkeypatch):
    """--prefetch auto: off at first, a few tokens name guesses without reading them; where they name the picks
    it turns prefetch on (reads ahead), and off again when they fall below the bar; where they miss it stays off,
    probing less often. The output never changes; a model that is all resident is never judged."""
    monkeypatch.setattr(S, "PREFETCH_JUDGE_PICKS", 16)  # 4 picks a token here (two guessed layers, top-2)
    prompt = list(range(5, 15))
    good = guess_model_container(tmp_path, "good")
    ref = S.load(good, preload=False).generate(prompt, 40)
    eng = S.load(good, prefetch="auto", preload=False)
    eng.cache.budget = 8 * eng.cache.nbytes  # 8 of 48 experts: streaming
    assert not eng.moes[0].prefetch and eng.prefetch_mode == "auto"
    assert eng.generate(prompt, 40) == ref
    assert eng.prefetch_verdicts[0] == (1.0, True) and eng.moes[0].prefetch and eng.cache.n_slots > 0
    assert eng.cache.prefetch_reads > 0 and eng.guess_tally[0] == eng.guess_tally[1] > 0
    assert not any(moe.shadow_guess for moe in eng.moes)  # probes end with the request
    monkeypatch.setattr(S, "PREFETCH_OFF_RIGHT", 1.01)  # no guess is right enough now: off again
    assert eng.generate(prompt, 12) == ref[:12]
    assert eng.prefetch_verdicts[-1] == (1.0, False) and not eng.moes[0].prefetch and eng.cache.n_slots == 0

    bad = guess_model_container(tmp_path, "bad", {2: 50.0, 3: 2500.0})
    ref = S.load(bad, preload=False).generate(prompt, 60)
    eng = S.load(bad, prefetch="auto", preload=False)
    eng.cache.budget = 8 * eng.cache.nbytes
    assert eng.generate(prompt, 60) == ref
    rates = [r for r, on in eng.prefetch_verdicts]
    assert len(rates) >= 2 and max(rates) < S.PREFETCH_OFF_RIGHT and not any(on for _, on in eng.prefetch_verdicts)
    assert eng.cache.prefetch_reads == 0 and not eng.moes[0].prefetch and eng.prefetch_probe_every > 2
    named = eng.guess_tally[0]  # requests shorter than the probe interval still probe: it counts the engine's tokens
    for _ in range(2 * eng.prefetch_probe_every):
        eng.generate(prompt, 3)
    assert eng.guess_tally[0] > named
    import chat  # chat.py's loop over the engine judges its decode tokens too
    b = chat.engine_backend(eng)
    kv, tokens = b["new_cache"](32), eng.decode_tokens
    b["forward"](torch.tensor([prompt]), kv)  # the prompt's pass: not a decode token
    for t in range(3):
        b["forward"](torch.tensor([[7 + t]]), kv)
    assert eng.decode_tokens == tokens + 3
    b["after_reply"]()
    assert not any(moe.shadow_guess or moe.guessed for moe in eng.moes)
    res = B.run_bench(eng, n_prompt=6, n_new=20)  # the benchmark says what auto decided and how right guesses were
    assert res["prefetch"] == "auto" and res["prefetch_on_at_end"] is False and res["guess_right_rate"] < 0.72
    assert "auto: off at the end (guesses" in B.prefetch_summary(res)

    full = S.load(good, prefetch="auto")  # every expert resident: nothing to read ahead, nothing guessed
    full.generate(prompt, 20)
    assert full.preloaded and full.guess_tally == [0, 0] and not full.prefetch_verdicts
    with pytest.raises(S.StreamError, match="prefetch 'sometimes': use one of off, on, auto"):
        S.load(good, prefetch="sometimes")
    for flags in (["--prefetch", "auto"], ["--prefetch"]):  # alone: on, as the flag was before auto
        assert S.main([good, "--prompt", "1,2,3", "--max-new-tokens", "2", "--ram-budget", "2G", *flags]) == 0


def test_int4_prefetch_bench_runs_the_real_loop():
    """bench/int4_prefetch.py builds int4_loops.h's VNNI loop at each L2 prefetch distance and times them with a
    plain read (or says in one line that this CPU lacks the loop); a malformed shape is one line and a non-zero exit."""
    script = os.path.join(ROOT, "bench", "int4_prefetch.py")
    r = subprocess.run([sys.executable, script, "--shapes", "512x512", "--rounds", "1", "--mb", "8"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    if r.returncode != 0:
        assert "needs AVX-512 VNNI" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    else:
        rates = dict(re.findall(r"^  (L1 1 KB only|\+ L2 8 KB|plain read)\s+([\d.]+)", r.stdout, re.M))
        assert len(rates) == 3 and all(float(v) > 0 for v in rates.values()), r.stdout
    r = subprocess.run([sys.executable, script, "--shapes", "100x128"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "multiple of 32" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_guesses_replace_guesses_never_cached_experts(tiny):
    """Prefetch reads go into their own buffers: once those exist, a wrong guess only ever replaces an older guess
    that landed, so the cache keeps every expert it had; a right guess joins the cache when demanded."""
    m, path = tiny
    eng = S.load(path, prefetch=False, preload=False)
    c = eng.cache
    c.budget = 8 * c.nbytes
    c.set_slots(2)
    cached = [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5)]
    for key in cached:
        c.get(key, {key})
    c.guess([(2, 0), (2, 1)], set())  # two slots: fit without evicting (6 + 2 = 8)
    c.settle()  # landed, never demanded
    assert list(c.entries) == cached and list(c.guesses) == [(2, 0), (2, 1)] and c.used <= c.budget
    c.guess([(3, 0), (3, 1)], set())  # wrong guesses make way for new ones; the cache is untouched
    c.settle()
    assert list(c.entries) == cached and list(c.guesses) == [(3, 0), (3, 1)] and c.prefetch_reads == 4
    hit = c.get((3, 1), {(3, 1)})  # right: it joins the cache, its read counted as a prefetch hit, not a miss
    assert (3, 1) in c.entries and (3, 1) not in c.guesses and c.prefetch_hits == 1 and c.misses == 6
    x = torch.randn(1, eng.cfg.d_model)  # the guessed blob is the right one (crc checked) and computes the same
    fresh = S.Expert(eng.container, eng.container.read_expert_blob(3, 1), eng.kernel)
    assert torch.equal(hit(x), fresh(x)) and c.used <= c.budget
    c.guess([(2, 5)], set())  # the slot the right guess took is made again: the normal cost of one more expert
    assert (1, 0) not in c.entries and len(c.entries) == 6 and c.used <= c.budget
    c.set_slots(0)  # prefetch off: guess buffers go back to the cache
    assert not c.guesses and not c.slot_bufs and c.used <= c.budget


def test_guesses_in_flight_and_failed_guesses(tiny):
    """A demand for a guess still being read waits for it (a prefetch hit, the right bytes); new guesses are
    skipped while every guess is in flight (nothing waits, nothing is evicted); a failed read of a guess nobody
    asks for is no error (settle, prefetch off), one that is asked for raises."""
    import threading
    import time
    m, path = tiny
    eng = S.load(path, prefetch=False, preload=False)
    c = eng.cache
    c.native_reads = False  # the Python readers, whose reads this test can slow down and break per expert
    c.budget = 8 * c.nbytes
    c.set_slots(2)
    gate, read = threading.Event(), c.c.read_expert_part

    def slow_or_broken(layer, e, *a):
        if (layer, e) == (3, 9):
            raise C.ContainerError("injected read error")
        if layer == 2:
            gate.wait(30)
        return read(layer, e, *a)

    c.c.read_expert_part = slow_or_broken
    c.guess([(2, 0), (2, 1)], set())
    c.guess([(3, 0)], set())  # both guess buffers are being read into: skipped
    assert list(c.guesses) == [(2, 0), (2, 1)] and c.prefetch_reads == 2 and not c.entries
    t0 = time.perf_counter()
    c.get((1, 5), {(1, 5)})  # a demand read while both guesses hang: guesses have their own readers
    assert time.perf_counter() - t0 < 10 and list(c.entries) == [(1, 5)] and not gate.is_set()
    threading.Timer(0.2, gate.set).start()
    got = c.get((2, 0), {(2, 0)})  # waits for the guess's read
    x = torch.randn(1, eng.cfg.d_model)
    assert torch.equal(got(x), S.Expert(eng.container, eng.container.read_expert_blob(2, 0), eng.kernel)(x))
    assert c.prefetch_hits == 1 and c.misses == 1 and c.reads == 3
    c.guess([(3, 9)], set())  # a wrong guess whose read fails
    c.settle()
    c.set_slots(0)  # prefetch off: quiet too, and every guess buffer goes back to the cache
    assert not c.guesses and c.n_slots == 0 and c.used <= c.budget
    c.set_slots(2)
    c.guess([(3, 9)], set())
    with pytest.raises(C.ContainerError, match="injected read error"):
        c.get((3, 9), {(3, 9)})  # asked for: its read's error
    assert c.used <= c.budget


@pytest.mark.parametrize("native", [True, False])
def test_a_guess_whose_crc_fails_is_no_prefetch_hit_and_stays_out(tiny, tmp_path, native):
    """A guess read whose blob fails its crc raises when demanded (as an on-demand read does) and was counted as a
    prefetch hit; it never joins the cache, and asked for again it is read and refused again."""
    m, path = tiny
    flip = copy_with_flipped_bits(path, tmp_path, [(2, 5, 100, 0x01)])
    eng = S.load(str(flip), prefetch=False, preload=False)
    c = eng.cache
    c.native_reads = native and c.native_reads
    c.budget = 8 * c.nbytes
    c.set_slots(2)
    c.guess([(2, 5), (2, 6)], set())
    c.settle()  # both landed; (2, 5)'s with its crc error
    with pytest.raises(C.ContainerError, match="checksum mismatch in layer 2 expert 5"):
        c.get((2, 5), {(2, 5)})
    assert c.prefetch_hits == 0 and c.misses == 1 and (2, 5) not in c.entries and (2, 5) not in c.c.verified
    c.get((2, 6), {(2, 6)})  # the good guess: a prefetch hit
    assert c.prefetch_hits == 1 and (2, 6) in c.entries
    with pytest.raises(C.ContainerError, match="checksum mismatch in layer 2 expert 5"):
        c.get((2, 5), {(2, 5)})  # on demand now: read again, refused again
    assert c.misses == 2 and c.lookups == c.hits + c.prefetch_hits + c.misses and c.used <= c.budget
    assert list(c.entries) == [(2, 6)]


@pytest.mark.parametrize("native", [True, False])
def test_disk_busy_time_counts_overlapping_reads_once(tiny, native):
    """disk_busy_s (the bench's rate of decode's own reads) is the time at least one read ran, not their sum, on
    expert_reader.cpp's threads and on the Python ones."""
    import time
    m, path = tiny
    eng = S.load(path, prefetch=False, preload=False)
    c, read = eng.cache, eng.cache.c.read_expert_part
    assert c.native_reads, "expert_reader.cpp did not build: install g++ and ninja"
    c.native_reads = native

    def slow(layer, e, *a):
        time.sleep(0.2)
        return read(layer, e, *a)

    c.c.read_expert_part = slow
    kernels.native_reader().reader_delay_us(0, 200_000)  # the same slow disk for the native readers (demand pool)
    busy0 = c.disk_busy_s
    try:
        c.request([(1, 0), (1, 1)], set())  # two blobs' parts on the 4 reader threads, in waves of 4
        c.settle()
    finally:
        kernels.native_reader().reader_delay_us(0, 0)
    step = -(-c.nbytes // c.n_parts // C.ALIGN) * C.ALIGN
    waves = -(-2 * len(range(0, c.nbytes, step)) // 4)
    assert 0.2 * waves <= c.disk_busy_s - busy0 < 0.2 * waves + 0.15 and c.active_reads == 0


def test_native_reads_land_checked_bytes_and_fail_loudly(tiny, tmp_path):
    """expert_reader.cpp: its crc32 is zlib's at any length; the cache's reads on its threads land the bytes
    Container.read_expert_blob reads; a flipped byte is a one-line checksum error naming the expert on its first
    read, a file cut short after opening a short-read error, a file rewritten in place a one-line error on a
    re-read; a demand read never queues behind a slow guess (its own pool); a read nobody waits for holds its
    buffer until it lands; a refused O_DIRECT read falls back to buffered ones."""
    import shutil
    import time
    import zlib
    m, path = tiny
    ops = kernels.native_reader()
    assert ops is not None, "expert_reader.cpp did not build: install g++ and ninja"
    gen = torch.Generator().manual_seed(0)
    for n in (0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 255, 256, 257, 511, 512, 1000, 4096, 4099, 65537):
        b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        for start in (0, 0xDEADBEEF):
            assert ops.crc32(b, start) == zlib.crc32(b.numpy().tobytes(), start), n
    cont = C.load_container(path)
    flip = copy_with_flipped_bits(path, tmp_path, [(2, 5, 777, 0x10)])
    eng = S.load(str(flip), prefetch=False, preload=False)
    c = eng.cache
    assert c.native_reads
    x = torch.randn(1, eng.cfg.d_model, generator=gen)
    got = c.get((2, 4), {(2, 4)})  # a neighbour is fine, and the same expert as a plain read gives
    assert torch.equal(got(x), S.Expert(cont, cont.read_expert_blob(2, 4), eng.kernel)(x))
    with pytest.raises(C.ContainerError, match="checksum mismatch in layer 2 expert 5") as ei:
        c.get((2, 5), {(2, 5)})
    assert str(flip) in str(ei.value) and "\n" not in str(ei.value)
    # a slow guess (pool 1) holds up no demand read (pool 0); asked for, the guess is waited for
    c.set_slots(2)
    ops.reader_delay_us(1, 1_000_000)
    try:
        c.guess([(3, 0)], set())
        t0 = time.perf_counter()
        c.get((1, 5), {(1, 5)})
        assert time.perf_counter() - t0 < 0.8
        got = c.get((3, 0), {(3, 0)})
        assert c.prefetch_hits == 1 and torch.equal(got(x), S.Expert(cont, cont.read_expert_blob(3, 0), eng.kernel)(x))
    finally:
        ops.reader_delay_us(1, 0)
    # rewritten in place after the first read: a re-read of that expert is an error, not other bytes
    c.set_slots(0)
    c._evict((1, 5))
    os.utime(flip, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(C.ContainerError, match="changed on disk"):
        c.get((1, 5), {(1, 5)})
    # a read nobody waits for keeps its buffer alive until it lands (the readers write into it), then lets go
    import mmap
    import weakref
    ops.reader_delay_us(0, 300_000)
    try:
        buf = mmap.mmap(-1, cont.expert_nbytes)
        r, gone = EC.NativeRead(cont, (1, 7), buf, 0, 4, ops), weakref.ref(buf)
        del buf
        t0 = time.perf_counter()
        del r  # its __del__ waits for the readers
        assert time.perf_counter() - t0 > 0.2 and gone() is None and not EC._READS_IN_FLIGHT
        buf = mmap.mmap(-1, cont.expert_nbytes)
        lost = EC.NativeRead(cont, (1, 8), buf, 0, 4, ops)
        lost.__dict__.clear()  # as if lost to an exception: only exit can wait
        del lost
        assert len(EC._READS_IN_FLIGHT) == 1
        EC._wait_reads_in_flight()  # what atexit runs
        assert not EC._READS_IN_FLIGHT and bytes(buf) == bytes(cont.read_expert_blob(1, 8))
    finally:
        ops.reader_delay_us(0, 0)
    # an O_DIRECT read failing with EIO (a bad sector) is that read's error, and O_DIRECT stays on (it went off for
    # good on any error: the page cache then held what was read, outside --ram-budget)
    import errno
    direct = cont.direct_fd = os.open(path, os.O_RDONLY)  # (stands in for an O_DIRECT descriptor)
    buf = mmap.mmap(-1, cont.expert_nbytes)
    ops.reader_fail_direct(errno.EIO)
    with pytest.raises(C.ContainerError, match="read error at offset .*Input/output error; check the disk"):
        EC.NativeRead(cont, (3, 3), buf, 0, 1, ops).result()
    assert cont.direct_fd == direct
    # O_DIRECT refused (EINVAL: a filesystem that opens it but cannot do it): the part is read buffered, and from
    # then on every read is (as Container._pread does)
    ops.reader_fail_direct(errno.EINVAL)
    EC.NativeRead(cont, (3, 3), buf, 0, 1, ops).result()
    assert cont.direct_fd is None and bytes(buf) == bytes(cont.read_expert_blob(3, 3))
    assert cont.retired_fds[-1] == direct  # kept open (a reader may still use it), closed with the container
    os.fstat(direct)
    cont.close()
    with pytest.raises(OSError):
        os.fstat(direct)
    cont = C.load_container(path)
    real_preadv, fail = os.preadv, []  # the same two rules on the Python readers' path

    def preadv(fd, bufs, offset):
        if fail and fd == cont.direct_fd:
            raise OSError(fail.pop(), os.strerror(errno.EIO))
        return real_preadv(fd, bufs, offset)
    C.os.preadv = preadv
    try:
        cont.direct_fd = direct = os.open(path, os.O_RDONLY)
        fail.append(errno.EIO)
        with pytest.raises(C.ContainerError, match="read error at offset"):
            cont.read_expert_blob(3, 3)
        assert cont.direct_fd == direct
        fail.append(errno.EINVAL)
        assert bytes(cont.read_expert_blob(3, 3)) == bytes(buf) and cont.direct_fd is None
    finally:
        C.os.preadv = real_preadv
    cont = C.load_container(path)
    # cut short after opening: the last expert's read comes back short
    cut = tmp_path / "cut.pcf4"
    shutil.copy(path, cut)
    eng = S.load(str(cut), prefetch=False, preload=False)
    last = max((int(layer), e, ent["offset"]) for layer, ents in cont.header["experts"].items()
               for e, ent in enumerate(ents))
    os.truncate(cut, last[2] + cont.expert_nbytes // 2)
    with pytest.raises(C.ContainerError,
                       match=f"short read .* truncated: re-export or re-copy it "
                             f"\\(layer {last[0]} expert {last[1]}\\)"):
        eng.cache.get(last[:2], {last[:2]})


def test_loglikelihood(tiny):
    m, path = tiny
    eng = S.load(path, kernel="reference")
    ctx, cont = [5, 6, 7, 8], [9, 10, 11]
    ll, greedy = eng.loglikelihood(ctx, cont)
    logits = eng.logits(eng.forward(torch.tensor([ctx + cont])))[0]
    lp = torch.log_softmax(logits, -1)
    want = sum(float(lp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
    assert abs(ll - want) < 1e-4 and ll < 0
    g = eng.generate(ctx, 3)
    assert eng.loglikelihood(ctx, g)[1] is True
    whole, _ = eng.loglikelihood(ctx + cont)
    assert whole < ll
    assert eng.loglikelihood_batch([(ctx, cont)])[0][0] == pytest.approx(ll)
    # a malformed request was a bare unpacking error, or a StreamError naming none, after the ones before it ran
    for bad, words in ((5, "request 1 is int 5, not a \\(context_ids, continuation_ids\\) pair"),
                       ((ctx, cont, cont), "request 1 is tuple"), ("ab", "request 1 is str 'ab'"),
                       ((ctx, []), "request 1: loglikelihood needs a non-empty context and continuation"),
                       ((ctx, "9"), "request 1: loglikelihood: lists of token ids"),
                       (([1.5], cont), "request 1: loglikelihood: lists of token ids"),
                       ((ctx, [10 ** 6]), "request 1: .*token id 1000000 outside vocab")):
        with pytest.raises(S.StreamError, match=f"^loglikelihood_batch: {words}"):
            eng.loglikelihood_batch([(ctx, cont), bad])
    with pytest.raises(S.StreamError, match="a list of \\(context_ids, continuation_ids\\) pairs"):
        eng.loglikelihood_batch(None)
    # a request of context + 1 tokens fits (eval.py truncates to that): the last token is a target, never run
    small = S.load(path, kernel="reference", context=6)
    assert small.loglikelihood(ctx, cont)[0] == pytest.approx(ll, abs=1e-4)
    with pytest.raises(S.StreamError, match="7 tokens exceed the reserved context 6"):
        small.loglikelihood([5, 6, 7, 8], [9, 10, 11, 12])


def test_embedding_rows_read_on_demand(tiny, tmp_path):
    """Untied int8 embeddings stay on disk (rows read on lookup, the table left out of the resident bytes); int4
    embedding blocks and tied tables stay resident. A corrupt table fails at load, naming the tensor."""
    m, path = tiny
    c = C.load_container(path)
    eng = S.load(path)
    assert isinstance(eng.model.embed_tokens, S.DiskEmbedding) and eng.embed_on_disk
    embed = c.header["tensors"]["embed_tokens.weight"]
    assert eng.resident_bytes == c.resident_bytes() - embed["nbytes"]
    ids = torch.tensor([[0, 5, 299, 5]])
    table = c.tensor("embed_tokens.weight")
    assert torch.equal(eng.model.embed_tokens(ids), table[ids])
    with pytest.raises(S.StreamError, match="outside"):
        eng.model.embed_tokens(torch.tensor([[300]]))
    # a flipped byte in the table: the piecewise check at load finds it
    data = bytearray(open(path, "rb").read())
    data[embed["offset"] + 100] ^= 1
    bad = tmp_path / "bad_embed.pcf4"
    bad.write_bytes(bytes(data))
    with pytest.raises(S.StreamError, match="checksum mismatch in tensor embed_tokens.weight"):
        S.load(str(bad))
    # int4 embeddings (--embed-bits 4) and a tied lm_head: the table stays resident, the same outputs as before
    for over, out in (({"embed_bits": 4}, "e4.pcf4"), ({}, "tied.pcf4")):
        torch.manual_seed(0)
        mt = Picaflor(ModelConfig(**CFG, tie_embeddings=not over))
        ck = save_checkpoint(mt, str(tmp_path / ("run_" + out)), 1)
        C.write_container(ck, str(tmp_path / out), group_size=32, progress=False, **over)
        e = S.load(str(tmp_path / out))
        assert isinstance(e.model.embed_tokens, kernels.QEmbedding) and not e.embed_on_disk
        ref = C.load_container(str(tmp_path / out)).tensor("embed_tokens.weight")
        assert (e.model.embed_tokens(ids) - ref[ids]).abs().max() < 1e-6


def test_prefill_in_chunks_equals_one_pass(tiny):
    """A long prompt goes through in prefill_chunk-token passes over one KV cache, and loglikelihood computes its
    logit rows LOGIT_CHUNK at a time: both give what one pass gives."""
    m, path = tiny
    one = S.load(path, prefill_chunk=256)
    many = S.load(path, prefill_chunk=7)
    assert many.working_bytes < one.working_bytes  # the budget reserves one chunk's activations
    ids = torch.randint(1, 300, (1, 100), generator=torch.Generator().manual_seed(2))
    h1, h7 = one.forward(ids), many.forward(ids)
    assert h7.shape == h1.shape == (1, 100, CFG["d_model"])
    assert (h7 - h1).abs().max() < 1e-4 * h1.abs().max()
    ctx, cont = ids[0, :3].tolist(), ids[0, 3:].tolist()  # 97 continuation tokens: two logit chunks
    assert len(cont) > S.LOGIT_CHUNK
    (ll1, g1), (ll7, g7) = one.loglikelihood(ctx, cont), many.loglikelihood(ctx, cont)
    assert ll7 == pytest.approx(ll1, rel=1e-4) and g1 == g7
    assert one.generate(ctx + cont[:20], 4) == many.generate(ctx + cont[:20], 4)
    with pytest.raises(S.StreamError, match="prefill_chunk"):
        S.load(path, prefill_chunk=0)



def test_forward_refuses_what_does_not_fit_before_running_anything(tiny):
    """Engine.forward into a KV cache without room for the whole input ran the prefill chunks that fit, then raised
    a bare ValueError with the cache advanced past half the input (a retry then ran on that half-prompt); without a
    cache it ran inputs longer than the reserved context (model.py refuses them), past the positions trained on."""
    m, path = tiny
    eng = S.load(path, prefill_chunk=7)
    ids = torch.randint(1, 300, (1, 30), generator=torch.Generator().manual_seed(3))
    kv = S.KVCache(eng.cfg, 1, 20, "cpu", torch.float32)
    with pytest.raises(S.StreamError, match="30 tokens.*0 of 20"):
        eng.forward(ids, kv)
    assert kv.pos == 0  # nothing ran: the cache is as it was
    h = eng.forward(ids[:, :20], kv)  # and takes what fits, as a fresh cache would
    assert torch.equal(h, eng.forward(ids[:, :20], S.KVCache(eng.cfg, 1, 20, "cpu", torch.float32)))
    with pytest.raises(S.StreamError, match="1 tokens.*20 of 20"):
        eng.forward(ids[:, :1], kv)
    too_long = torch.randint(1, 300, (1, CFG["max_seq_len"] + 1))
    with pytest.raises(S.StreamError, match=f"context {CFG['max_seq_len']}"):
        eng.forward(too_long)
    assert eng.forward(too_long[:, 1:]).shape == (1, CFG["max_seq_len"], CFG["d_model"])

ODD_SHAPES = [((1, 64), (32, 64), 32), ((3, 100), (40, 100), 32), ((16, 48), (33, 48), 16), ((5, 256), (96, 256), 128),
              ((17, 70), (64, 70), 64)]
# the native kernel takes rows of x 4 at a time and reads any group size: M = 1..9 and groups the int4pack kernel lacks
NATIVE_SHAPES = ODD_SHAPES + [((2, 200), (70, 200), 64), ((4, 96), (32, 96), 48), ((6, 33), (31, 33), 32),
                              ((9, 130), (65, 130), 128), ((7, 512), (256, 512), 256), ((2, 90), (32, 90), 30),
                              ((3, 60), (40, 60), 20), ((5, 9), (33, 9), 12), ((6, 40), (64, 40), 8),
                              ((1, 3), (1, 3), 4)]  # K below one group, G % 8 != 0, G = 4, one row


def int4_case(xs, ws, g):
    """Random x (xs) and W (ws) quantized at group g: x, packed, sz and the reference x @ W^T."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(xs, generator=gen), torch.randn(ws, generator=gen)
    p, sz = C.quantize_int4(w, g)
    return x, p, sz, kernels.int4_matmul_reference(x, p, sz, ws, g)


@pytest.mark.parametrize("xs,ws,g", NATIVE_SHAPES)
def test_native_int4_kernel_equals_reference(xs, ws, g):
    x, p, sz, ref = int4_case(xs, ws, g)
    op = kernels.native_int4()
    assert op is not None, "int4_cpu.cpp did not build (see the warning above)"
    # the portable path multiplies fp32 activations: equal to the reference up to summation order
    got = op.int4_mm_generic(x, p, sz, ws[0], g)
    assert got.shape == ref.shape and (got - ref).abs().max() < 1e-5 * ref.abs().max()
    # the default path (int8 activations per group on AVX2, else the portable one) equals the reference applied to
    # x as it quantizes it, and stays within int8 rounding of the exact result
    xq = q8_activations(x, g) if int8_loops(op) and g % 4 == 0 else x
    want = kernels.int4_matmul_reference(xq, p, sz, ws, g)
    for got in (op.int4_mm(x, p, sz, ws[0], g), op.int4_mm(torch.cat([x, x], 1)[:, :ws[1]], p, sz, ws[0], g),
                op.int4_mm(x.view(1, *xs), p, sz, ws[0], g)[0],  # non-contiguous and 3-D inputs
                op.int4_mm(torch.cat([x.new_full((3,), 1e30), x.flatten()])[3:].view(xs), p, sz, ws[0], g)):  # offset
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert (got - want).abs().max() < 1e-5 * ref.abs().max()
        assert (got - ref).norm() < 2e-2 * ref.norm()
    # AVX-512 CPUs run the integer loop 512 bits wide (G % 8 == 0), VNNI ones as vpermb + vpdpbusd (G % 4 == 0):
    # the same integer sums, so bit for bit the AVX2 loop's result and the 512-bit one's
    assert torch.equal(op.int4_mm(x, p, sz, ws[0], g), op.int4_mm_avx2(x, p, sz, ws[0], g))
    assert torch.equal(op.int4_mm(x, p, sz, ws[0], g), op.int4_mm_avx512bw(x, p, sz, ws[0], g))
    got = op.int4_mm(x.to(torch.bfloat16), p, sz, ws[0], g)  # bf16 in: the same as its fp32 value
    xb = x.to(torch.bfloat16).float()
    xbq = q8_activations(xb, g) if int8_loops(op) and g % 4 == 0 else xb
    assert (got - kernels.int4_matmul_reference(xbq, p, sz, ws, g)).abs().max() < 1e-5 * ref.abs().max()


def int8_loops(op):
    """Whether the native kernel multiplies int8 activations here (AVX2, AArch64 dot products) or fp32 ones."""
    return op.has_avx2() or op.has_sdot()


def q8_activations(x, g):
    """x as int4_cpu.cpp's AVX2 path sees it: per row and group of g columns, round(x * 127 / max|x|) * max|x| / 127."""
    M, K = x.shape
    Kp = -(-K // g) * g
    xg = torch.nn.functional.pad(x, (0, Kp - K)).view(M, Kp // g, g)
    amax = xg.abs().amax(-1, keepdim=True)
    # 127 / amax in one rounding as the kernel's 127.0f / amax (127.0 / t is 127 * (1 / t): a .5 tie rounded apart)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    return (torch.round(xg * inv) * (amax / 127.0)).view(M, Kp)[:, :K]


def test_native_int8_kernel_equals_reference():
    gen = torch.Generator().manual_seed(0)
    op = kernels.native_int4()
    # K not a multiple of 32 or 8: tails; 96 and 160: an odd number of 32-column blocks
    for M, N, K in ((1, 300, 64), (3, 70, 37), (6, 129, 200), (2, 33, 20), (1, 64, 96), (5, 50, 160)):
        x = torch.randn(M, K, generator=gen)
        x[0, :32] *= 0  # an all-zero block of activations
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
        scale = torch.rand(N, generator=gen) * 0.01
        ref = (x @ q.float().t()) * scale
        # the portable path multiplies fp32 activations: equal to the reference up to summation order
        got = op.int8_mm_generic(x, q, scale)
        assert got.shape == (M, N) and (got - ref).abs().max() < 1e-5 * ref.abs().max()
        # on AVX2, x is quantized per whole block of 32 columns to int8 (the tail stays fp32): equal to the reference
        # applied to x as it quantizes it, and within int8 rounding of the exact result
        whole = K // 32 * 32
        xq = torch.cat([q8_activations(x[:, :whole], 32), x[:, whole:]], 1) if int8_loops(op) else x
        want = (xq.double() @ q.double().t() * scale.double()).float()
        for got in (op.int8_mm(x, q, scale), op.int8_mm(x.view(1, M, K), q, scale)[0]):
            assert got.shape == (M, N) and (got - want).abs().max() < 1e-5 * ref.abs().max()
            assert (got - ref).norm() < 2e-2 * ref.norm()
        # AVX-512 VNNI CPUs take two blocks a step (vpdpbusd), fixed up in block order: bit for bit the AVX2 loop
        assert torch.equal(op.int8_mm(x, q, scale), op.int8_mm_avx2(x, q, scale))
    with pytest.raises(RuntimeError, match="columns"):
        op.int8_mm(torch.randn(1, 10), q, scale)
    nan_in = torch.randn(1, 64, generator=gen)
    nan_in[0, 40] = float("nan")
    assert torch.isnan(op.int8_mm(nan_in, torch.ones(3, 64, dtype=torch.int8), torch.ones(3))).all()
    # K = 0 is a sum of nothing (it returned uninitialised memory)
    assert torch.equal(op.int8_mm(torch.randn(2, 0), torch.zeros(3, 0, dtype=torch.int8), torch.ones(3)),
                       torch.zeros(2, 3))
    # a group whose largest value is below 127 / FLT_MAX: 127 / amax was inf (an undefined float-to-int cast; the
    # int4 result came out 1e7 times too large, sign flipped): such a group is read as zeros
    x = torch.zeros(1, 5)
    x[0, 4] = 1e-37
    w = torch.randn(32, 5, generator=gen)
    p, sz = C.quantize_int4(w, 4)
    ref = x @ C.dequantize_int4(p, sz, w.shape, 4).t()
    got = op.int4_mm(x, p, sz, 32, 4)
    assert got.abs().max() <= ref.abs().max() * 1.01 + 1e-45, (got, ref)


def test_native_kernels_same_on_any_thread_count():
    """The GEMVs hand their row blocks out in chunks from a shared counter (a preempted thread's share goes to the
    others): whichever thread takes a block, the result is the one-thread result, bit for bit, also with a thread
    count that leaves a short last chunk."""
    op = kernels.native_int4()
    gen = torch.Generator().manual_seed(3)
    x4, w4 = torch.randn(3, 256, generator=gen), torch.randn(37 * 32 - 5, 256, generator=gen)  # 37 blocks, a tail
    p, sz = C.quantize_int4(w4, 64)
    x8, q8 = torch.randn(2, 96, generator=gen), torch.randint(-127, 128, (1001, 96), dtype=torch.int8, generator=gen)
    s8 = torch.rand(1001, generator=gen)
    runs = {}
    before = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs[n] = (op.int4_mm(x4, p, sz, w4.shape[0], 64), op.int8_mm(x8, q8, s8))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for n in (2, 3) for a, b in zip(runs[1], runs[n]))


def test_native_decode_helpers_equal_model_py():
    """int4_cpu.cpp's one-call decode helpers against the model.py modules they stand in for."""
    import model as M
    op = kernels.native_int4()
    gen = torch.Generator().manual_seed(0)
    # RMSNorm, on a width that leaves a tail after the 16-wide vector loop
    norm = M.RMSNorm(40, 1e-6)
    norm.weight.data = torch.randn(40, generator=gen)
    x = torch.randn(3, 5, 40, generator=gen)
    with torch.no_grad():
        assert (op.rms_norm(x, norm.weight, 1e-6) - norm(x)).abs().max() < 1e-5
    # the router: same experts and weights as model.Router (top-2 of 16, bias only selects)
    cfg = M.ModelConfig(**dict(CFG, d_model=40, n_head=5, n_kv_head=1))
    router = M.Router(cfg)
    router.weight.data = torch.randn(16, 40, generator=gen) * 0.3
    bias = torch.randn(16, generator=gen) * 0.1
    xr = torch.randn(7, 40, generator=gen)
    with torch.no_grad():
        w_ref, i_ref = router(xr, bias, 2, 1.5)
    w, i, keys = op.route(xr, router.weight, bias, 2, 1.5)
    assert torch.allclose(keys, torch.sigmoid(xr @ router.weight.t()) + bias, atol=1e-6)  # the selection keys
    order_ref, order = i_ref.sort(-1), i.sort(-1)
    assert torch.equal(order_ref.values, order.values)
    assert (w.gather(1, order.indices) - w_ref.gather(1, order_ref.indices)).abs().max() < 1e-6
    # a router large enough to score its experts on 2 threads: the same result as on one, bit for bit
    big_w, big_b, big_x = torch.randn(64, 1100, generator=gen) * 0.1, torch.randn(64, generator=gen) * 0.1, torch.randn(2, 1100, generator=gen)
    one = op.route(big_x, big_w, big_b, 2, 1.0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = op.route(big_x, big_w, big_b, 2, 1.0)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    scores = torch.sigmoid(big_x @ big_w.t())
    assert torch.equal(one[1].sort(-1).values, torch.topk(scores + big_b, 2).indices.sort(-1).values)
    # one decode step of attention: QK norms, RoPE, cache write, 5 query heads on 1 kv head, head_dim 8
    attn = M.Attention(cfg, 0)
    for prm in attn.parameters():
        prm.data = torch.randn(prm.shape, generator=gen) * 0.3
    cache = M.KVCache(cfg, 1, 12, "cpu", torch.float32)
    hd = cfg.head_dim
    xs = torch.randn(1, 7, 40, generator=gen)
    with torch.no_grad():
        cos, sin = M.rope_cos_sin(torch.arange(7), hd, cfg.rope_theta, torch.float32)
        want = attn(xs, cos, sin)[:, -1:]  # no cache: the full causal forward's last position
        attn(xs[:, :6], cos[:6], sin[:6], cache)
        cache.pos = 6
        qkv = torch.cat([attn.q_proj(xs[:, 6:]), attn.k_proj(xs[:, 6:]), attn.v_proj(xs[:, 6:])], -1)
        y = op.attn_decode(qkv, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos[6:], sin[6:],
                           cache.k[0], cache.v[0], 6, cfg.n_head, cfg.n_kv_head)
        assert (attn.o_proj(y) - want).abs().max() < 1e-5 * want.abs().max() + 1e-6
    with pytest.raises(RuntimeError, match="KV cache full"):
        op.attn_decode(qkv, attn.q_norm.weight, attn.k_norm.weight, 1e-6, cos[6:], sin[6:], cache.k[0], cache.v[0],
                       12, cfg.n_head, cfg.n_kv_head)
    # SwiGLU FFNs on int4 weights, alone and mixed (shared with weight 1, then weighted routed experts)
    ffns = []
    for width in (24, 16, 16):
        gu = C.quantize_int4(torch.randn(2 * width, 40, generator=gen), 8)
        dn = C.quantize_int4(torch.randn(40, width, generator=gen), 8)
        ffns.append((gu, dn, width))
    xf = torch.randn(1, 40, generator=gen)

    def ref_ffn(gu, dn, width):
        g, u = kernels.int4_matmul_reference(q8_activations(xf, 8), *gu, (2 * width, 40), 8).chunk(2, -1)
        return kernels.int4_matmul_reference(q8_activations(torch.nn.functional.silu(g) * u, 8), *dn, (40, width), 8)
    want = ref_ffn(*ffns[0]) + 0.7 * ref_ffn(*ffns[1]) + 0.2 * ref_ffn(*ffns[2])
    got = op.swiglu_ffn(xf, *ffns[0][0], 48, 8, *ffns[0][1], 40, 8)  # the shared expert alone, then mixed into
    op.swiglu_mix(xf, got, [f[0][0] for f in ffns[1:]], [f[0][1] for f in ffns[1:]], [f[1][0] for f in ffns[1:]],
                  [f[1][1] for f in ffns[1:]], [2 * f[2] for f in ffns[1:]], [8, 8], [0.7, 0.2])
    if int8_loops(op):
        assert (got - want).abs().max() < 1e-4 * want.abs().max()
    assert (got - want).norm() < 3e-2 * want.norm()


def test_moe_layer_in_one_call_equals_one_call_per_expert(tiny):
    """swiglu_mix runs every expert's gate|up projection in one parallel region and every down projection in one
    (int4_run: the blocks of all the matrices as one work list): each expert's output is swiglu_ffn's bit for bit,
    also with widths, group sizes and thread counts that split the list mid-matrix; so a decode layer with every
    expert cached (shared + routed in one call) gives the tokens the one with its shared expert apart gives."""
    op = kernels.native_int4()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1, 96, generator=gen)
    ffns = []
    for width, g in ((160, 32), (64, 32), (96, 48), (32, 32)):
        gu, dn = torch.randn(2 * width, 96, generator=gen), torch.randn(96, width, generator=gen)
        ffns.append((*C.quantize_int4(gu, g), *C.quantize_int4(dn, g), 2 * width, g))
    weights = [1.0, 0.7, 0.2, 0.05]
    want = torch.zeros_like(x)
    for (gp, gs, dp, ds, two_f, g), w in zip(ffns, weights):
        op.mix_outputs(want, [op.swiglu_ffn(x, gp, gs, two_f, g, dp, ds, 96, g)], [w])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got = torch.zeros_like(x)
            op.swiglu_mix(x, got, *zip(*ffns), weights)
            assert torch.equal(got, want)
    finally:
        torch.set_num_threads(before)
    m, path = tiny
    eng = S.load(path)
    assert eng.decode_plan is not None and all(moe.shared_mix_args is not None for moe in eng.moes)
    prompt = list(range(5, 25))
    calls = []

    class Counting:  # the native ops, counting the swiglu_mix calls that take the shared expert along
        def __getattr__(self, name):
            return getattr(real, name)

        def swiglu_mix(self, *a):
            calls.append(len(a[2]))
            return real.swiglu_mix(*a)
    real = kernels.NATIVE
    kernels.NATIVE = Counting()
    try:
        fused = eng.generate(prompt, 8)
        assert calls and all(n == CFG["top_k"] + 1 for n in calls)
        for moe in eng.moes:
            moe.fuse_shared = False
        calls.clear()
        apart = eng.generate(prompt, 8)
        assert calls and all(n == CFG["top_k"] for n in calls)
    finally:
        kernels.NATIVE = real
    assert fused == apart


def test_native_kernel_without_a_compiler_falls_back_loudly(tiny, tmp_path):
    """No working C++ compiler (a laptop without Xcode's tools): one warning naming the fix, then torch's int4pack
    kernel, and the same greedy tokens as the native kernel."""
    m, path = tiny
    want = S.load(path, kernel="native").generate(list(range(5, 15)), 6)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import kernels, stream_infer as S; print(kernels.native_int4()); "
            "eng = S.load(sys.argv[2]); print(eng.kernel, eng.generate(list(range(5, 15)), 6))")
    env = dict(os.environ, CXX="/bin/false", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))  # a fresh, failing build
    r = subprocess.run([sys.executable, "-c", code, ROOT, path], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    warnings = [line for line in r.stderr.splitlines() if "could not build" in line]
    assert len(warnings) == 1 and "Install a C++ compiler" in warnings[0], r.stderr[-2000:]
    native, run = r.stdout.strip().splitlines()[-2:]
    assert native == "None" and run == f"int4pack {want}"


def test_a_lock_left_by_a_killed_build_is_removed_not_waited_on(tmp_path, capsys):
    """torch's build lock file stays behind a build that was killed, and every later load of the extension waited on
    it for ever without a word (chat.py on a container hung). Under kernels.build_turn's flock it goes. (In a
    folder of the test's own: the suite's other worker loads the extension from the shared one meanwhile.)"""
    import inspect
    from torch.utils import cpp_extension
    assert "'lock'" in inspect.getsource(cpp_extension._jit_compile)  # the file torch's FileBaton waits on
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")
    with kernels.build_turn(str(build_dir)):
        assert not (build_dir / "lock").exists()
    assert "left by a build that was killed" in capsys.readouterr().err
    with kernels.build_turn(str(build_dir)):  # no leftover: nothing said
        pass
    assert capsys.readouterr().err == ""


def test_a_rebuild_after_a_source_changed_is_said(tmp_path, monkeypatch, capsys):
    """A pull that changed int4_cpu.cpp (or expert_reader.cpp) rebuilt the extension under the old build dir's name,
    its .so there: ~15-40 s of compiling without a word. Every source's bytes name the build now."""
    import shutil
    from torch.utils import cpp_extension
    for name in ("int4_cpu.cpp", "expert_reader.cpp", "int4_loops.h"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    monkeypatch.setattr(kernels, "__file__", str(tmp_path / "kernels.py"))  # a checkout of its own
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    built = []

    def fake_load(name, **kw):  # a build: the .so lands in its folder
        built.append(name)
        open(os.path.join(cpp_extension._get_build_directory(name, False), name + ".so"), "w").close()
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    for edit, compiles in ((None, True), (None, False), ("int4_cpu.cpp", True), ("expert_reader.cpp", True)):
        if edit:
            with open(tmp_path / edit, "a") as f:
                f.write("// changed by a pull\n")
        monkeypatch.setattr(kernels, "NATIVE", None)
        kernels.native_int4()
        assert ("stream_infer: compiling int4_cpu.cpp" in capsys.readouterr().err) == compiles, edit
    assert len(set(built)) == 3


def fake_builds_in_a_checkout_of_its_own(tmp_path, monkeypatch):
    """kernels.py's sources copied to tmp_path, its builds under tmp_path/ext, each build faked: its .so lands there."""
    import shutil
    from torch.utils import cpp_extension
    for name in ("int4_cpu.cpp", "expert_reader.cpp", "int4_loops.h"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    monkeypatch.setattr(kernels, "__file__", str(tmp_path / "kernels.py"))  # a checkout of its own
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpp_extension, "load", lambda name, **kw: open(  # a build: the .so lands in its folder
        os.path.join(cpp_extension._get_build_directory(name, False), name + ".so"), "w").close())


def test_another_compiler_gets_a_build_of_its_own(tmp_path, monkeypatch, capsys):
    """The extension's build name held the sources, CPU flags, torch and checkout, not the compiler: switching CXX (or
    upgrading the compiler) loaded the .so the previous one had built, without a word. Its identity names it now."""
    fake_builds_in_a_checkout_of_its_own(tmp_path, monkeypatch)

    def compiler(name, version):  # a stand-in whose --version says which it is
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\necho '{name} (fake) {version}'\n")
        path.chmod(0o755)
        return str(path)
    gcc, clang = compiler("g++-12", "12.2.0"), compiler("clang++", "16.0.6")
    for cxx, compiles in ((gcc, True), (gcc, False), (clang, True), (gcc, False), ("upgraded", True)):
        if cxx == "upgraded":  # the same path, a newer compiler
            cxx = compiler("g++-12", "12.3.0")
        monkeypatch.setenv("CXX", cxx)
        monkeypatch.setattr(kernels, "NATIVE", None)
        kernels.native_int4()
        assert ("stream_infer: compiling int4_cpu.cpp" in capsys.readouterr().err) == compiles, (cxx, compiles)


def test_a_build_in_a_read_only_cache_is_used_as_it_is(tmp_path, monkeypatch, capsys):
    """The kernel already built in a cache this user cannot write (a read-only image or mount, another user's home)
    was not used: its lock could not be made there, "could not build", and torch's slower kernel. Loaded as it is."""
    import errno
    from torch.utils import cpp_extension
    fake_builds_in_a_checkout_of_its_own(tmp_path, monkeypatch)
    monkeypatch.setattr(kernels, "NATIVE", None)
    kernels.native_int4()
    [build] = os.listdir(tmp_path / "ext")
    build_dir, real_access, loaded = str(tmp_path / "ext" / build), os.access, []

    def read_only(path, *a, **k):  # what torch's load does first in the build folder: its lock file
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(build_dir, "lock"))
    monkeypatch.setattr(cpp_extension, "load", read_only)
    monkeypatch.setattr(os, "access", lambda path, mode, *a, **k: False if str(path) == build_dir and mode & os.W_OK
                        else real_access(path, mode, *a, **k))
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(kernels, "NATIVE", None)
    capsys.readouterr()
    assert kernels.native_int4() is not None and capsys.readouterr().err == ""
    assert loaded == [os.path.join(build_dir, build + ".so")]


def test_a_build_waited_on_is_said_and_a_filesystem_without_flock_still_builds(tmp_path, capsys, monkeypatch):
    """A build stopped mid-way (kill -STOP) held the flock and later loads waited on it without a word; where flock
    is refused (NFS -o nolock: ENOLCK) the native kernel was never used, with advice to install a compiler."""
    import errno
    import fcntl
    import threading
    build_dir = tmp_path / "build"
    holder = open(build_dir.mkdir() or build_dir / "picaflor-build.flock", "a+")
    holder.write("4242")
    holder.flush()
    fcntl.flock(holder, fcntl.LOCK_EX)
    entered = threading.Event()

    def second():
        with kernels.build_turn(str(build_dir)):
            entered.set()
    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.5)
    assert not entered.is_set()
    fcntl.flock(holder, fcntl.LOCK_UN)
    t.join(10)
    assert entered.is_set() and "waiting for another build" in capsys.readouterr().err
    real = fcntl.flock

    def no_locks(f, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with kernels.build_turn(str(build_dir)):  # torch's lock file alone guards it, as before the flock
        pass
    monkeypatch.setattr(fcntl, "flock", real)
    holder.close()


def test_native_int4_kernel_nan_and_zero_rows():
    op = kernels.native_int4()
    p, sz = C.quantize_int4(torch.randn(32, 128), 64)
    x = torch.randn(3, 128)
    x[0, 5] = float("nan")
    x[1] = 0.0
    x[2, 70] = float("inf")
    y = op.int4_mm(x, p, sz, 32, 64)
    assert torch.isnan(y[0]).all() and torch.equal(y[1], op.int4_mm_generic(x[1:2], p, sz, 32, 64)[0])
    assert not torch.isfinite(y[2]).any()


def test_more_experts_per_token_than_trained_is_served_with_a_note(tiny, capsys):
    """--experts-per-token above the container's top_k is an experiment, allowed, but was silent: one note on stderr;
    its own top_k or fewer say nothing."""
    m, path = tiny
    own = m.cfg.top_k
    for k, said in ((own + 1, 1), (own, 0)):
        capsys.readouterr()
        assert S.main([path, "--prompt", "1,2,3", "--max-new-tokens", "1", "--experts-per-token", str(k)]) == 0
        note = f"note: serving with {k} experts per token, more than the {own} the model was trained with"
        assert capsys.readouterr().err.count(note) == said, k


def test_a_temperature_under_1e_4_decodes_greedily_with_a_note(tiny, capsys):
    """logits / 1e-39 overflow (a NaN deep in sampling), so such a temperature was refused; that close to 0 the draw
    is the argmax anyway: greedy, as temperature 0, said once on the command line (the API's stream() too, unsaid)."""
    m, path = tiny
    runs = {}
    for t in ("0", "1e-39"):
        capsys.readouterr()
        assert S.main([path, "--prompt", "1,2,3", "--max-new-tokens", "4", "--temperature", t]) == 0
        runs[t] = capsys.readouterr()
    assert runs["1e-39"].out == runs["0"].out and "under 1e-4" not in runs["0"].err
    assert runs["1e-39"].err.count("note: --temperature 1e-39 is under 1e-4: decoding greedily") == 1, runs["1e-39"]
    eng = S.load(path)
    assert eng.generate([1, 2, 3], 4, temperature=5e-5, seed=5) == eng.generate([1, 2, 3], 4)


def test_more_experts_per_token_than_the_cache_holds_at_once(tiny, monkeypatch):
    """Six experts a layer through a cache of four: one at a time, the same tokens, and never a buffer more than the
    budget holds (an expert still referenced when the next lookup evicts it cannot give its buffer back)."""
    import mmap
    m, path = tiny
    prompt = list(range(5, 25))
    ref = S.load(path).generate(prompt, 6, experts_per_token=6)
    eng = S.load(path, preload=False)
    eng.cache.budget = 4 * eng.container.expert_nbytes  # 2 x top_k: six experts of a layer never fit at once
    made, real = [], mmap.mmap
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: made.append(1) or real(*a, **k))
    assert eng.generate(prompt, 6, experts_per_token=6) == ref and eng.cache.used <= eng.cache.budget
    blobs = eng.cache.blob_buffers
    handed_out = len(blobs.slots) - len(blobs.fresh)
    assert eng.cache.reads > 4 and handed_out <= 4 and len(made) <= 1, (handed_out, eng.cache.reads)  # recycled


def vm_flags_at(addr):
    """The VmFlags of the mapping of this process that holds address addr (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"), reason="Linux THP only")
def test_weights_and_blob_buffers_in_huge_page_memory(tiny):
    """Resident weights (fused ones too) and expert buffers live in private mappings advised for huge pages (a blob
    read into them costs a fifth of the CPU, GEMVs stream faster): not Python's default mmap, shared memory,
    which THP's madvise mode never backs. Buffers share chunks; a slot a caller still holds is not handed out
    again until the caller lets go."""
    m, path = tiny
    eng = S.load(path, preload=False)
    qkv = eng.model.layers[0].self_attn.attn.qkv_proj.raw["packed"]
    lm_head = eng.model.lm_head.raw["q"]
    expert = eng.cache.get((1, 0), set())
    for t in (qkv, lm_head, expert.tensors[0]):
        flags = vm_flags_at(t.data_ptr())
        assert "hg" in flags and "sh" not in flags, flags
    blobs = EC.BlobBuffers(5000, chunk_bytes=4 * 8192)
    first = blobs.take()
    first_addr = ctypes.addressof(ctypes.c_char.from_buffer(first))
    del first  # let go before the next take: it comes back before any never-used slot is touched
    a = blobs.take()
    assert ctypes.addressof(ctypes.c_char.from_buffer(a)) == first_addr
    b, c = blobs.take(), blobs.take()
    addrs = [ctypes.addressof(ctypes.c_char.from_buffer(v)) for v in (a, b, c)]
    assert all(len(v) == 5000 for v in (a, b, c)) and all(x % 4096 == 0 for x in addrs)
    assert sorted(addrs) == addrs and addrs[1] - addrs[0] == 8192  # page-aligned slots of one chunk
    d = blobs.take()
    held = torch.frombuffer(b, dtype=torch.uint8)  # a caller's tensor over b
    del a, b, c, d
    again = [blobs.take() for _ in range(3)]
    got = {ctypes.addressof(ctypes.c_char.from_buffer(v)) for v in again}
    assert addrs[1] not in got and addrs[0] in got and addrs[2] in got  # a and c again (and d), never b
    assert len(blobs.slots) == 4
    del held
    e = blobs.take()
    assert ctypes.addressof(ctypes.c_char.from_buffer(e)) == addrs[1]  # let go: b again
    view = memoryview(e)[100:200]  # a slice of a view holds the slot too (it would not hold a memoryview slot)
    del e, again
    kept = [blobs.take() for _ in range(3)]  # a, c and d, idle again; not b
    assert addrs[1] not in {ctypes.addressof(ctypes.c_char.from_buffer(v)) for v in kept} and len(blobs.slots) == 4
    del view
    assert ctypes.addressof(ctypes.c_char.from_buffer(blobs.take())) == addrs[1]


def test_native_int4_kernel_rejects_wrong_sizes():
    w = torch.randn(40, 100)
    p, sz = C.quantize_int4(w, 32)
    op = kernels.native_int4()
    with pytest.raises(RuntimeError, match="packed has"):
        op.int4_mm(torch.randn(1, 100), p[:-16], sz, 40, 32)
    with pytest.raises(RuntimeError, match="sz has"):
        op.int4_mm(torch.randn(1, 100), p, sz[:-1], 40, 32)
    with pytest.raises(RuntimeError, match="packed has"):  # K that does not match the packed bytes
        op.int4_mm(torch.randn(1, 200), p, sz, 40, 32)


@pytest.mark.parametrize("xs,ws,g", ODD_SHAPES)
def test_cpu_int4_path_equals_reference(xs, ws, g):
    x, p, sz, ref = int4_case(xs, ws, g)
    got = kernels.int4_matmul_cpu(x, kernels.to_int4pack_layout(p, ws, g), sz, ws, g)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() < 2e-2 * ref.abs().max()  # bf16 activations


def test_triton_kernel_interpreter_equals_reference():
    """The Triton kernel (the CUDA path) under TRITON_INTERPRET=1 on CPU tensors equals the reference
    dequantize-then-matmul across odd shapes (an engine on it: test_gpu_check_script_on_the_interpreter)."""
    # TRITON_INTERPRET must be set before triton is imported: run in a fresh interpreter
    code = f"""
import sys, torch
sys.path.insert(0, {ROOT!r})
import container as C, kernels
torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
for xs, ws, g in {ODD_SHAPES!r}:
    x, w = torch.randn(xs, generator=gen), torch.randn(ws, generator=gen)
    p, sz = C.quantize_int4(w, g)
    ref = kernels.int4_matmul_reference(x, p, sz, ws, g)
    got = kernels.triton_int4_matmul(x, p, sz, ws, g)
    err = float((got - ref).abs().max() / ref.abs().max())
    assert got.shape == ref.shape and err < 1e-4, (xs, ws, g, err)
try:  # a matrix past the kernel's 32-bit byte offsets is refused, not read out of bounds
    kernels.triton_int4_matmul(torch.zeros(1, 8), torch.empty(0, dtype=torch.uint8), torch.empty(0), (65536, 65536), 64)
    raise SystemExit("a 65536 x 65536 int4 matrix was launched")
except ValueError as e:
    assert "32-bit" in str(e)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, TRITON_INTERPRET="1"), timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_gpu_check_script_on_the_interpreter(tmp_path, monkeypatch, capsys):
    """bench/gpu_check.py (the CUDA path's one-run check for a machine with a GPU) runs its correctness part on CPU
    under TRITON_INTERPRET=1 and passes: an engine on the Triton kernel (every int4 projection, prefill and decode;
    the int8 lm_head dequantized once) against one on the reference kernel, hidden states and logits within 1e-3
    (1e-7 measured here), greedy tokens equal, also with experts streamed through a quarter-size cache. Without CUDA,
    or on CPU without the interpreter, it says so in one line. On a container narrower than tiny's: the interpreter
    runs each kernel program in Python (22 s on tiny, 5 s here)."""
    _, path = random_container(tmp_path, "narrow", dict(CFG, n_layer=3, d_model=32, n_head=2, n_kv_head=1, dense_ffn=64,
                                                        expert_ffn=32))
    script = os.path.join(ROOT, "bench", "gpu_check.py")
    out = tmp_path / "gc.json"
    r = subprocess.run([sys.executable, script, "--container", path, "--device", "cpu", "--tokens", "2", "--prompt-tokens",
                        "4", "--json", str(out)], capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="1"),
                       timeout=300)
    assert r.returncode == 0 and "gpu_check: ok" in r.stdout, r.stdout + r.stderr[-2000:]
    res = json.load(open(out))
    eng = res["engine"]
    assert res["ok"] and eng["greedy_equal"] and eng["streamed_greedy_equal"] and len(eng["greedy_ref"]) == 2
    assert eng["streamed_misses"] > 8 and max(eng["hidden_rel_err"], eng["logits_rel_err"]) < 1e-5
    assert all(row["rel_err"] < 1e-3 for row in res["kernels"]) and len(res["kernels"]) == 2
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gpu_check = bench_script("gpu_check")
    for a, msg in ((["--device", "cuda"], "no CUDA device"), (["--device", "cpu"], "TRITON_INTERPRET=1")):
        if not (msg == "no CUDA device" and torch.cuda.is_available()):
            assert msg in refusal(gpu_check, ["--container", path, *a], monkeypatch, capsys)


def test_triton_tune_script_on_the_interpreter(tmp_path):
    """bench/triton_tune.py (tile sizes for the Triton kernel, measured on a GPU) checks every config it times against
    the reference; on the interpreter its quick grid (the config in use, the grid's first and last) is within
    tolerance, and a TF32 config wins only when --tf32 allows it (an engine's hidden states drifted 7.5e-2 on it)."""
    out = tmp_path / "tune.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "triton_tune.py"), "--device", "cpu", "--quick",
                        "--json", str(out)], capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="1"),
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    res = json.load(open(out))
    for cls in ("decode", "prefill"):
        c = res["classes"][cls]
        assert len(c["rows"]) == 3 and all(row["ok"] and row["rel_err"] < 1e-4 for row in c["rows"])
        assert c["in_use"]["config"] == list(kernels.TRITON_CONFIGS[cls]) and not c["best"]["config"][5]
    assert any(row["config"][5] for row in res["classes"]["prefill"]["rows"])  # timed, not chosen


def test_budget_strings():
    assert S.parse_size("4G") == 4 << 30 and S.parse_size("512M") == 512 << 20
    assert S.parse_size("1.5G") == int(1.5 * (1 << 30)) and S.parse_size("2GiB") == 2 << 30
    for bad in ("4X", "", "G", "-1G", "nanG", "1.5", "4"):
        with pytest.raises(S.StreamError) as ei:
            S.parse_size(bad)
        assert "\n" not in str(ei.value)
    # a bare number is bytes: a small one is a unit left out, said as such (it was "below the model's needs: 1B")
    with pytest.raises(S.StreamError, match=r"'1\.5': a number without a unit is bytes; give one, e\.g\. 1\.5G"):
        S.parse_size("1.5")
    assert S.parse_size("3000000000") == 3_000_000_000 and S.parse_size(5 << 20) == 5 << 20


def test_bad_input_one_line_errors(tiny, tmp_path):
    m, path = tiny
    with pytest.raises(S.StreamError) as ei:
        S.load(path, ram_budget="64M")  # python + torch alone is more than that
    msg = str(ei.value)
    assert "below what this model needs" in msg and "raise it to at least" in msg and "\n" not in msg
    bad = tmp_path / "corrupt.pcf4"
    data = bytearray(open(path, "rb").read())
    data[:8] = b"NOTMAGIC"
    bad.write_bytes(bytes(data))
    with pytest.raises(S.StreamError) as ei:
        S.load(str(bad))
    assert "not a picaflor int4 container" in str(ei.value)
    with pytest.raises(S.StreamError) as ei:
        S.load(str(tmp_path / "missing.pcf4"))
    assert "no such file" in str(ei.value)
    # a corrupt expert blob surfaces as a one-line error naming layer and expert when it is read
    c = C.load_container(path)
    off = c.header["experts"]["2"][0]["offset"] + 10
    data = bytearray(open(path, "rb").read())
    data[off] ^= 0xFF
    fl = tmp_path / "flip.pcf4"
    fl.write_bytes(bytes(data))
    with pytest.raises(C.ContainerError) as ei:  # preloading (every expert fits) checks every crc at load
        S.load(str(fl), prefetch=False)
    assert "layer 2 expert 0" in str(ei.value)
    eng = S.load(str(fl), prefetch=False, preload=False)
    with pytest.raises(C.ContainerError) as ei:
        for e in range(16):
            eng.cache.get((2, e), set())
    assert "layer 2 expert 0" in str(ei.value)


def test_a_json_path_it_cannot_write_is_refused_before_the_benchmark_and_after_it_is_one_line(tiny, tmp_path,
                                                                                               monkeypatch, capsys):
    """--bench --json PATH that cannot be written (a read-only folder) was found only after the whole benchmark, as a
    traceback; a disk that filled during the run, the same; --json or --plot naming the container replaced it."""
    _, path = tiny
    denied = str(tmp_path / "ro" / "bench.json")

    def refuse(p, *a, **k):
        if str(p) == denied:
            raise PermissionError(13, "Permission denied", str(p))
        return open(p, *a, **k)
    monkeypatch.setattr(S, "open", refuse, raising=False)
    ran = []
    monkeypatch.setattr(B, "bench_in_cgroup", lambda args, argv: ran.append(1) or {"decode_tok_s": 1.0})
    monkeypatch.setattr(B, "print_bench", lambda res: None)
    assert S.main([path, "--bench", "--json", denied]) == 1 and not ran
    assert capsys.readouterr().err == (f"error: --json {denied}: cannot write it (Permission denied); give a path you "
                                       f"can write\n")
    before = open(path, "rb").read()  # the container as --json or --plot: replaced by the results
    for flag, example in (("--json", "bench.json"), ("--plot", "sweep.png")):
        assert S.main([path, "--sweep", "1G", flag, path]) == 1 and not ran
        assert capsys.readouterr().err == (f"error: {flag} {path}: is the container itself (the results would replace "
                                           f"it); give another path, e.g. {example}\n")
    assert open(path, "rb").read() == before
    kept = tmp_path / "kept.json"
    kept.write_text("earlier")
    assert S.main([path, "--bench", "--json", str(kept)]) == 0 and json.loads(kept.read_text()) == {"decode_tok_s": 1.0}
    assert S.main([path, "--bench", "--json", str(tmp_path / "new.json")]) == 0
    full = str(tmp_path / "full.json")

    real_write = B.checkpoint.write_atomic

    def disk_full(p, data):
        if str(p) == full:
            raise OSError(28, "No space left on device", str(p))
        return real_write(p, data)
    monkeypatch.setattr(B.checkpoint, "write_atomic", disk_full)
    capsys.readouterr()
    assert S.main([path, "--bench", "--json", full]) == 1 and not os.path.exists(full)
    assert capsys.readouterr().err == (f"error: --json {full}: cannot write it (No space left on device); the figures "
                                       f"are above\n")


def test_two_benches_writing_one_json_at_once_leave_one_whole(tiny, tmp_path, monkeypatch):
    """Two --bench runs with the same --json at once (two terminals): each opened it "w" and wrote over the other,
    a shorter result over a longer one leaving the longer's tail, JSON that does not parse. Each writes it whole."""
    import json as real_json
    import types
    _, path = tiny
    out = str(tmp_path / "bench.json")
    results = iter([{"decode_tok_s": 1.0}, {"decode_tok_s": 2.0, "note": "x" * 20000}])
    monkeypatch.setattr(B, "bench_in_cgroup", lambda args, argv: next(results))
    monkeypatch.setattr(B, "print_bench", lambda res: None)
    other = []

    def the_other_bench_first(*a, **k):  # the second bench writes its whole result while the first is writing
        if not other and a[0] == {"decode_tok_s": 1.0}:  # (the first bench's result, about to be written)
            other.append(None)
            other[0] = S.main([path, "--bench", "--json", out])
        return (real_json.dump if len(a) == 2 else real_json.dumps)(*a, **k)
    monkeypatch.setattr(B, "json", types.SimpleNamespace(dump=the_other_bench_first, dumps=the_other_bench_first))
    assert S.main([path, "--bench", "--json", out]) == 0 and other == [0]
    assert real_json.load(open(out)) == {"decode_tok_s": 1.0}  # the last one whole: last writer wins


def test_the_budget_a_refusal_suggests_loads(tiny, monkeypatch):
    """'raise it to at least X' said the need itself, rounded to 2 decimals (sometimes below it), while loading takes
    RSS beyond the weights' bytes: a budget of exactly X was refused again, after loading. RSS faked: 8 MB growth."""
    m, path = tiny
    built, real_build = [False], S.Engine._build_model

    def build(self):
        model = real_build(self)
        built[0] = True
        return model

    monkeypatch.setattr(S.Engine, "_build_model", build)
    monkeypatch.setattr(S, "rss_bytes", lambda: (300 << 20) + 123457 + (8 << 20) * built[0])

    def suggested(budget):
        built[0] = False
        with pytest.raises(S.StreamError) as ei:
            S.load(path, ram_budget=budget, prefetch=False)
        return re.search(r"raise it to at least (\S+)$", str(ei.value)).group(1)

    first = suggested("64M")  # below what the model needs resident
    built[0] = False
    S.load(path, ram_budget=first, prefetch=False)  # loads
    second = suggested(S.parse_size(first) - (31 << 20))  # passes the first check, too little after loading
    built[0] = False
    S.load(path, ram_budget=second, prefetch=False)


def test_cli_stats_line_keeps_prefill_apart_from_decode(tiny, capsys):
    """The CLI's one rate was new tokens over prefill + decode: after a 40-token prompt on micro at 1G it read 3.5
    tok/s where decode ran at 17 (--bench's figure). Now the prompt's time and rate, then decode's after the first."""
    assert S.timing_summary(40, [2.0, 0.25, 0.25, 0.5]) == ("prompt 40 tokens in 2.00 s (20.00 tok/s), 4 new tokens: "
                                                            "decode 3.00 tok/s after the first")
    assert S.timing_summary(1, [0.5]) == "prompt 1 token in 0.50 s (2.00 tok/s), 1 new token"
    m, path = tiny
    assert S.main([path, "--prompt", ",".join(map(str, range(1, 41))), "--max-new-tokens", "5", "--threads", "1"]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(r"\[prompt 40 tokens in \S+ s \(\S+ tok/s\), 5 new tokens: decode \S+ tok/s after the first; ",
                    line), line


def test_cli_stats_line_and_an_error_mid_answer(tiny, monkeypatch):
    """--max-new-tokens 0 said 'no routed experts' (it looked nothing up); an error mid-answer (a corrupt expert
    found at token 3) was printed on the end of the answer's line."""
    import io
    m, path = tiny
    both = io.StringIO()  # stdout and stderr as a terminal shows them
    monkeypatch.setattr(sys, "stdout", both)
    monkeypatch.setattr(sys, "stderr", both)
    assert S.main([path, "--prompt", "1,2,3", "--max-new-tokens", "0", "--threads", "1"]) == 0
    assert "[0 new tokens" in both.getvalue() and "no routed experts" not in both.getvalue(), both.getvalue()

    def broken(self, ids, n, *a, **k):
        yield 5
        yield 6
        raise self.container.checksum_error(2, 3)

    monkeypatch.setattr(S.Engine, "stream", broken)
    both.seek(0)
    both.truncate()
    assert S.main([path, "--prompt", "1,2,3", "--max-new-tokens", "4", "--threads", "1"]) == 1
    text = both.getvalue()
    assert text.startswith("5 6 \nerror: ") and text.count("\n") == 2, text  # the error on a line of its own
    assert text.splitlines()[1] == f"error: {path}: checksum mismatch in layer 2 expert 3 (offset " \
        f"{C.load_container(path).header['experts']['2'][3]['offset']}); the file is corrupt, re-export it"


def test_cli_budget_rss_and_errors(tiny, tmp_path):
    """One subprocess (torch import is slow on 2 shared cores): generation under a budget, then checks that its
    peak RSS stayed under the budget. Accounting: budget = python+torch baseline RSS (measured in the child,
    ~300-400 MB) + resident weights + KV + working memory + expert cache; the tiny model's weights are tiny, so
    the budget is set to the baseline measured after a first unbudgeted run (torch pages in ~150 MB of kernels on
    first use) + 100 MB (the working-memory reserve is 32 MB), and the expert cache gets what is left."""
    m, path = tiny
    code = f"""
import sys, json, torch
sys.path.insert(0, {ROOT!r})
torch.set_num_threads(1)
import stream_infer as S
S.load({path!r}).generate([1, 2], 2)  # pages in torch's kernels (~150 MB of RSS on first use)
base = S.rss_bytes()
budget = base + (100 << 20)
eng = S.load({path!r}, ram_budget=budget)
out = eng.generate(list(range(5, 25)), 16)
print(json.dumps(dict(base=base, budget=budget, peak=S.peak_rss_bytes(), out=out, cache=eng.cache.budget)))
rc = S.main([{path!r}, "--ram-budget", "4X"])
rc2 = S.main([{path!r}, "--ram-budget", "10M", "--prompt", "1,2,3"])
rc3 = S.main([{path!r}, "--ram-budget", str(budget + (50 << 20)), "--prompt", "1,2,3", "--max-new-tokens", "4"])
print(json.dumps([rc, rc2, rc3]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(l) for l in r.stdout.splitlines() if l.startswith(("{", "["))]
    res, rcs = lines[0], lines[-1]
    assert res["peak"] <= res["budget"], res
    assert res["out"] == S.load(path).generate(list(range(5, 25)), 16)
    assert rcs == [1, 1, 0]
    errs = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errs) == 2 and "4X" in errs[0] and "raise it to at least" in errs[1]
    assert "Traceback" not in r.stderr


def test_a_long_prompt_stays_under_the_budget(tmp_path):
    """A prompt near the context: its hidden states were kept whole and then concatenated (twice T x d_model), and a
    prefill chunk's attention scores against the whole context were not in the working reserve; at micro's head
    count a 4000-token prompt went 62 MiB over the budget. The budget here is exactly what the engine accounts for
    (+ 2 MiB), in a subprocess; generate and loglikelihood of the long prompt stay under it."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, n_layer=2, n_dense_layers=1, d_model=2048, n_head=16, n_kv_head=4, dense_ffn=64,
                      n_experts=4, expert_ffn=64, n_shared=1, top_k=2, max_seq_len=4096)  # micro's attention
    ck = save_checkpoint(Picaflor(cfg), str(tmp_path / "run"), 1)
    path = str(tmp_path / "wide.pcf4")
    C.write_container(ck, path, group_size=64, progress=False)
    code = f"""
import sys, json, torch
sys.path.insert(0, {ROOT!r})
torch.set_num_threads(1)
import stream_infer as S
S.load({path!r}).generate([1, 2], 2)  # pages in torch's kernels
e = S.load({path!r}, ram_budget="3G", context=4096)
budget = e.resident_rss + e.kv_bytes + e.working_bytes + e.every_expert_bytes + (2 << 20)
del e
eng = S.load({path!r}, ram_budget=budget, context=4096)
prompt = [1 + i % 299 for i in range(4000)]
eng.generate(prompt, 2)
ll = eng.loglikelihood(prompt[:2000], prompt[2000:])[0]
print(json.dumps(dict(budget=budget, peak=S.peak_rss_bytes(), ll=ll)))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.splitlines()[-1])
    assert res["peak"] <= res["budget"], (res["peak"] - res["budget"]) / 2**20


def test_api_requests_keep_their_own_settings_and_bad_arguments_are_stream_errors(tiny):
    """The engine is shared: a stream's experts_per_token was a setting on the MoE modules, so another call in the
    middle of a stream (a generate, a loglikelihood) switched the rest of it to its own k. Sampling arguments and
    ids the command line checks are checked in the API too (NaN / negative temperature, top_p outside (0, 1],
    text or float ids, a negative context, which made the KV reserve negative and the process exceed its budget)."""
    m, path = tiny
    eng = S.load(path)
    p = list(range(5, 25))
    want = eng.generate(p, 8, experts_per_token=1)
    s = eng.stream(p, 8, experts_per_token=1)
    got = [next(s)]
    eng.generate([7, 8, 9], 4)  # default top_k in between
    eng.loglikelihood([5, 6], [7, 8])
    got += list(s)
    assert got == want
    for kw in (dict(temperature=float("nan")), dict(temperature=-0.5), dict(temperature=1.0, top_p=-0.1),
               dict(temperature=1.0, top_p=2.0)):
        with pytest.raises(S.StreamError):
            eng.generate([5, 6], 3, **kw)
    for prompt in ("hello", [5.7, 6], torch.tensor([[5, 6], [7, 8]])):
        with pytest.raises(S.StreamError, match="token ids"):
            eng.generate(prompt, 2)
    # 0 experts meant the container's top_k (the command line refused it); a negative or float max_new_tokens gave []
    # or a torch TypeError, True one token; a None temperature a bare TypeError
    for kw, words in ((dict(experts_per_token=0), "experts-per-token 0"), (dict(experts_per_token=1.0), "1.0"),
                      (dict(max_new_tokens=-3), "max_new_tokens"), (dict(max_new_tokens=2.0), "max_new_tokens"),
                      (dict(max_new_tokens=True), "max_new_tokens"),
                      (dict(temperature=None), "temperature"), (dict(temperature="1", top_p=0.5), "a number"),
                      (dict(eos_id="x"), "eos_id")):
        with pytest.raises(S.StreamError, match=words):
            eng.generate(p, **{"max_new_tokens": 3, **kw})
    with pytest.raises(S.StreamError, match="experts-per-token 0"):
        eng.set_experts_per_token(0)
    # eos_id takes several ids (a list never equalled a token: generation never stopped)
    first = want[:3]
    assert eng.generate(p, 8, experts_per_token=1, eos_id=[first[2], 10 ** 6]) == first
    assert eng.generate(p, 8, experts_per_token=1, eos_id=first[2]) == first
    with pytest.raises(S.StreamError, match="context -5"):
        S.load(path, context=-5)
    # load's other arguments: bare ValueErrors / TypeErrors, or silently taken (a fractional context, an unknown kernel)
    for kw, words in ((dict(context="64"), "context '64': a whole number"), (dict(context=10.5), "context 10.5"),
                      (dict(prefill_chunk="x"), "prefill_chunk 'x'"), (dict(ram_budget=float("nan")), "ram_budget nan"),
                      (dict(ram_budget=0), "ram_budget 0"), (dict(kernel="foo"), "kernel 'foo': use one of auto")):
        with pytest.raises(S.StreamError, match=words):
            S.load(path, **kw)
    with pytest.raises(S.StreamError, match="use cpu, cuda or cuda:N"):
        S.load(path, device="tpu")
    if not torch.cuda.is_available():  # one line from the API too, not torch's assert deep in loading
        with pytest.raises(S.StreamError, match="no CUDA GPU is visible"):
            S.load(path, device="cuda")
    small = S.load(path, context=16)  # a prompt filling the context still gets its one new token
    assert len(small.generate(list(range(1, 17)), 1)) == 1
    with pytest.raises(S.StreamError, match="exceeds the reserved context"):
        small.generate(list(range(1, 17)), 2)
    # loglikelihood's ids as stream()'s (a float was truncated, a string's digits read as ids)
    for ctx, cont in (([1.9, 2.2], [3]), ("12", [3]), ([5, 6], "7")):
        with pytest.raises(S.StreamError, match="token ids"):
            eng.loglikelihood(ctx, cont)
    # a request's experts_per_token ends with it: a caller's own forward() after it routes with the engine's top_k
    ids = torch.tensor([p])
    before = eng.logits(eng.forward(ids))
    eng.generate(p, 2, experts_per_token=1)
    assert torch.equal(eng.logits(eng.forward(ids)), before)
    # a stream left unfinished until the interpreter exits: no "Exception ignored" traceback at exit
    r = subprocess.run([sys.executable, "-c", f"import stream_infer as S; g = S.load({path!r}).stream([5, 6, 7], 8); "
                        f"print(next(g))"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().isdigit() and "Exception" not in r.stderr, r.stderr



def test_a_request_over_the_context_is_told_only_the_fixes_that_fit(tiny):
    """A prompt longer than the context was told to lower --max-new-tokens (no count of new tokens makes it fit), and
    at a small --context to raise it past the model's max_seq_len. The error names only what makes the request fit."""
    m, path = tiny
    top = CFG["max_seq_len"]

    def refusal(eng, n_prompt, new):
        with pytest.raises(S.StreamError, match="exceeds the reserved context") as e:
            eng.generate(list(range(1, n_prompt + 1)), new)
        return str(e.value)
    whole, small = S.load(path, kernel="reference"), S.load(path, kernel="reference", context=16)
    said = refusal(whole, top + 2, 1)  # over max_seq_len: nothing but a shorter prompt
    assert said.endswith(f"the prompt alone is over the model's max_seq_len {top}: shorten the prompt"), said
    said = refusal(small, 20, 1)  # over the context, not max_seq_len
    assert "shorten the prompt, or pass --context 20 or more" in said and "--max-new-tokens" not in said, said
    said = refusal(small, 20, top)
    assert said.endswith(f"shorten the prompt, or pass --context {top} (max_seq_len) with --max-new-tokens "
                         f"{top - 19} or fewer"), said
    said = refusal(whole, 20, top)  # the prompt fits: fewer new tokens do, and nothing else can
    assert said.endswith(f"; lower --max-new-tokens to {top - 19} or fewer"), said
    assert whole.generate(list(range(1, 21)), top - 19) is not None
    said = refusal(small, 10, 10)
    assert said.endswith("lower --max-new-tokens to 7 or fewer, or pass --context 19 or more (max_seq_len 128)"), said

def test_one_engine_shared_by_threads_gives_each_its_own_tokens(tiny):
    """Threads sharing one engine (a server's requests) under a small cache, each with its own experts_per_token:
    without a lock they got one another's top_k, KeyErrors from the cache, and a cache over its budget."""
    import threading
    m, path = tiny
    ref = S.load(path)
    prompts = {k: list(range(3 + k, 23 + k)) for k in (1, 2, 3, 4)}
    want = {k: ref.generate(prompts[k], 6, experts_per_token=k) for k in prompts}
    eng = S.load(path, ram_budget=None, preload=False)
    eng.cache.budget = 6 * eng.container.expert_nbytes  # 6 experts for 4 threads' picks
    got, errors = {k: [] for k in prompts}, []

    def serve(k):
        try:
            for _ in range(2):
                got[k].append(eng.generate(prompts[k], 6, experts_per_token=k))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
    threads = [threading.Thread(target=serve, args=(k,)) for k in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(g == [want[k], want[k]] for k, g in got.items())
    assert eng.cache.used <= eng.cache.budget


def test_engine_settings_the_cli_and_a_closed_pipe(tiny, tmp_path, monkeypatch):
    """set_experts_per_token was overridden by every request's default (the container's top_k); --kern and --max-new
    (prefixes argparse took) got past --chat's checks and were dropped; `| head` ended in a BrokenPipeError
    traceback; forward(positions=...) was taken and ignored; the reference kernel's per-call copies were never
    handed back near the budget (it went over it on micro)."""
    m, path = tiny
    eng = S.load(path)
    before = eng.cache.stats()["lookups"]
    eng.set_experts_per_token(1)
    eng.generate([5, 6], 9)
    one = eng.cache.stats()["lookups"] - before
    eng.generate([5, 6], 9, experts_per_token=2)
    assert eng.cache.stats()["lookups"] - before - one == 2 * one
    with pytest.raises(S.StreamError, match="positions are not supported"):
        eng.forward(torch.tensor([[5, 6]]), positions=torch.tensor([[0, 1]]))
    with pytest.raises(SystemExit):
        S.main([path, "--chat", "--kern", "reference"])
    ref = S.load(path, kernel="reference", ram_budget="4G")
    trims = []
    monkeypatch.setattr(kernels, "release_freed_heap", lambda: trims.append(1))
    ref.trim_above = 1  # as if near the budget
    ref.generate([5, 6], 2)
    assert len(trims) >= 2
    r = subprocess.run(f"{sys.executable} {os.path.join(ROOT, 'stream_infer.py')} {path} --prompt 1,2,3 "
                       f"--max-new-tokens 200 | head -c 5", shell=True, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr[-2000:]


def test_requests_share_the_kv_reserve_the_budget_counted(tiny):
    """The budget reserves KV for `context` positions; each request's stream had its own cache on top, so four
    threads held four. A request now takes its positions from the reserve and waits while other threads hold them;
    a thread whose own open request holds what it lacks gets an error, not a wait for ever."""
    import threading
    m, path = tiny
    eng = S.load(path, context=40)
    p1, p2 = list(range(5, 25)), list(range(7, 27))
    want2 = S.load(path).generate(p2, 5)
    g1 = eng.stream(p1, 10)  # 29 positions
    first = next(g1)
    with pytest.raises(S.StreamError, match="this thread's open requests hold 29 of the 40"):
        eng.generate(p2, 5)  # 24 more: over the 40
    got = {}
    other = threading.Thread(target=lambda: got.update(tokens=eng.generate(p2, 5)))
    other.start()
    other.join(timeout=1.0)
    assert other.is_alive() and not got  # waits while this thread's request holds the reserve
    rest = list(g1)
    other.join(timeout=60)
    assert not other.is_alive() and got["tokens"] == want2
    assert eng.kv_free == 40 and not eng.kv_held and [first] + rest == S.load(path).generate(p1, 10)
    g = eng.stream(p1, 10)
    next(g)
    g.close()  # a request closed early gives its positions back
    assert eng.kv_free == 40 and eng.loglikelihood(p1, p2[:5])[0] < 0


def test_a_second_engine_counts_what_the_first_has_yet_to_allocate(tiny):
    """--ram-budget bounds the process: an engine loaded beside another measured the other's RSS only, so the other's
    cache (loaded empty) and its KV and working memory, allocated by its requests later, went past this budget."""
    m, path = tiny
    first = S.load(path, preload=False)  # its cache fills as it decodes, after the second engine is loaded
    reserve = first.kv_bytes + first.working_bytes + first.cache.every_expert_bytes - first.cache.used
    second = S.load(path, ram_budget="1G")
    assert second.budget >= second.resident_rss + reserve + second.kv_bytes + second.working_bytes + second.cache.budget
    with pytest.raises(S.StreamError, match=r"python\+torch [^,]*, other engines here .* more, resident weights"):
        S.load(path, ram_budget=second.baseline_rss + second.resident_bytes + second.kv_bytes + second.working_bytes
               + second.min_cache + (16 << 20))  # what it needs alone, and room to build
    assert first.generate([5, 6, 7], 4) == second.generate([5, 6, 7], 4)
    live = len(S.LIVE_ENGINES)
    del first, second
    assert len(S.LIVE_ENGINES) == live - 2  # engines let go of count no more


def test_a_long_forward_without_a_cache_takes_its_kv_from_the_reserve(tiny):
    """Engine.forward of a prompt longer than a prefill chunk, without a KV cache, made its own cache of the prompt's
    length outside the reserve: beside another thread's request holding the whole reserve, two KV caches where the
    budget counts one (a kv-heavy container at the budget its refusal named: 381 -> 438 MiB against 437M). It now
    waits for the reserve like a request; this thread's own open request holding it is an error."""
    import threading
    m, path = tiny
    eng = S.load(path, context=40, prefill_chunk=8)
    ids = torch.tensor([list(range(7, 27))])
    want = S.load(path, prefill_chunk=8).forward(ids)
    g1 = eng.stream(list(range(5, 25)), 10)  # 29 of the 40 positions
    first = next(g1)
    with pytest.raises(S.StreamError, match="this thread's open requests hold 29 of the 40"):
        eng.forward(ids)
    got = {}
    other = threading.Thread(target=lambda: got.update(h=eng.forward(ids)))
    other.start()
    other.join(timeout=0.5)
    assert other.is_alive() and not got  # waits while this thread's request holds the reserve
    rest = list(g1)
    other.join(timeout=60)
    assert not other.is_alive() and torch.equal(got["h"], want) and eng.kv_free == 40 and not eng.kv_held
    assert [first] + rest == S.load(path).generate(list(range(5, 25)), 10)


def test_help_says_what_every_option_is(capsys):
    """--max-new-tokens, --top-p, --seed, --bench-prompt-tokens and --device had no text in --help, so no default
    either; --prompt's default ("Once upon a time", given to a code model) was unsaid."""
    import re
    with pytest.raises(SystemExit):
        S.main(["--help"])
    text = capsys.readouterr().out.split("options:", 1)[1]
    bare = [m.group(1) for m in re.finditer(r"^  (--[\w-]+)(?: [A-Z_]+)?\n(?!  {6,})", text, re.M)]
    assert not bare, bare
    assert "default: 'Once upon a time'" in text and "(default 64" in text


def test_bad_flags_are_one_line_errors_before_loading(tiny, tmp_path, capsys):
    """Flags that used to fail deep inside (a ThreadPoolExecutor, a CUDA assert, a NaN in sampling, a benchmark's
    StopIteration, a JSON write after minutes of benchmarking) or were dropped silently (--chat's)."""
    m, path = tiny
    cases = [(["--readers", "0"], "--readers 0"), (["--temperature", "1", "--top-p", "-1"], "--top-p -1"),
             (["--temperature", "-1"], "--temperature -1"), (["--kernel", "triton"], "--kernel triton"),
             (["--device", "cuda"], "--device cuda"), (["--bench", "--max-new-tokens", "1"], "at least 2"),
             (["--bench", "--bench-prompt-tokens", "0"], "--bench-prompt-tokens 0"),
             (["--chat", "--kernel", "native", "--no-preload"], "--kernel, --no-preload"),
             (["--temperature", "1e-39", "--seed", "2"], "greedy (--temperature 1e-39, under 1e-4)"),
             (["--temperature", "1", "--seed", str(2 ** 64)], "--seed"),
             # ignored by greedy decoding (the same text for every seed, silently)
             (["--seed", "2"], "--seed 2: decoding is greedy"), (["--top-p", "0.9"], "--top-p 0.9: decoding is greedy"),
             (["--readers", "100000"], "1 to 64"), (["--experts-per-token", "0"], "at least 1"),
             (["--sweep", ","], "--sweep"),
             # accepted and ignored without a benchmark (--json's folder made and left empty), --prompt under --chat
             (["--json", str(tmp_path / "j" / "out.json")], "for --bench or --sweep only"),
             (["--chat"], "--chat does not take --prompt"),
             (["--bench", "--plot", str(tmp_path / "p.png")], "--bench draws none"),  # (drew nothing, silently)
             # a folder as --json / --plot failed only after the whole benchmark, with a traceback
             (["--bench", "--json", str(tmp_path)], "a folder"), (["--sweep", "3G", "--plot", str(tmp_path)], "a folder")]
    for flags, want in cases:
        assert S.main([path, "--prompt", "1,2,3", "--max-new-tokens", "2", *flags]) == 1, flags
        err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
        assert len(err) == 1 and err[0].startswith("error:") and want in err[0], (flags, err)
    assert not (tmp_path / "j").exists()  # the refused --json made no folder
    # --chat -1 said "0 or more", then 0 was refused by chat.py: the bound it has, said once
    assert S.main([path, "--chat", "--max-new-tokens", "-1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-new-tokens -1: at least 1" in err[0], err


def test_bench_and_sweep_from_the_command_line(tiny, tmp_path):
    """stream_bench.py (= stream_infer.py --bench) runs the measuring child in its own cgroup and writes the JSON
    the issue names; --sweep gives one row per budget (a budget below the resident size is a row with its error,
    and the sweep goes on), a table and a PNG."""
    m, path = tiny
    one, rows, png = tmp_path / "one.json", tmp_path / "sweep.json", tmp_path / "sweep.png"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # two threads, as decode runs on a 2-core machine: the parent must not keep OpenMP threads spinning while the
    # child measures (it measured memory bandwidth itself, and its threads then took ~1.4 of 2 cores from decode)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "stream_bench.py"), path, "--ram-budget", "3G",
                        "--max-new-tokens", "3", "--bench-prompt-tokens", "4", "--threads", "2", "--json", str(one)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(one.read_text())
    others = res["others_cpu_fraction"]  # None: 3 tokens of a tiny model are too short a window for /proc/stat
    assert 0 <= res["parent_cpu_s"] < 0.5 and (others is None or 0 <= others <= 1), (res["parent_cpu_s"], others)
    # memory bandwidth was measured over the weights one token reads, not a fixed size (a cache's speed)
    assert res["mem_probe_bytes"] == res["weight_bytes_per_token"] > 0
    # and again after the child (one probe before set the bound by luck on a VM whose bandwidth switched between
    # two levels): the bound takes the faster
    both = (res["mem_bw_before_bytes_s"], res["mem_bw_after_bytes_s"])
    assert res["mem_bw_bytes_s"] == max(both) and min(both) > 0, both
    t_disk = res["demanded_bytes_per_token"] / res["disk_bw_bytes_s"] if res["disk_bw_bytes_s"] else 0.0
    assert res["bound_tok_s"] == pytest.approx(1 / max(res["weight_bytes_per_token"] / max(both), t_disk))
    assert f"(faster of before and after: before {both[0] / 1e9:.1f}, after {both[1] / 1e9:.1f})" in r.stdout
    assert "other processes' CPU" in r.stdout
    for key in ("decode_tok_s", "prefill_tok_s", "hit_rate", "disk_bytes_per_token", "peak_rss_bytes", "bound_tok_s"):
        assert isinstance(res[key], (int, float)) and res[key] >= 0, key
    assert isinstance(res["page_cache_excluded"], bool) and res["new_tokens"] == 3 and res["ram_budget"] == 3 << 30
    assert "decode" in r.stdout and "% of the bound" in r.stdout
    # the drop was checked: what stayed cached (mincore), and a verdict that agrees with it
    left = res["page_cache_resident_after_drop_bytes"]
    assert "cached after the drop: " in r.stdout and (left is None or res["page_cache_excluded"] is False or
                                                      left <= 0.01 * os.path.getsize(path)), (left, res)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "stream_infer.py"), path, "--sweep", "1M,3G",
                        "--max-new-tokens", "2", "--bench-prompt-tokens", "4", "--threads", "1", "--json", str(rows),
                        "--plot", str(png), "--llamacpp-json", str(tmp_path / "absent.json"), "--repeat", "2"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(rows.read_text())
    assert [row["budget_str"] for row in got] == ["1M", "3G"]
    assert "--ram-budget 1M" in got[0]["error"] and got[1]["decode_tok_s"] > 0
    assert png.stat().st_size > 10_000
    # the table's row for a budget without figures says why (a truncated container once read "needs more than the budget")
    row_1m = next(line for line in r.stdout.splitlines() if line.strip().startswith("1M "))
    assert got[0]["error"] in row_1m and "--ram-budget 1M" in row_1m  # here: the child killed in its 1M cgroup
    # --repeat 2: two runs of 3G (the refused 1M once); its row is the run with the median % of the bound, of an even
    # count the lower middle one
    pcts = sorted(run["pct_of_bound"] for run in got[1]["runs"])
    assert len(pcts) == 2 and "runs" not in got[0] and got[1]["pct_of_bound"] == pcts[0]
    assert got[1]["pct_of_bound"] == pytest.approx(got[1]["decode_tok_s"] / got[1]["bound_tok_s"])
    assert "the median % of the bound of 2" in r.stdout and "decode tok/s over its runs" in r.stdout
    # (both refusals at once: two single-threaded children, two cores) --repeat without --sweep; and an error raised
    # in stream_bench (which imports stream_infer) is one line when stream_infer.py is the script: its StreamError
    # was a second copy of the class, which main() did not catch
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "stream_infer.py"), path, *a], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for a in (["--bench", "--repeat", "2"], ["--sweep", "3G,abc"])]
    (_, err_repeat), (_, err_abc) = (p.communicate(timeout=300) for p in procs)
    assert procs[0].returncode != 0 and "--repeat 2: a positive count of runs per budget, for --sweep" in err_repeat
    assert procs[1].returncode == 1 and "Traceback" not in err_abc and "'abc'" in err_abc, err_abc[-2000:]
    assert res["peak_rss_bytes"] < res["resident_rss_bytes"] + (96 << 20)  # the bandwidth probe's buffer is not the child's


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore is asked on Linux only")
def test_the_page_cache_drop_is_verified_with_mincore(tmp_path):
    """page_cache_excluded said true once posix_fadvise(DONTNEED) returned, whether the pages left or not (tmpfs, or
    an overlay over it that filesystem_type misses, keeps them all). mincore counts what stayed: ~all of a file just
    read, ~none after the drop on a disk; more than 1% is not excluded, with the reason."""
    f = tmp_path / "c.pcf4"
    f.write_bytes(os.urandom((4 << 20) + 123))
    n = len(f.read_bytes())  # read in full: cached
    assert B.page_cache_resident_bytes(str(f)) >= 0.99 * n
    assert B.drop_page_cache(str(f))
    after, fs = B.page_cache_resident_bytes(str(f)), B.filesystem_type(str(f))
    excluded, why = B.page_cache_verdict(True, after, n, True, True, "overlay")  # fs as one that hides a tmpfs
    if fs in B.RAM_FILESYSTEMS:  # its pages cannot be dropped: the count alone says not excluded
        assert after >= 0.99 * n and not excluded and "stayed in the page cache after the drop" in why, (after, why)
    else:
        assert after <= 0.01 * n and excluded and why is None, (fs, after, why)
    assert B.page_cache_verdict(True, None, n, True, True, "ext4") == (True, None)  # unverified: as before
    assert B.page_cache_verdict(True, n // 2, n, True, True, "ext4")[0] is False
    assert B.page_cache_verdict(False, 0, n, True, True, "ext4") == (False, "posix_fadvise(DONTNEED) failed on the "
                                                                            "container")


def test_sweep_repeat_median_and_failed_rounds(monkeypatch, tmp_path, capsys):
    """--repeat: a budget's row is its successful run with the median % of the bound (the lower middle of an even
    count; runs above 100% only when all are); a round that fails later is listed, not fatal; a budget that only
    fails is its error row."""
    import types
    # None: that round's child failed (tried again next round: a one-off OOM); "refused": below the resident size,
    # tried once (a second try would be refused again; the iterator has no second item)
    decode = {"2G": iter([5.0, None, 3.0, 4.0]), "1G": iter([None] * 4), "1K": iter(["refused"])}

    def fake_bench(args, argv):
        tok = next(decode[args.ram_budget])
        if tok is None:
            raise B.ChildFailed(f"x.pcf4: benchmark child failed (exit 1) at --ram-budget {args.ram_budget}")
        if tok == "refused":
            raise S.StreamError(f"--ram-budget {args.ram_budget}: below the resident part's size")
        return {"decode_tok_s": tok, "bound_tok_s": 10.0, "prefill_tok_s": 1.0, "hit_rate": 0.5,
                "disk_bytes_per_token": 1e6, "read_wait_s_per_token": 0.01, "bound_tok_s_serial": 5.0,
                "disk_bw_bytes_s": 1e9, "mem_bw_bytes_s": 1e10, "peak_rss_bytes": 1 << 30, "page_cache_excluded": True,
                "ram_budget": S.parse_size(args.ram_budget), "cpu_steal_fraction": tok / 100,
                "p50_token_latency_s": 1 / tok, "p99_token_latency_s": 2 / tok, "cache_capacity_experts": 300,
                "huge_page_bytes": None, "disk_bw_decode_bytes_s": 1.5e9, "others_cpu_fraction": 0.02}

    monkeypatch.setattr(B, "bench_in_cgroup", fake_bench)
    monkeypatch.setattr(B, "print_bench", lambda res: None)
    monkeypatch.setattr(B, "plot_sweep", lambda *a: None)
    args = types.SimpleNamespace(sweep="2G,1G,1K", repeat=4, json=str(tmp_path / "s.json"), plot=None,
                                 llamacpp_json=None, container="x.pcf4", ram_budget=None)
    rows = B.run_sweep(args, [])
    assert rows[0]["decode_tok_s"] == 4.0  # of 3, 4, 5 tok/s (one round failed): the median
    assert [r["decode_tok_s"] for r in rows[0]["runs"]] == [5.0, 3.0, 4.0] and len(rows[0]["failed_runs"]) == 1
    assert "error" in rows[1] and "runs" not in rows[1] and next(decode["1G"], "spent") == "spent"  # 4 tries
    assert "below the resident" in rows[2]["error"]  # refused once: not tried again (no StopIteration)
    out = capsys.readouterr().out
    assert "1 failed" in out and "4% (3-5)" in out  # the CPU steal column: the median run's, and the range
    assert "2G: decode tok/s over its runs 3.00-5.00 (median 4.00)" in out
    # README's table, written next to the JSON: the median run's figures, the runs' ranges, the refused budget's error
    md = (tmp_path / "s.md").read_text().splitlines()
    assert len(md) == 5 and md[1].count("---") == md[0].count("|") - 1
    cells = [c.strip() for c in md[2].strip("|").split("|")]
    assert cells[:5] == ["2G", "4.00 (3-5)", "1.00", "250 / 500", "0.500"] and cells[6:8] == ["1.0", "10"]
    # the round that failed is said in the row, as on the console (README's table read as four clean runs)
    assert cells[10] == "1.00 (n/a / n/a / 1.50)"  # the bound's figure, then what it came from
    assert cells[13:] == ["**40%** (30-50), 1 of 4 failed", "80%", "4% (3-5)", "2%"]
    assert md[3].startswith("| 1G | x.pcf4: benchmark child failed") and md[3].count("|") == md[0].count("|")
    decode["2G"] = iter([5.0, 3.0])
    args.sweep, args.repeat = "2G", 2
    assert B.run_sweep(args, [])[0]["decode_tok_s"] == 3.0  # even count: the lower middle run
    # a run faster than its bound (10 tok/s) measured a bandwidth wrong: the median of the others, unless all are
    decode["2G"] = iter([12.0, 4.0, 11.0, 3.0])
    args.repeat = 4
    assert B.run_sweep(args, [])[0]["decode_tok_s"] == 3.0
    decode["2G"] = iter([12.0, 11.0])
    args.repeat = 2
    assert B.run_sweep(args, [])[0]["decode_tok_s"] == 11.0


def test_bench_hit_rate_counts_only_experts_no_read_was_made_for(tiny, capsys):
    """--bench's hit rate: the decode lookups served from the cache. A right prefetch guess was read from the disk
    that token; counted as a hit, it put 0.73 on this run, where 0.38 of the lookups needed no read."""
    m, path = tiny
    eng = S.load(path, ram_budget=None, prefetch="on", preload=False)
    eng.cache.budget = 12 * eng.container.expert_nbytes
    res = B.run_bench(eng, n_prompt=6, n_new=12, mem_bw=1e10)
    lookups_per_token = (CFG["n_layer"] - CFG["n_dense_layers"]) * CFG["top_k"]  # distinct picks, one lookup each
    read_per_token = res["demanded_bytes_per_token"] / res["expert_bytes"]  # misses and right guesses
    assert res["hit_rate"] == pytest.approx(1 - read_per_token / lookups_per_token)
    assert res["prefetch_hit_rate"] > 0  # guesses were right: what the old figure counted as hits
    assert res["hit_rate"] + res["prefetch_hit_rate"] <= 1
    B.print_bench(res)
    assert f"hit rate {res['hit_rate']:.3f} (decode; {res['prefetch_hit_rate']:.3f} more were right guesses" in \
        capsys.readouterr().out


def test_print_bench_says_one_of_a_thing_in_the_singular(tiny, capsys):
    """--bench-prompt-tokens 1 printed "(1 tokens)", --threads 1 "1 threads", a budget with room for one expert
    "capacity 1 experts"."""
    m, path = tiny
    res = {"container": path, "container_bytes": os.path.getsize(path), "random_weights": True, "ram_budget": 1 << 30,
           "kernel": "native", "threads": 1, "experts_per_token": 2, "prompt_tokens": 1, "prefill_tok_s": 10.0,
           "decode_tok_s": 20.0, "p50_token_latency_s": 0.05, "p99_token_latency_s": 0.06, "hit_rate": 0.5,
           "cache_capacity_experts": 1, "model_experts": 48, "expert_bytes": 1e6, "disk_bytes_per_token": 1e6,
           "counted_bytes_per_token": 1e6, "read_wait_s_per_token": 0.01, "peak_rss_bytes": 1 << 29,
           "cgroup_peak_bytes": None, "huge_page_bytes": None, "disk_bw_bytes_s": 1e9, "mem_bw_bytes_s": 1e10,
           "bound_tok_s": 40.0, "bound_tok_s_serial": 30.0, "direct_io": True, "page_cache_excluded": True,
           "page_cache_resident_after_drop_bytes": 0, "cpu_steal_fraction": None, "others_cpu_fraction": None,
           "weight_bytes_per_token": 5e8, "prefetch": "off"}
    B.print_bench(res)
    out = capsys.readouterr().out
    assert ", 1 thread, top-2" in out and "(1 token)" in out and "capacity 1 expert (the model has 48)" in out, out
    res.update(threads=2, prompt_tokens=8, cache_capacity_experts=5)
    B.print_bench(res)
    out = capsys.readouterr().out
    assert ", 2 threads, top-2" in out and "(8 tokens)" in out and "capacity 5 experts (the model has 48)" in out


def test_sweep_markdown_memory_in_the_budgets_units():
    """The markdown table (README's) gives peak RSS and huge pages in the budget column's binary units, as the
    console table does: a 3G run's 2.91 GiB peak was written "3.13 GB", which reads as over its 3G budget."""
    peak, huge = 3128074240, 2684354560  # bench/micro_sweep.json's 3G row: under 3 GiB
    row = {"budget_str": "3G", "ram_budget": 3 << 30, "decode_tok_s": 29.0, "prefill_tok_s": 40.0, "hit_rate": 0.9,
           "p50_token_latency_s": 0.034, "p99_token_latency_s": 0.045, "cache_capacity_experts": 684,
           "disk_bytes_per_token": 1e7, "read_wait_s_per_token": 0.004, "peak_rss_bytes": peak,
           "huge_page_bytes": huge, "disk_bw_decode_bytes_s": 1.5e9, "mem_bw_bytes_s": 2.7e10, "bound_tok_s": 50.0,
           "pct_of_bound": 0.58, "bound_tok_s_serial": 37.0, "cpu_steal_fraction": 0.0, "others_cpu_fraction": 0.0}
    md = B.sweep_markdown([row]).splitlines()
    head = [c.strip() for c in md[0].strip("|").split("|")]
    cells = dict(zip(head, (c.strip() for c in md[2].strip("|").split("|"))))
    assert cells["peak RSS"] == S.fmt_size(peak) and cells["in huge pages"] == S.fmt_size(huge)
    assert S.parse_size(cells["peak RSS"]) <= S.parse_size(cells["budget"])


def test_sweep_plot_marks_a_budget_that_failed(tmp_path, monkeypatch):
    """The sweep's PNG (README's): a budget whose every run failed or was refused is marked on the tok/s axis; it
    was left out, and the curve's line ran from the budget above it to the one below as if it had been measured."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.axes import Axes
    drawn, real = [], Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, **kw: drawn.append((a, kw.get("label"))) or real(ax, *a, **kw))
    ok = {"ram_budget": 3 << 30, "decode_tok_s": 20.0, "bound_tok_s": 40.0, "hit_rate": 0.9,
          "disk_bytes_per_token": 1e7, "container_bytes": 4e9, "random_weights": True, "threads": 2}
    failed = {"ram_budget": 2 << 30, "budget_str": "2G", "error": "x.pcf4: benchmark child failed (killed)"}
    B.plot_sweep([ok, failed, dict(ok, ram_budget=1 << 30)], str(tmp_path / "s.png"), None, "x.pcf4")
    assert (tmp_path / "s.png").stat().st_size > 0
    marks = [a for a, label in drawn if label and "failed" in label]
    assert len(marks) == 1 and list(marks[0][0]) == [2.0], drawn


def test_others_cpu_fraction_needs_a_long_enough_window():
    """Other processes' share of the cores from /proc/stat's tick counts: busy less steal less our own CPU time, over
    all cores; a window too short for whole ticks to mean anything gives None, not a share above 100%."""
    hz, n = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    # 2 s: the machine was busy 1.5 s a core (steal 0.1 s of it), this process used 0.4 s
    before, after = (0, 0), (int(0.1 * hz), int(1.5 * n * hz))
    assert B.others_cpu_fraction(before, after, 0.4, 2.0) == pytest.approx((1.5 * n - 0.1 - 0.4) / (2.0 * n), abs=0.02)
    assert B.others_cpu_fraction(before, (0, int(0.2 * n * hz)), 0.0, 1.0) == pytest.approx(0.2, abs=0.02)
    assert B.others_cpu_fraction(before, (0, 0), 5.0, 1.0) == 0.0  # our own time over the ticks' count: none
    assert B.others_cpu_fraction(before, (0, 3), 0.0, 10 / hz) is None  # 10 ticks: too short a window
    assert B.others_cpu_fraction(None, after, 0.0, 2.0) is None


def test_memory_probe_is_one_tokens_weights(tiny, monkeypatch):
    """The bound's memory figure: the weights one token reads (everything resident but the input embedding, plus
    top-k experts a MoE layer), measured over a working set that size: 64 MB sat in a 260 MB L3 here."""
    m, path = tiny
    cont = C.load_container(path)
    cfg, n_moe = cont.config, cont.config.n_layer - cont.config.n_dense_layers
    two, one = B.weight_bytes_per_token(cont), B.weight_bytes_per_token(cont, 1)
    assert two - one == n_moe * cont.expert_nbytes and cfg.top_k == 2
    # an independent count: every tensor of the container but the input embedding (this model's is not tied)
    resident = sum(t["nbytes"] for name, t in cont.header["tensors"].items() if name != "embed_tokens.weight")
    assert not cfg.tie_embeddings and one == resident + n_moe * cont.expert_nbytes
    made = []
    real = C.anon_tensor
    monkeypatch.setattr(C, "anon_tensor", lambda shape, dtype: made.append((list(shape), dtype)) or real(shape, dtype))
    bw = B.measure_memory_bandwidth(3 << 20, reps=2, max_reps=2)
    assert made == [([3 << 18], torch.float32)] and 1e8 < bw < 1e13  # one buffer of 3 MB; bytes per second
    made.clear()
    B.measure_memory_bandwidth(1000, reps=1, max_reps=1)
    assert made == [([1 << 18], torch.float32)]  # at least 1 MB
    cont.close()


def test_bench_result_fields_and_lru_policy(tiny, capsys):
    m, path = tiny
    eng = S.load(path, ram_budget=None, cache_policy="lru", preload=False)
    eng.cache.budget = 5 * eng.container.expert_nbytes
    res = B.run_bench(eng, n_prompt=6, n_new=5)
    for key in ("decode_tok_s", "prefill_tok_s", "hit_rate", "disk_bytes_per_token", "peak_rss_bytes", "bound_tok_s"):
        assert isinstance(res[key], (int, float)) and res[key] >= 0, key
    assert res["new_tokens"] == 5 and res["decode_tok_s"] > 0 and res["bound_tok_s"] > 0
    # time stalled on reads: some (5 of 48 experts fit), and less than the decode took
    assert 0 < res["read_wait_s_per_token"] < 1 / res["decode_tok_s"]
    # the bound's disk figure is the mean of the measurements before loading and after decoding; the one after
    # reads only blobs this run never read (a storage-side cache flattered recently read ones)
    both = [b for b in (res["disk_bw_before_bytes_s"], res["disk_bw_after_bytes_s"]) if b]
    assert res["disk_bw_before_bytes_s"] > 0 and res["disk_bw_decode_bytes_s"] > 0  # 5 of 48 fit: decode reads
    assert res["disk_bw_bytes_s"] == pytest.approx(max(sum(both) / len(both), res["disk_bw_decode_bytes_s"]))
    done, every = {(1, e) for e in range(16)}, {(layer, e) for layer in (1, 2, 3) for e in range(16)}
    busy0, seen = eng.cache.disk_busy_s, set()
    assert B.measure_disk_bandwidth(eng.container, exclude=done, picked=seen) > 0
    assert seen == every - done  # 64 asked for: all 32 blobs that are left, none of the excluded
    assert eng.cache.disk_busy_s > busy0  # read on expert_reader.cpp's threads, as the cache reads
    assert B.measure_disk_bandwidth(eng.container, exclude=set(sorted(every)[7:])) is None  # 7 left: too few
    assert res["cache_policy"] == "lru"
    # the bound's disk time counts the reads decode needed: without prefetch, every read it made
    assert res["demanded_bytes_per_token"] > 0
    assert res["demanded_bytes_per_token"] == pytest.approx(res["counted_bytes_per_token"])
    # the hypervisor's share of the CPU during decode (/proc/stat steal), where the kernel reports it
    assert res["cpu_steal_fraction"] is None or 0 <= res["cpu_steal_fraction"] <= 1
    assert B.steal_fraction((10, 100), (30, 200)) == pytest.approx(0.2)
    steal, busy = B.cpu_times()
    assert 0 <= steal <= busy
    assert B.steal_fraction(None, (30, 200)) is None and B.steal_fraction((10, 100), (10, 100)) is None
    res["cpu_steal_fraction"] = 0.3
    B.print_bench(res)
    err = capsys.readouterr().err
    assert "the hypervisor took 30% of the CPU time this machine wanted" in err
    # a model whose token reads a few MB: its bound says nothing of its speed, and the bench says so
    assert ("per-token overhead" in err) == (res["bound_tok_s"] > 500)
    res["bound_tok_s"], res["weight_bytes_per_token"] = 77525.0, 1.6e6
    B.print_bench(res)
    said = capsys.readouterr()
    assert "a token reads 1.6 MB of weights, so the bound is under 2 ms" in said.err
    # a small container's size in a unit that shows it (it read "0.00 GB")
    assert f"({S.fmt_size(res['container_bytes'])}, random weights" in said.out and " (0.00 GB" not in said.out
    # the cache's capacity beside the model's own count (a capacity of 47244 read as if the model had that many)
    assert res["model_experts"] == (m.cfg.n_layer - m.cfg.n_dense_layers) * m.cfg.n_experts
    assert f"capacity {res['cache_capacity_experts']} experts (the model has {res['model_experts']})" in said.out
    assert "under RSS" not in said.out
    res["cgroup_peak_bytes"] = res["peak_rss_bytes"] // 2  # (as measured: 170M against 258M, unexplained)
    B.print_bench(res)
    assert "(under RSS: pages other processes cached first, torch's libraries" in capsys.readouterr().out
    # the counted bytes and /proc/self/io agree when reads are O_DIRECT
    if res["direct_io"]:
        assert res["disk_bytes_per_token"] >= res["counted_bytes_per_token"]
    eng.set_prefetch(True)  # with prefetch a wrong guess is read but not needed: the bound leaves it out
    pf = B.run_bench(eng, n_prompt=6, n_new=5)
    assert pf["cache"]["prefetch_reads"] > 0 and pf["demanded_bytes_per_token"] <= pf["counted_bytes_per_token"]
    eng.set_prefetch(False)
    # the policy changes what is cached, never the output
    score = S.load(path, preload=False)
    assert score.cache.policy == "score"  # the default
    score.cache.budget = 5 * score.container.expert_nbytes
    assert eng.generate([3, 4, 5], 8) == score.generate([3, 4, 5], 8)
    with pytest.raises(S.StreamError, match="cache policy 'lfu'"):
        S.load(path, cache_policy="lfu")
    # expert_cache.py on its own (the engine never lets it get this far): one-line errors, nothing read
    cont = C.load_container(path)
    with pytest.raises(EC.CacheError, match="cache policy 'mru': use one of score, lru"):
        EC.ExpertCache(cont, 10 * cont.expert_nbytes, None, policy="mru")
    tiny_cache = EC.ExpertCache(cont, cont.expert_nbytes - 1, lambda buf, views: S.Expert(cont, buf, "reference", views=views))
    with pytest.raises(EC.CacheError, match="cannot hold one expert .*; raise --ram-budget") as ei:
        tiny_cache.get((1, 0), {(1, 0)})
    assert path in str(ei.value) and "\n" not in str(ei.value) and tiny_cache.reads == 0
    roomy = EC.ExpertCache(cont, cont.expert_nbytes, lambda buf, views: S.Expert(cont, buf, "reference", views=views))
    x = torch.randn(1, cont.config.d_model)
    assert torch.equal(roomy.get((1, 0), {(1, 0)})(x), S.Expert(cont, cont.read_expert_blob(1, 0), "reference")(x))
    assert B.strip_args(["m", "--sweep", "1G,2G", "--bench", "--json=x"], {"--sweep", "--json"}, {"--bench"}) == ["m"]


def test_vs_llamacpp_budgets_and_bad_input(tmp_path, monkeypatch, capsys):
    """bench/vs_llamacpp.py: budgets as % of the container, 'none' or sizes; a missing container is one line."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import vs_llamacpp as V
    assert V.budget_bytes_of("none", 4000) is None
    assert V.budget_bytes_of("50%", 4000) == 2000 and V.budget_bytes_of("25%", 4000) == 1000
    assert V.budget_bytes_of("1G", 4000) == 1 << 30
    for bad in ("4X", "abc%", "0%", "0"):  # (0% read as no limit; the rest were tracebacks after the GGUF export)
        with pytest.raises(V.BenchError, match="--budgets"):
            V.budget_bytes_of(bad, 4000)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "vs_llamacpp.py"), str(tmp_path / "nope.pcf4")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip().startswith("error:") and "nope.pcf4" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # a second llama.cpp build must be a folder holding the llama_cpp package: one line naming the flag
    box = tmp_path / "box.pcf4"
    box.write_bytes(b"x")
    msg = refusal(V, [box, "--llama-builds", f"noamx={tmp_path}"], monkeypatch, capsys)
    assert "--llama-builds" in msg and "llama_cpp package" in msg
    assert "'2X'" in refusal(V, [box, "--budgets", "2X"], monkeypatch, capsys)
    assert V.exit_reason(-9, "", True) == "killed (out of memory in the cgroup)"
    assert V.exit_reason(-11, "", True) == "crashed (SIGSEGV)" and "OOM" not in V.exit_reason(-9, "", False)


def test_runs_without_proc_as_on_macos(tiny, tmp_path, monkeypatch, capsys):
    """macOS has no /proc: memory figures come from getrusage (the peak: the budget's accounting over-reserves),
    the bench finds no cgroup and takes disk bytes from the cache's own count, saying so, instead of crashing at
    load or printing 0 MB read as if /proc/self/io had said it."""
    m, path = tiny
    want = S.load(path).generate(list(range(5, 25)), 6)
    monkeypatch.setattr(S, "PROC_SELF", str(tmp_path / "no-proc"))
    assert S.proc_status("VmRSS") is None and S.io_counters() is None
    assert S.rss_bytes() == S.peak_rss_bytes() == S.peak_rss_from_rusage() > 100 << 20  # torch alone is ~200 MB
    assert B.cgroup_memory_dir() == (None, None)
    eng = S.load(path, ram_budget=None, preload=False)
    eng.cache.budget = 5 * eng.container.expert_nbytes
    assert eng.baseline_rss > 0 and eng.resident_rss >= eng.baseline_rss
    assert eng.generate(list(range(5, 25)), 6) == want
    res = B.run_bench(eng, n_prompt=6, n_new=5)
    assert res["disk_bytes_source"].startswith("counted") and res["peak_rss_bytes"] > 0
    assert res["disk_bytes_per_token"] == res["counted_bytes_per_token"] > 0
    B.print_bench(res)
    assert "counted (no /proc/self/io here)" in capsys.readouterr().out


def test_slot_pages_given_back_whole_on_any_page_size():
    """A slot's pages go back to the OS (MADV_DONTNEED) only where whole pages lie inside it: on 4 KiB pages the
    4 KiB-aligned slot itself, on 16 / 64 KiB pages the pages inside it, never a neighbour's start."""
    assert EC.whole_pages(3 * 12288, 12288, 4096) == (3 * 12288, 12288)
    assert EC.whole_pages(12288, 36864, 16384) == (16384, 32768)  # [12288, 49152) holds [16384, 49152)
    assert EC.whole_pages(12288, 12288, 16384) is None  # [12288, 24576): no whole 16 KiB page inside
    assert EC.whole_pages(65536 + 4096, 200704, 65536) == (131072, 131072)
    for page in (4096, 16384, 65536):
        for off in range(0, 10 * 12288, 12288):
            got = EC.whole_pages(off, 12288, page)
            if got:
                assert got[0] % page == 0 and got[1] % page == 0 and off <= got[0] and sum(got) <= off + 12288


def test_expert_reads_skip_the_page_cache_on_macos(tiny, monkeypatch):
    """macOS has no O_DIRECT: the container opens a descriptor of its own with F_NOCACHE for expert reads, and the
    blobs read through it are the same bytes; where F_NOCACHE is refused, buffered reads as before."""
    import fcntl
    m, path = tiny
    plain = C.load_container(path)
    want = bytes(plain.read_expert_blob(1, 3))
    calls = []
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(fcntl, "fcntl", lambda fd, cmd, arg: calls.append((cmd, arg)) or 0)
    cont = C.load_container(path)
    assert cont.direct_fd is not None and cont.direct_fd != cont.fd
    assert calls == [(getattr(fcntl, "F_NOCACHE", 48), 1)]
    assert bytes(cont.read_expert_blob(1, 3)) == want
    eng_ref, eng = S.load(path), S.load(path, ram_budget=None, preload=False)
    assert eng.container.direct_fd is not None
    eng.cache.budget = 5 * eng.container.expert_nbytes
    assert eng.generate(list(range(5, 25)), 6) == eng_ref.generate(list(range(5, 25)), 6)

    def refuse(fd, cmd, arg):
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(fcntl, "fcntl", refuse)
    refused = C.load_container(path)
    assert refused.direct_fd is None
    refused.close()
    cont.close()
    plain.close()


def test_auto_kernel_on_arm_without_dot_products_says_so(monkeypatch, capsys):
    """--kernel auto takes the native kernel where it has integer loops (AVX2, AArch64 dot products); an ARM build
    without dot products falls back to int4pack and says why, and an x86 one without AVX2 falls back quietly."""
    import platform

    class Ops:
        def has_avx2(self):
            return False

        def has_sdot(self):
            return self.sdot
    ops = Ops()
    monkeypatch.setattr(kernels, "native_int4", lambda: ops)
    monkeypatch.setattr(kernels, "cpu_int4pack_ok", lambda: True)
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    ops.sdot = True
    assert S.pick_kernel("auto", "cpu") == "native" and capsys.readouterr().err == ""
    ops.sdot = False
    assert S.pick_kernel("auto", "cpu") == "int4pack"
    assert "without ARM dot-product instructions" in capsys.readouterr().err
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert S.pick_kernel("auto", "cpu") == "int4pack" and capsys.readouterr().err == ""


def test_kernel_choice_on_cuda():
    """On a CUDA device --kernel auto is the Triton kernel (any card index); the CPU-only kernels are refused in one
    line naming the one to use; the reference kernel (the check's baseline) runs anywhere."""
    for dev in ("cuda", "cuda:1"):
        assert S.pick_kernel("auto", dev) == "triton" and S.pick_kernel("triton", dev) == "triton"
        assert S.pick_kernel("reference", dev) == "reference"
        with pytest.raises(S.StreamError, match="--kernel native: int4_cpu.cpp runs on CPU only"):
            S.pick_kernel("native", dev)
        with pytest.raises(S.StreamError, match="on CUDA use --kernel triton"):
            S.pick_kernel("int4pack", dev)


def test_kernels_script_names_this_machines_loops():
    """python kernels.py says which loops the native build has (what --kernel auto picks from), as the extension
    reports them in this process, and whether torch's int4pack kernel needs the container's bytes repacked."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "kernels.py")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    op = kernels.native_int4()
    want = [n for n in ("avx2", "avx512", "vnni", "sdot") if getattr(op, "has_" + n)()]
    native = next(line for line in r.stdout.splitlines() if line.startswith("native:"))
    assert native.startswith("native: built, integer loops " + (", ".join(want) or "none")), native
    assert ("repacked" in r.stdout) == (kernels.cpu_int4pack_ok() and not kernels.int4pack_same_layout())


def test_int4pack_loglikelihood_on_a_width_torch_int8pack_cannot_take(tmp_path):
    """torch's _weight_int8pack_mm segfaulted for more than one row when K % 16 != 0: loglikelihood's logit rows
    through an int8 lm_head of d_model 40 on --kernel int4pack killed the process. Run in a child: a crash is rc 139."""
    torch.manual_seed(0)
    cfg = dict(CFG, d_model=40, n_head=2, n_kv_head=1, dense_ffn=48, expert_ffn=32)
    ck = save_checkpoint(Picaflor(ModelConfig(**cfg)), str(tmp_path / "run"), 1)
    path = str(tmp_path / "d40.pcf4")
    C.write_container(ck, path, group_size=8, progress=False)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import stream_infer as S; "
            "print(S.load(sys.argv[2], kernel='int4pack').loglikelihood([1, 2, 3], [4, 5, 6])[0]); "
            "print(S.load(sys.argv[2], kernel='reference').loglikelihood([1, 2, 3], [4, 5, 6])[0])")
    r = subprocess.run([sys.executable, "-c", code, ROOT, path], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    got, ref = (float(v) for v in r.stdout.split()[-2:])
    assert abs(got - ref) < 0.05 * abs(ref)


def test_int4pack_int8_rows_of_a_width_torch_int8pack_gets_wrong_for_one_row_too():
    """torch's _weight_int8pack_mm gives garbage (1e34, NaN) for a single row too when K % 16 != 0 (d_model 72 or 90:
    every decode step's untied int8 lm_head on --kernel int4pack; M > 1 was avoided, M = 1 trusted). Such widths take
    the reference path: the same logits as it, row after row."""
    g = torch.Generator().manual_seed(0)
    for K in (72, 90):
        w = torch.randn(300, K, generator=g)
        q, scale = C.quantize_int8(w)
        raw = {"kind": "int8", "shape": [300, K], "q": q.view(300, K), "scale": scale}
        lin = kernels.QLinear(raw, "int4pack")
        for _ in range(20):
            x = torch.randn(1, K, generator=g)
            ref = kernels.int8_matmul_reference(x, raw["q"], scale, (300, K))
            assert (lin(x) - ref).abs().max() <= 0.02 * ref.abs().max(), K


def test_cli_prints_generated_text_without_specials(tmp_path, monkeypatch, capsys):
    """The CLI printed <|bos|> by name at the end of a document and raised on an id with no text (reserved 0), as
    chat.py and eval.py once did: it decodes as they do now (tokenizer.decode_generated)."""
    import tokenizer as T
    tok = T.train_tokenizer(["the hummingbird flies over the flowers, hello world"] * 40, 300)
    tok.save(str(tmp_path / "tok.json"))
    torch.manual_seed(0)
    ck = save_checkpoint(Picaflor(ModelConfig(**dict(CFG, vocab_size=tok.vocab_size))), str(tmp_path / "run"), 1,
                         tokenizer_file=str(tmp_path / "tok.json"))
    path = str(tmp_path / "t.pcf4")
    C.write_container(ck, path, group_size=32, progress=False)
    monkeypatch.setattr(S.Engine, "stream", lambda self, ids, n, *a, **k: iter(tok.encode(" world") + [tok.bos_id, 0]))
    assert S.main([path, "--prompt", "hello", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hello world") and "<|bos|>" not in out and "\ufffd" in out, out
    big = CFG["max_seq_len"] * 4  # --context past the model's was capped without a word
    assert S.main([path, "--prompt", "hello", "--max-new-tokens", "4", "--context", str(big)]) == 0
    assert f"--context {big} is capped at the model's max_seq_len {CFG['max_seq_len']}" in capsys.readouterr().err
    # the closing line's hit rate: experts found cached; right prefetch guesses (read from the disk) apart (they were
    # counted as hits: 0.73 on a run whose reads left 0.38 of the lookups unread)
    real_stats = EC.ExpertCache.stats
    monkeypatch.setattr(EC.ExpertCache, "stats", lambda self: dict(real_stats(self), lookups=100, hits=38,
                                                                   prefetch_hits=35, hit_rate=0.73, cache_hit_rate=0.38))
    assert S.main([path, "--prompt", "hello", "--max-new-tokens", "4"]) == 0
    assert "expert hit rate 0.380 (+0.350 right guesses, read ahead)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tok_container(tmp_path_factory):
    """(tokenizer, path) of a small random container that carries a tokenizer."""
    import tokenizer as T
    tmp = tmp_path_factory.mktemp("tok")
    tok = T.train_tokenizer(["the hummingbird flies over the flowers, hello world"] * 40, 300)
    tok.save(str(tmp / "tok.json"))
    torch.manual_seed(0)
    ck = save_checkpoint(Picaflor(ModelConfig(**dict(CFG, vocab_size=tok.vocab_size, n_layer=2))), str(tmp / "run"), 1,
                         tokenizer_file=str(tmp / "tok.json"))
    C.write_container(ck, str(tmp / "t.pcf4"), group_size=32, progress=False)
    return tok, str(tmp / "t.pcf4")


def scripted_logits(monkeypatch, vocab_size, script):
    """The model's choices, scripted (then the last one again); the engine's own loop samples them greedily."""
    it = iter(script)

    def logits(self, h):
        out = torch.zeros(h.shape[0], vocab_size)
        out[:, next(it, script[-1])] = 1.0
        return out
    monkeypatch.setattr(S.Engine, "logits", logits)


def test_cli_generation_stops_at_every_special_token_as_the_exports_do(tok_container, monkeypatch, capsys):
    """The command line stopped at <|bos|> only: a chat model's answer ran on past <|end|> into a turn it made up
    (<|user|> ...), the specials dropped from the text, so the turns printed as one answer. It stops at every special
    token now, as chat.py and the HF and GGUF exports' generation do (export.GENERATION_STOPS)."""
    tok, path = tok_container
    for name in ("<|end|>", "<|user|>", "<|bos|>"):
        script = tok.encode(" world") + [tok.special_ids[name]] + tok.encode(" hello the flowers")
        scripted_logits(monkeypatch, tok.vocab_size, script)
        assert S.main([path, "--prompt", "hello", "--max-new-tokens", str(len(script))]) == 0
        assert capsys.readouterr().out == "hello world\n", name


def test_cli_streamed_text_is_the_decoded_text_of_characters_split_across_tokens(tok_container, monkeypatch, capsys):
    """What the command line writes token by token adds up to the decoded answer: characters of 2 to 4 UTF-8 bytes
    cut across byte tokens (ids 1..256), a byte that starts no character, an id with no text (0), the tail held back
    until the answer ends."""
    tok, path = tok_container
    text = "caf\u00e9 \u2615\U0001f642 na\u00efve"
    script = [b + 1 for b in text.encode()] + [0x80 + 1] + tok.encode(" hello") + [0, 0xf0 + 1, 0x9f + 1]
    scripted_logits(monkeypatch, tok.vocab_size, script)
    assert S.main([path, "--prompt", "hello", "--max-new-tokens", str(len(script))]) == 0
    want = tok.decode_generated(script)
    assert want.startswith(text + "\ufffd hello\ufffd") and capsys.readouterr().out == "hello" + want + "\n"


def test_cli_answer_control_characters_are_escaped_on_a_terminal_and_exact_in_a_file(tok_container, monkeypatch):
    """The command line wrote the model's text raw: its ESC sequences (random weights, a hostile fine-tune) cleared
    the screen, wrote the clipboard (OSC 52), overwrote the line (\\r). On a terminal every control character but
    \\n and \\t is shown as \\x1b now, even a sequence cut across tokens; piped to a file, the exact text."""
    import io
    tok, path = tok_container
    hostile = "a\x1b[2J\x1b]52;c;cm0gLXJm\x07ok\rX\tY\nZ\u009b31m"  # CSI, OSC 52 + BEL, \r, C1 CSI
    ids = [b + 1 for b in hostile.encode()] + [0xff + 1]  # one byte token each (ids 1..256); a lone byte: U+FFFD
    monkeypatch.setattr(S.Engine, "stream", lambda self, *a, **k: iter(ids))
    for tty in (True, False):
        out = type("Out", (io.StringIO,), {"isatty": lambda self, tty=tty: tty})()
        monkeypatch.setattr(sys, "stdout", out)
        assert S.main([path, "--prompt", "hello", "--max-new-tokens", str(len(ids))]) == 0
        want = ("hello" + "a\\x1b[2J\\x1b]52;c;cm0gLXJm\\x07ok\\x0dX\tY\nZ\\x9b31m" if tty else "hello" + hostile)
        assert out.getvalue() == want + "\ufffd\n", repr(out.getvalue())


def test_cli_output_the_terminal_cannot_encode_is_shown_not_a_traceback(tmp_path, monkeypatch):
    """A stdout whose encoding lacks a character of the prompt or the answer (an emoji in Latin-1, U+FFFD in ASCII):
    a UnicodeEncodeError traceback mid-answer. Such a character shows as '?' now (as chat.py does), and it goes on."""
    import io
    import tokenizer as T
    tok = T.train_tokenizer(["the hummingbird flies over the flowers, hello world"] * 40, 300)
    tok.save(str(tmp_path / "tok.json"))
    ck = save_checkpoint(Picaflor(ModelConfig(**dict(CFG, vocab_size=tok.vocab_size, n_layer=2))),
                         str(tmp_path / "run"), 1, tokenizer_file=str(tmp_path / "tok.json"))
    path = str(tmp_path / "t.pcf4")
    C.write_container(ck, path, group_size=32, progress=False)
    monkeypatch.setattr(S.Engine, "stream", lambda self, ids, n, *a, **k: iter(tok.encode(" \U0001f642 world") + [0]))
    for encoding in ("latin-1", "ascii"):
        out = io.TextIOWrapper(io.BytesIO(), encoding=encoding, write_through=True)
        monkeypatch.setattr(sys, "stdout", out)
        assert S.main([path, "--prompt", "caf\u00e9 \U0001f642", "--max-new-tokens", "4"]) == 0
        text = out.buffer.getvalue().decode(encoding)
        assert text.startswith(("caf\u00e9 ?" if encoding == "latin-1" else "caf? ?") + " ? world?"), text


def test_tokenizer_loads_inside_the_budget_and_a_broken_one_is_named(tmp_path, monkeypatch, capsys):
    """The CLI loaded the tokenizer after the budget had measured the process (a 32K vocab's tables came out of the
    working slack), and a tokenizer that did not load was taken for none: prompt bytes became token ids."""
    import tokenizer as T
    tok = T.train_tokenizer(["the hummingbird flies over the flowers, hello world"] * 40, 300)
    tok.save(str(tmp_path / "tok.json"))
    ck = save_checkpoint(Picaflor(ModelConfig(**dict(CFG, vocab_size=tok.vocab_size))), str(tmp_path / "run"), 1,
                         tokenizer_file=str(tmp_path / "tok.json"))
    path = str(tmp_path / "t.pcf4")
    C.write_container(ck, path, group_size=32, progress=False)
    events, real_rss, real_tok = [], S.rss_bytes, S.load_tokenizer
    monkeypatch.setattr(S, "rss_bytes", lambda: events.append("rss") or real_rss())
    monkeypatch.setattr(S, "load_tokenizer", lambda *a: events.append("tokenizer") or real_tok(*a))
    eng = S.load(path, ram_budget="2G")
    assert events[0] == "tokenizer" and eng.tokenizer.encode("hello") == tok.encode("hello")
    real_load = C.load_container

    def broken(p):
        c = real_load(p)
        c.tokenizer_json = '{"format": "picaflor-tiktoken"'
        return c
    monkeypatch.setattr(C, "load_container", broken)
    assert S.main([path, "--prompt", "hello", "--max-new-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and path in err[0] and "tokenizer" in err[0] and "re-export" in err[0], err


def test_interleaved_requests_leave_the_engines_own_experts_per_token(tiny):
    """Each request captured the MoE layers' top_k before it and put that back after: one that started while another
    held k = 1 restored 1 for good, and a later forward() (chat.py's backend calls it directly) routed with it."""
    m, path = tiny
    eng = S.load(path)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = eng.logits(eng.forward(ids))
    g1 = eng.stream([5, 6, 7], 3, experts_per_token=1)
    next(g1)
    g2 = eng.stream([5, 6, 7], 3)
    next(g2)
    list(g1)
    list(g2)
    assert [moe.top_k for moe in eng.moes] == [CFG["top_k"]] * len(eng.moes)
    assert torch.equal(eng.logits(eng.forward(ids)), before)
    eng.set_experts_per_token(1)  # the engine's own setting: forward() and the steps after any request use it
    one = eng.logits(eng.forward(ids))
    eng.generate([5, 6, 7], 2, experts_per_token=2)
    eng.loglikelihood([5, 6], [7, 8])
    assert [moe.top_k for moe in eng.moes] == [1] * len(eng.moes) and torch.equal(eng.logits(eng.forward(ids)), one)


def test_ctrl_c_in_a_benchmark_removes_its_cgroup(tiny, monkeypatch, capsys):
    """Ctrl-C while the benchmark child ran: a traceback, and its memory cgroup was left behind for good."""
    import subprocess as sp
    m, path = tiny
    made, real_run, real_cg = [], sp.run, B.limited_cgroup

    def cgroup(budget):
        cg = real_cg(budget)
        made.append(cg[0])
        return cg

    def interrupted(*a, **k):
        if "preexec_fn" in k:  # the benchmark child (not the memory-bandwidth probe)
            raise KeyboardInterrupt
        return real_run(*a, **k)
    monkeypatch.setattr(B, "limited_cgroup", cgroup)
    monkeypatch.setattr(sp, "run", interrupted)
    assert S.main([path, "--bench", "--ram-budget", "3G", "--max-new-tokens", "2", "--bench-prompt-tokens", "4"]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert made and all(cg is None or not os.path.exists(cg) for cg in made)
    # SIGTERM (a supervisor's stop) in a sweep: as Ctrl-C, the sweep stops (it went on to the next budget) and no
    # cgroup is left
    import signal
    children = []

    def terminated(*a, **k):
        if "preexec_fn" in k:
            children.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # (the handler runs here)
        return real_run(*a, **k)
    monkeypatch.setattr(sp, "run", terminated)
    made.clear()
    before = signal.getsignal(signal.SIGTERM)
    assert S.main([path, "--sweep", "3G,4G", "--max-new-tokens", "2", "--bench-prompt-tokens", "4"]) == 130
    assert children == [1] and signal.getsignal(signal.SIGTERM) is before
    assert made and all(cg is None or not os.path.exists(cg) for cg in made)


def test_bench_cgroups_are_unique_and_removed_with_what_is_left_in_them(tmp_path):
    """A sweep named every budget's cgroup after the parent's pid: one left behind (EBUSY: a compiler the child
    started was still in it) made the next mkdir fail and that budget ran with no limit, unsaid. close_cgroup now
    ends what is left in it and removes it; a container on tmpfs is not disk-bound, whatever O_DIRECT says."""
    import subprocess as sp
    a, b = B.limited_cgroup(1 << 30), B.limited_cgroup(1 << 30)
    try:
        assert (a[0] is None) == (b[0] is None) and (a[0] is None or a[0] != b[0])
        if a[0] is not None:  # (root with a memory controller, as on CI: the bench's own case)
            left = sp.Popen(["sleep", "60"], preexec_fn=lambda: open(os.path.join(a[0], "cgroup.procs"), "w").write(
                str(os.getpid())))
            time.sleep(0.2)
            assert str(left.pid) in open(os.path.join(a[0], "cgroup.procs")).read().split()
            B.close_cgroup(a[0])
            assert left.wait(10) == -9 and not os.path.exists(a[0])
    finally:
        for cg in (a[0], b[0]):
            if cg and os.path.exists(cg):
                B.close_cgroup(cg)
    # a SIGKILLed bench's empty cgroup (its pid dead) is removed by the next one; a live bench's is left alone
    parent = tmp_path / "cg"
    for name in ("picaflor-bench-999999999-1", f"picaflor-bench-{os.getpid()}-7", "other-999999999-1"):
        (parent / name).mkdir(parents=True)
    B.remove_stale_cgroups(str(parent))
    assert sorted(os.listdir(parent)) == ["other-999999999-1", f"picaflor-bench-{os.getpid()}-7"]
    # and the bench's child dies with its parent (it ran on in the cgroup after a SIGKILL of the bench)
    code = ("import os, subprocess, sys, time; sys.path.insert(0, sys.argv[1]); import stream_bench as B; "
            "p = subprocess.Popen(['sleep', '60'], preexec_fn=B.die_with_parent); print(p.pid, flush=True); "
            "time.sleep(60)")
    parent_proc = sp.Popen([sys.executable, "-c", code, ROOT], stdout=sp.PIPE, text=True)
    child = int(parent_proc.stdout.readline())
    parent_proc.kill()
    parent_proc.wait()
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{child}") and open(f"/proc/{child}/stat").read().split()[2] != "Z":
        assert time.time() < deadline, "the child outlived its killed parent"
        time.sleep(0.05)
    # an overlay is what its layers sit on: over tmpfs it was reported as disk-bound (O_DIRECT works there)
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mounts").write_text("/dev/vda / ext4 rw 0 0\ntmpfs /mem tmpfs rw 0 0\n"
                                 "overlay /ovl overlay rw,lowerdir=/mem/lower,upperdir=/mem/upper,workdir=/mem/w 0 0\n"
                                 "overlay /disk-ovl overlay rw,lowerdir=/a:/b,upperdir=/c,workdir=/d 0 0\n")
    real_proc = S.PROC_SELF
    try:
        S.PROC_SELF = str(proc)
        assert B.filesystem_type("/ovl/model.pcf4") == "tmpfs" and B.filesystem_type("/disk-ovl/m.pcf4") == "overlay"
    finally:
        S.PROC_SELF = real_proc
    shm = "/dev/shm"
    if B.filesystem_type(shm) == "tmpfs":  # Linux: /dev/shm is memory
        assert B.filesystem_type(os.path.join(shm, "no", "such", "file")) in B.RAM_FILESYSTEMS
    assert B.filesystem_type(str(tmp_path)) == B.filesystem_type(os.path.join(str(tmp_path), "x"))


def test_a_bench_budget_below_python_and_torch_is_one_line(tiny, capsys):
    """Below what the interpreter and torch take, the benchmark child was OOM-killed importing torch inside its cgroup
    and the run said only 'killed (out of memory inside the cgroup?)'."""
    m, path = tiny
    assert S.main([path, "--bench", "--ram-budget", "50M", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "below the" in err and "python and torch alone" in err and len(err.strip().splitlines()) == 1
    # with the figure a plain run gives (it said "raise it" alone; --sweep's budgets take this same check)
    assert S.main([path, "--ram-budget", "50M", "--prompt", "1,2,3"]) == 1
    plain = re.search(r"raise it to at least (\d+)M$", capsys.readouterr().err.strip())
    bench = re.search(r"; raise it to at least (\d+)M$", err.strip())
    assert bench and abs(int(bench.group(1)) - int(plain.group(1))) <= 4, err  # (each measures its own RSS)


def test_a_child_a_signal_ended_is_said_out_of_memory_only_in_a_cgroup():
    """stream_bench said any child a signal ended was "killed (out of memory inside the cgroup?)", with no cgroup
    limit applied or for a SIGSEGV; vs_llamacpp's table cell said "killed (OOM)" for a SIGKILL with no limit."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import vs_llamacpp as V
    assert B.signal_reason(9, True) == "killed (out of memory in the cgroup)"
    assert "out of memory" not in B.signal_reason(9, False) and "SIGKILL" in B.signal_reason(9, False)
    assert B.signal_reason(11, True) == B.signal_reason(11, False) == "crashed (SIGSEGV)"
    assert V.short_error(V.exit_reason(-9, "", False)) == "SIGKILL"
    assert V.short_error(V.exit_reason(-9, "", True)) == "killed (OOM)"


def test_bench_latency_percentiles_are_nearest_rank(tiny):
    """p50 / p99 token latency by nearest rank: int(q * n) took the rank above it, so of 2 decode tokens p50 was the
    slower one (= p99), and of 100 tokens p99 was the slowest."""
    m, path = tiny
    eng = S.load(path, preload=False)
    real, fake = eng.stream, {}

    def stream(*a, timings=None, **k):  # the real decode, then the latencies this test names
        yield from real(*a, timings=timings, **k)
        timings[1:] = fake["lat"]
    eng.stream = stream
    for lat, p50, p99 in (([0.003, 0.001], 0.001, 0.003), ([0.001], 0.001, 0.001),
                          ([i / 1000 for i in range(100, 0, -1)], 0.050, 0.099), ([0.1, 0.2, 0.3], 0.2, 0.3)):
        fake["lat"] = lat
        res = B.run_bench(eng, n_prompt=4, n_new=len(lat) + 1)
        assert (res["p50_token_latency_s"], res["p99_token_latency_s"]) == (p50, p99), lat


def test_bench_cgroup_limit_join_and_child_refusal_are_said(tiny, tmp_path, monkeypatch, capsys):
    """A cgroup whose limit the kernel refused was reported as limited (the write raised at a garbage-collected close,
    unheard); a child that could not join its cgroup was a SubprocessError traceback; a child's refusal was a row
    saying only "exit 1", tried again every --repeat round."""
    m, path = tiny
    for ver, name in (("v2", "memory.max"), ("v1", "memory.limit_in_bytes")):
        d = tmp_path / f"cg-{ver}"
        d.mkdir()
        (d / name).symlink_to("/dev/full")  # a write that fails when flushed (ENOSPC)
        with monkeypatch.context() as mp:
            mp.setattr(B, "cgroup_memory_dir", lambda: (str(d), ver))
            mp.setattr(B, "filesystem_type", lambda p: "cgroup2" if ver == "v2" else "cgroup")  # as the kernel's
            assert B.limited_cgroup(1 << 30) == (None, None), ver
    # a folder that is no cgroup (a tmpfs where the cgroup mount was expected) takes the limit and the pid as plain
    # files and limits nothing: not a cgroup, not reported as memory-limited
    for ver in ("v1", "v2"):
        d = tmp_path / f"plain-{ver}"
        d.mkdir()
        with monkeypatch.context() as mp:
            mp.setattr(B, "cgroup_memory_dir", lambda: (str(d), ver))
            assert B.limited_cgroup(1 << 30) == (None, None) and not d.exists(), ver
    # the child's pid not written into the cgroup: one line, the cgroup still closed
    bad = tmp_path / "cg-nojoin"
    (bad / "cgroup.procs").mkdir(parents=True)  # opening it for writing fails in the child, before exec
    closed = []
    with monkeypatch.context() as mp:
        mp.setattr(B, "limited_cgroup", lambda budget: (str(bad), "v2"))
        mp.setattr(B, "close_cgroup", lambda cg: closed.append(cg))
        assert S.main([path, "--bench", "--ram-budget", "3G", "--max-new-tokens", "2", "--bench-prompt-tokens", "2"]) == 1
        err = [l for l in capsys.readouterr().err.splitlines() if l.strip() and not l.endswith("figures at the end")]
        assert len(err) == 1 and "could not move the benchmark child into the memory cgroup" in err[0], err
        assert closed == [str(bad)]
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        import types
        import vs_llamacpp as V
        args = types.SimpleNamespace(gguf=path, threads=1, tokens=2, prompt_tokens=2, max_seconds=5, seed=0)
        with pytest.raises(V.BenchError, match="could not move the llama.cpp child into the memory cgroup"):
            V.run_llama(args, 1 << 30, "mmap")
        assert closed == [str(bad)] * 2
    assert V.exit_reason(1, "warning\nerror: llama_decode failed\n", True) == "exit 1: error: llama_decode failed"
    assert V.exit_reason(2, "", True) == "exit 2: no message"
    # the child refuses (here: more experts a token than the model has, found only when decode starts): its reason
    # is the error, once, and a sweep's row holds it; the refused budget is not run again next round
    rows = tmp_path / "s.json"
    assert S.main([path, "--sweep", "3G", "--repeat", "2", "--experts-per-token", "99", "--max-new-tokens", "2",
                   "--bench-prompt-tokens", "2", "--json", str(rows), "--plot", str(tmp_path / "s.png")]) == 0
    err = capsys.readouterr().err
    assert err.count("--experts-per-token 99: must be in 1..16") == 1 and "exit 1" not in err, err
    assert "--experts-per-token 99: must be in 1..16" in json.loads(rows.read_text())[0]["error"]


def test_fallback_kernels_hand_freed_heap_back_near_the_budget(tiny, monkeypatch):
    """int4pack's repack per expert read leaves freed temporaries in glibc's heap, memory the budget never counted
    (micro at 1.5G peaked 1.55G; 1.39G with this): near the budget each expert built on the fallback kernels hands
    them back (malloc_trim); the native kernel, which makes none, never pays for it."""
    m, path = tiny
    calls = []
    monkeypatch.setattr(kernels, "release_freed_heap", lambda: calls.append(1))
    budget = S.rss_bytes() + (200 << 20)
    eng = S.load(path, ram_budget=budget, kernel="int4pack", preload=False)
    far = eng.generate([5, 6, 7, 8], 2)  # far from the budget: nothing to hand back
    assert not calls
    eng = S.load(path, ram_budget=budget, kernel="int4pack", preload=False)
    with monkeypatch.context() as near:
        near.setattr(S, "rss_bytes", lambda: budget)  # at the budget: every expert built hands memory back
        assert eng.generate([5, 6, 7, 8], 2) == far
    assert calls and len(calls) == eng.cache.stats()["misses"]


def test_int4pack_on_groups_it_cannot_take_is_budgeted_as_the_reference_path(tiny, tmp_path, monkeypatch):
    """--kernel int4pack runs the reference path for a group size torch's int4pack kernel does not take (16), but the
    budget counted neither that path's scratch nor its per-forward heap hand-back: a kv-heavy container of group 16
    at the budget its refusal named (445M) peaked at 468 MiB in a 4096-token loglikelihood."""
    m, _ = tiny
    path = str(tmp_path / "g16.pcf4")
    C.write_container(save_checkpoint(m, str(tmp_path / "run"), 1), path, group_size=16, progress=False)
    budget = S.rss_bytes() + (200 << 20)
    ref = S.load(path, ram_budget=budget, kernel="reference", prefetch=False)
    eng = S.load(path, ram_budget=budget, kernel="int4pack", prefetch=False)
    assert eng.working_bytes == ref.working_bytes
    calls = []
    monkeypatch.setattr(kernels, "release_freed_heap", lambda: calls.append(1))
    monkeypatch.setattr(S, "rss_bytes", lambda: budget)  # at the budget: each forward hands memory back
    assert eng.generate([5, 6, 7, 8], 2) == ref.generate([5, 6, 7, 8], 2)
    assert len(calls) >= 2


def test_review_round_a_failed_read_and_ctrl_c_leave_no_stale_read_behind(tiny):
    """Helper-53's review: settle stopped at the first failed read, leaving the others in flight (one raised its
    error later, from an unrelated request's eviction); Ctrl-C landing after a read was queued put its buffer back
    as free while the read still ran, so the next miss read another expert into it and kept the wrong bytes."""
    import time
    m, path = tiny
    eng = S.load(path, prefetch=False, preload=False)
    c = eng.cache
    c.native_reads = False  # the Python readers, which this test can slow down and break per expert
    c.budget = 6 * c.nbytes
    read = c.c.read_expert_part

    def slow_or_broken(layer, e, *a):
        if (layer, e) == (1, 0):
            raise C.ContainerError("injected read error")
        if (layer, e) == (2, 0):
            time.sleep(0.5)
        return read(layer, e, *a)
    c.c.read_expert_part = slow_or_broken
    c.request([(1, 0), (1, 1), (1, 2)], set())
    assert list(c.inflight) == [(1, 0), (1, 1), (1, 2)]
    with pytest.raises(C.ContainerError, match="injected read error"):
        c.settle()
    assert not c.inflight and set(c.entries) == {(1, 1), (1, 2)} and c.used <= c.budget
    x = torch.randn(1, eng.cfg.d_model)
    cont = C.load_container(path)
    want = lambda key: S.Expert(cont, cont.read_expert_blob(*key), eng.kernel)(x)  # noqa: E731

    class CtrlCAfterQueueing(set):  # the signal handler runs at the bytecode after the read was queued
        armed = True

        def add(self, key):
            if self.armed and key == (2, 0):
                CtrlCAfterQueueing.armed = False
                raise KeyboardInterrupt
            super().add(key)
    c.read_keys = CtrlCAfterQueueing(c.read_keys)
    with pytest.raises(KeyboardInterrupt):
        c.get((2, 0), {(2, 0)})
    got = c.get((2, 1), {(2, 1)})
    time.sleep(1.0)  # (2, 0)'s slow read has landed by now, wherever it went
    assert torch.equal(got(x), want((2, 1))) and c.used <= c.budget
    assert torch.equal(c.get((2, 0), {(2, 0)})(x), want((2, 0)))


@pytest.mark.parametrize("native", [True, False])
def test_ctrl_c_mid_generation_drops_the_queued_reads(tiny, monkeypatch, capsys, native):
    """Ctrl-C while a prompt's expert reads sat queued on a slow disk waited for every one of them (the stream's
    settle; and a native wait, uninterruptible, until the read it waited for landed): seconds under a small budget.
    Now it is raised within a wait slice (on Python's readers once the read waited for lands), the reads not started
    never run, the CLI exits 130 with one line and no traceback, and the engine still gives the right tokens."""
    import _thread
    import threading
    m, path = tiny
    ops = kernels.native_reader()
    assert ops is not None, "expert_reader.cpp did not build: install g++ and ninja"
    delay = [0.5 if native else 0.3]  # seconds per read (native: up to 4 reader threads at once)
    engines, started, fired = [], [], []
    real_load, read, submit = S.load, C.Container.read_expert_part, EC.ExpertCache._submit

    def load(*a, **kw):
        eng = real_load(*a, **kw)
        eng.cache.native_reads = native
        engines.append(eng)
        return eng

    def slow(self, layer, e, *a):  # the Python readers' slow disk
        started.append((layer, e))
        time.sleep(delay[0])
        return read(self, layer, e, *a)

    def ctrl_c():
        fired.append(time.perf_counter())
        _thread.interrupt_main()

    def submit_then_ctrl_c(self, key):  # Ctrl-C 0.1 s after the first read is queued
        submit(self, key)
        if len(self.inflight) == 1 and not fired:
            threading.Timer(0.1, ctrl_c).start()
    monkeypatch.setattr(S, "load", load)
    monkeypatch.setattr(C.Container, "read_expert_part", slow)
    monkeypatch.setattr(EC.ExpertCache, "_submit", submit_then_ctrl_c)
    prompt = list(range(1, 25))
    capsys.readouterr()
    ops.reader_delay_us(0, int(delay[0] * 1e6))
    # Python's own Ctrl-C: a handler an earlier in-process test left (a guardian's, a trainer's) took the interrupt
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rc = S.main([path, "--no-preload", "--prefetch", "off", "--readers", "1", "--threads", "1",
                     "--max-new-tokens", "4", "--prompt", ",".join(map(str, prompt))])
        c = engines[0].cache
        EC._wait_reads_in_flight()  # what exit waits for (atexit; Python's pool joins its threads): those being read
        while c.active_reads:
            time.sleep(0.01)
        stopped = time.perf_counter() - fired[0]
        time.sleep(delay[0] + 0.1)
    finally:
        ops.reader_delay_us(0, 0)
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert rc == 130 and err.strip() == "stream_infer: interrupted" and "Traceback" not in err, err
    assert c.reads >= 8 and stopped < delay[0] + 0.6, (c.reads, stopped)  # all of them: 2-8 s
    assert not c.inflight and not c.guesses
    if not native:
        assert len(started) <= 3, started  # the one waited for, the one being read; the queued ones never ran
    delay[0] = 0
    assert engines[0].generate(prompt, 4) == real_load(path).generate(prompt, 4)


def test_reference_kernel_stays_under_the_budget_it_accounts_for(tiny, tmp_path, monkeypatch):
    """--kernel reference dequantized a whole matrix per call: a tied int4 lm_head was three fp32 copies at once (the
    codes as floats, minus 8, times the scales), which the budget counted as two, and glibc's heap kept the
    forward's copies under them: 160 MiB over a budget the engine accepted. Now a chunk of rows at a time, counted:
    with a budget of exactly what the engine accounts for (+ 2 MiB), in a subprocess, generation stays under it;
    the chunks (ragged last one, padded rows) give the whole matrix's product."""
    m, tiny_path = tiny
    monkeypatch.setattr(kernels, "REFERENCE_CHUNK", 4096)  # 32-row chunks here
    torch.manual_seed(0)
    w, x = torch.randn(100, 90), torch.randn(3, 90)
    p, sz = C.quantize_int4(w, 30)
    q, scale = C.quantize_int8(w)
    want4, want8 = x @ C.dequantize_int4(p, sz, w.shape, 30).t(), x @ C.dequantize_int8(q, scale, w.shape).t()
    for got, want in ((kernels.int4_matmul_reference(x, p, sz, w.shape, 30), want4),
                      (kernels.int8_matmul_reference(x, q, scale, w.shape), want8)):
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max()
    monkeypatch.undo()
    cfg = ModelConfig(vocab_size=16384, n_layer=2, n_dense_layers=1, d_model=2048, n_head=16, n_kv_head=4,
                      dense_ffn=64, n_experts=4, expert_ffn=64, n_shared=1, top_k=2, max_seq_len=64,
                      tie_embeddings=True)
    path = str(tmp_path / "tied4.pcf4")
    C.write_container(None, path, group_size=32, embed_bits=4, progress=False, source=C.RandomSource(cfg, direct=True))
    code = f"""
import sys, json, torch
sys.path.insert(0, {ROOT!r})
torch.set_num_threads(1)
import stream_infer as S
S.load({tiny_path!r}, kernel="reference").generate([1, 2], 2)  # pages in torch's kernels (a small model)
e = S.load({path!r}, ram_budget="3G", kernel="reference", context=64)
budget = e.resident_rss + e.kv_bytes + e.working_bytes + e.every_expert_bytes + (2 << 20)
del e
eng = S.load({path!r}, ram_budget=budget, kernel="reference", context=64)
eng.generate([1, 2, 3], 2)
print(json.dumps(dict(budget=budget, peak=S.peak_rss_bytes())))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.splitlines()[-1])
    assert res["peak"] <= res["budget"], (res["peak"] - res["budget"]) / 2**20


def test_api_seed_is_checked_like_the_command_lines(tiny):
    """stream() checked temperature and top_p but not seed (check_sampling takes it; only the command line passed
    it): seed=2**64, '3', 1.5 or True reached torch.Generator.manual_seed, a bare ValueError / RuntimeError from deep
    inside instead of a one-line StreamError; -1 passed here while the command line refused it."""
    m, path = tiny
    eng = S.load(path)
    for seed in (2 ** 64, "3", 1.5, True, -1):
        with pytest.raises(S.StreamError, match="seed"):
            eng.generate([5, 6], 3, temperature=0.8, seed=seed)
    assert eng.kv_free == eng.context
    assert eng.generate([5, 6], 3, temperature=0.8, seed=2 ** 63 - 1) == eng.generate([5, 6], 3, temperature=0.8,
                                                                                         seed=2 ** 63 - 1)


def test_top_p_keeps_the_smallest_set_reaching_it(tiny, monkeypatch):
    """top_p keeps the smallest set of tokens whose mass reaches it (as sample_next's comment and transformers'
    TopPLogitsWarper): a token whose predecessors already held exactly top_p was kept too (cum - p > top_p), so with
    p = [0.5, 0.25, 0.25] top_p 0.5 sampled token 1 as well, and over two equally likely tokens top_p 0.5 did nothing."""
    import math
    m, path = tiny
    eng = S.load(path)
    V = eng.cfg.vocab_size
    # (the first logits, the rest -inf), top_p, how many tokens it may sample (which of equal ones: the sort's call)
    for head, top_p, n in (([math.log(2), 0.0, 0.0], 0.5, 1), ([0.0, 0.0], 0.5, 1), ([0.0] * 4, 0.5, 2),
                           ([0.0] * 4, 0.75, 3), ([0.0] * 4, 0.8, 4), ([0.0] * 4, 1.0, 4)):
        logits = torch.full((1, V), float("-inf"))
        logits[0, :len(head)] = torch.tensor(head)
        monkeypatch.setattr(eng, "logits", lambda h, lg=logits: lg.clone())
        seen = {eng.generate([5, 6], 1, temperature=1.0, top_p=top_p, seed=s)[0] for s in range(60)}
        assert len(seen) == n and seen <= set(range(len(head))), (head, top_p, seen)
    assert seen == set(range(4))


def test_a_top_p_below_float32s_smallest_number_samples_the_most_likely_token(tiny):
    """top_p is compared with float32 masses: 1e-46 (which check_sampling takes, being > 0) compared as 0, every token
    was dropped, and torch.multinomial raised on the NaN probabilities (a traceback from the command line). The most
    likely token always stays in the nucleus."""
    m, path = tiny
    eng = S.load(path)
    for top_p in (1e-46, 1e-300):
        assert eng.generate([5, 6], 3, temperature=1.0, top_p=top_p, seed=0) == eng.generate([5, 6], 3)


def test_vs_llamacpp_records_whether_its_page_cache_drop_worked(tmp_path, monkeypatch):
    """vs_llamacpp dropped the GGUF's page cache and recorded page_cache_dropped=True whatever stayed cached (a tmpfs
    keeps every page): now the count after the drop (mincore) is recorded and decides it."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import types
    import vs_llamacpp as V
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(os.urandom(1 << 20))
    args = types.SimpleNamespace(gguf=str(gguf), threads=1, tokens=2, prompt_tokens=2, max_seconds=5, seed=0)
    res = V.run_llama(args, None, "mmap")  # the child fails (no llama_cpp here, or no GGUF): the drop is still recorded
    left = res["page_cache_resident_after_drop_bytes"]
    assert left is not None and res["page_cache_dropped"] == (left <= 0.01 * (1 << 20)), res
    monkeypatch.setattr(B, "page_cache_resident_bytes", lambda p: 1 << 20)  # as on a tmpfs: every page stayed
    res = V.run_llama(args, None, "mmap")
    assert res["page_cache_resident_after_drop_bytes"] == 1 << 20 and res["page_cache_dropped"] is False, res


class CtrlCAsBlobReadReturns:
    """expert_reader's ops, but the first blob_read raises KeyboardInterrupt after it queued its parts (a SIGINT that
    arrived during the op is raised as it returns to Python), or with before=True before it queued anything."""

    def __init__(self, ops, before=False):
        self.ops, self.armed, self.before = ops, True, before

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def blob_read(self, *a):
        if not self.before:
            self.ops.blob_read(*a)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        if self.before:
            self.ops.blob_read(*a)


def test_ctrl_c_as_a_native_read_is_queued_keeps_its_buffer_until_it_lands(tiny):
    """NativeRead took any exception out of blob_read for 'nothing was queued' and let go of its buffer: a Ctrl-C
    raised as the op returned (the parts queued) put the buffer back while the readers still wrote into it, so
    the next miss read another expert into it and the late parts overwrote it after its crc passed (chat.py goes
    on after a Ctrl-C)."""
    import mmap
    m, path = tiny
    ops = kernels.native_reader()
    assert ops is not None, "expert_reader.cpp did not build: install g++ and ninja"
    cont = C.load_container(path)
    EC.NativeRead(cont, (1, 0), mmap.mmap(-1, cont.expert_nbytes), 0, 8, ops).result()  # 8 demand readers
    eng = S.load(path, prefetch=False, preload=False)
    c = eng.cache
    c.budget = 2 * c.nbytes
    x = torch.randn(1, eng.cfg.d_model)
    c.reader_ops = CtrlCAsBlobReadReturns(ops)
    ops.reader_delay_us(0, 400_000)  # a slow disk for the interrupted read's parts
    try:
        with pytest.raises(KeyboardInterrupt):
            c.get((1, 0), set())
        time.sleep(0.1)  # its parts are being read
        ops.reader_delay_us(0, 0)
        got = c.get((1, 1), set())  # on the other readers, into a buffer nobody writes into
        time.sleep(0.6)  # the interrupted read has landed by now, wherever it went
    finally:
        ops.reader_delay_us(0, 0)
    assert torch.equal(got(x), S.Expert(cont, cont.read_expert_blob(1, 1), eng.kernel)(x))
    assert not EC._READS_IN_FLIGHT and c.used <= c.budget
    assert torch.equal(c.get((1, 0), set())(x), S.Expert(cont, cont.read_expert_blob(1, 0), eng.kernel)(x))
    c.reader_ops = CtrlCAsBlobReadReturns(ops, before=True)  # nothing queued: no wait for it hangs
    with pytest.raises(KeyboardInterrupt):
        c.get((1, 2), set())
    assert not EC._READS_IN_FLIGHT and c.used <= c.budget
    assert torch.equal(c.get((1, 2), set())(x), S.Expert(cont, cont.read_expert_blob(1, 2), eng.kernel)(x))


def assert_no_buffer_outside_the_count_and_reads_right(c, eng, path, key, waits=False, before_read=None):
    """The Ctrl-C tests' check: every buffer the cache holds views over is in its count (entries and free buffers;
    waits: slots, guesses and reads in flight too), then `key` reads back as the container's bytes, within budget."""
    counted = {id(e.buf) for e in c.entries.values()} | {id(b) for b in c.free_bufs}
    if waits:
        counted |= ({id(b) for b in c.slot_bufs} | {id(buf) for _, buf in c.guesses.values()}
                    | {id(buf) for *_, buf in c.inflight.values()})
    assert set(c.views_of_buf) <= counted, "a buffer held outside the cache's count"
    if before_read:
        before_read()
    x = torch.randn(1, eng.cfg.d_model)
    cont = C.load_container(path)
    assert torch.equal(c.get(key, set())(x), S.Expert(cont, cont.read_expert_blob(*key), eng.kernel)(x))
    assert c.used <= c.budget and len(c.views_of_buf) * c.nbytes <= c.used


def test_ctrl_c_while_a_landed_read_becomes_an_expert_leaves_no_buffer_outside_the_count(tiny):
    """_finish's cleanup covered only the wait: a Ctrl-C (or any error) while the landed buffer was made an expert
    (make_expert: ~0.1 ms of Python on the fallback kernels) left the buffer held by its views record for good, in
    no count (3.5 MB per Ctrl-C for the rest of a chat session, outside the budget)."""
    m, path = tiny
    eng = S.load(path, prefetch=False, preload=False)
    c = eng.cache
    assert c.reuse_views
    c.budget = 2 * c.nbytes
    c.get((1, 0), set())
    c.get((1, 1), set())
    real = c.make_expert

    def interrupted(buf, views):
        raise KeyboardInterrupt
    c.make_expert = interrupted
    with pytest.raises(KeyboardInterrupt):
        c.get((1, 2), set())  # evicts (1, 0), reads into its buffer, then Ctrl-C
    c.make_expert = real
    assert_no_buffer_outside_the_count_and_reads_right(c, eng, path, (1, 2))


def test_ctrl_c_while_a_miss_waits_for_a_guess_keeps_the_guess_counted(tiny):
    """A miss with no room but a guess's buffer waits for that guess's read (_drop_guess): the guess left the
    cache's books before the wait, so a Ctrl-C there (the decoding thread waits on the disk: where a Ctrl-C lands)
    left its buffer held by its views record in no count, for good (outside the budget)."""
    import _thread
    import threading
    m, path = tiny
    eng = S.load(path, prefetch=False, preload=False)
    c, ops = eng.cache, kernels.native_reader()
    assert c.native_reads, "expert_reader.cpp did not build: install g++ and ninja"
    c.budget = 4 * c.nbytes
    c.set_slots(2)
    for e in range(4):
        c.get((1, e), set())
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a handler an earlier test left)
    ops.reader_delay_us(1, 1_000_000)  # a slow guess
    try:
        c.guess([(2, 0)], set())  # its buffer: (1, 0)'s, evicted for the slot
        assert list(c.guesses) == [(2, 0)] and (1, 0) not in c.entries
        threading.Timer(0.2, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            c.get((1, 4), {(1, 1), (1, 2), (1, 3), (1, 4)})  # room only in the guess's buffer: waits for it
    finally:
        ops.reader_delay_us(1, 0)
        signal.signal(signal.SIGINT, previous)
    # then c.cancel(), what the engine does on Ctrl-C; then the cache goes on
    assert_no_buffer_outside_the_count_and_reads_right(c, eng, path, (1, 4), waits=True, before_read=c.cancel)


def test_ctrl_c_mid_eviction_leaves_no_buffer_outside_the_count(tiny):
    """_evict takes the entry out before it checks who holds the expert's tensors (Python: a Ctrl-C is raised there
    too): a Ctrl-C then left the buffer held by its views record in no count, for good."""
    m, path = tiny
    eng = S.load(path, prefetch=False, preload=False)
    c = eng.cache
    assert c.reuse_views
    c.budget = 2 * c.nbytes
    c.get((1, 0), set())
    c.get((1, 1), set())

    def interrupted(rec):
        raise KeyboardInterrupt
    c._view_refs = interrupted
    with pytest.raises(KeyboardInterrupt):
        c.get((1, 2), set())  # evicts (1, 0)
    del c._view_refs
    assert_no_buffer_outside_the_count_and_reads_right(c, eng, path, (1, 2))


class CtrlCAsBlobWaitLands:
    """expert_reader's ops, but the first blob_wait that returns a landed read raises KeyboardInterrupt as it returns:
    a SIGINT that arrived while the decoding thread waited (a native wait is not interrupted: the signal is raised
    when the op returns, so in the wait's last slice whenever the read lands within one)."""

    def __init__(self, ops):
        self.ops, self.armed = ops, True

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def blob_wait(self, *a):
        got = self.ops.blob_wait(*a)
        if self.armed and got[0] != -1:
            self.armed = False
            raise KeyboardInterrupt
        return got


def test_ctrl_c_raised_as_a_native_wait_returns_loses_no_read(tiny):
    """blob_wait forgot a ticket when it returned its landed status: a Ctrl-C raised as it returned lost the status,
    and the guess it was waited for (settle) stayed in the cache with a ticket the readers no longer knew: the next
    token's guess() asked whether it was done and raised 'blob_wait: unknown ticket'."""
    m, path = tiny
    ops = kernels.native_reader()
    assert ops is not None, "expert_reader.cpp did not build: install g++ and ninja"
    eng = S.load(path, prefetch=False, preload=False)
    c = eng.cache
    c.budget = 8 * c.nbytes
    c.set_slots(2)
    c.reader_ops = CtrlCAsBlobWaitLands(ops)
    c.guess([(2, 0), (2, 1)], set())
    with pytest.raises(KeyboardInterrupt):
        c.settle()  # Ctrl-C while it waits for the guesses
    c.guess([(3, 0)], set())  # the next token's guess: replaces a landed one
    c.settle()
    x = torch.randn(1, eng.cfg.d_model)
    cont = C.load_container(path)
    for key in list(c.guesses) + [(2, 0)]:
        assert torch.equal(c.get(key, {key})(x), S.Expert(cont, cont.read_expert_blob(*key), eng.kernel)(x)), key
    c.settle()
    assert not EC._READS_IN_FLIGHT and c.used <= c.budget


def bench_with_the_child_here(monkeypatch, mem_probe=lambda: 2e10, cgroup=(None, None)):
    """stream_bench's parent as it runs (S.main -> bench_in_cgroup), its child's code (bench_child) run in this process
    instead of a subprocess in a real cgroup, and the memory probe given: a second or two, no root."""
    import subprocess as sp
    seen, real_bench = {}, B.bench_in_cgroup

    def bench(args, argv):
        seen["args"] = args
        return real_bench(args, argv)

    real_run = sp.run

    def run(argv, env=None, preexec_fn=None, **k):
        if "PICAFLOR_BENCH_CHILD" not in (env or {}):  # not the child: the compiler's --version for the kernel's key
            return real_run(argv, env=env, preexec_fn=preexec_fn, **k)  # (run alone, this test failed on it)
        monkeypatch.setenv("PICAFLOR_BENCH_MEM_BW", env["PICAFLOR_BENCH_MEM_BW"])
        return sp.CompletedProcess(argv, B.bench_child(seen["args"], env["PICAFLOR_BENCH_CHILD"]))
    monkeypatch.setattr(B, "bench_in_cgroup", bench)
    monkeypatch.setattr(sp, "run", run)
    monkeypatch.setattr(B, "memory_bandwidth_elsewhere", lambda threads, nbytes: mem_probe())
    if cgroup is not None:
        monkeypatch.setattr(B, "limited_cgroup", lambda budget: cgroup)
    monkeypatch.setattr(B, "close_cgroup", lambda cg: None)


BENCH_ARGS = ["--max-new-tokens", "3", "--bench-prompt-tokens", "2", "--threads", "1"]


def test_swap_the_cgroup_cannot_shut_out_is_said_and_marks_the_result(tiny, tmp_path, monkeypatch, capsys):
    """A v2 cgroup whose memory.swap.max 0 the kernel refused (no swap accounting) limited RAM alone: with swap on,
    the child could hold more than the budget, the rest swapped out, and the result still read as under it. The
    limit is read back; swap on and not limited is a field, a warning and a mark in the sweep's tables."""
    m, path = tiny
    cg = tmp_path / "cg"
    (cg / "memory.swap.max").mkdir(parents=True)  # a write the kernel refuses (here: a folder)
    real_fs = B.filesystem_type
    monkeypatch.setattr(B, "cgroup_memory_dir", lambda: (str(cg), "v2"))
    monkeypatch.setattr(B, "filesystem_type", lambda p: "cgroup2" if p == str(cg) else real_fs(p))
    swaps, meminfo = tmp_path / "swaps", tmp_path / "meminfo"
    monkeypatch.setattr(B, "PROC_SWAPS", str(swaps), raising=False)
    monkeypatch.setattr(B, "PROC_MEMINFO", str(meminfo), raising=False)
    head = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
    swaps.write_text(head + "/swapfile                               file\t\t2097148\t\t0\t\t-2\n")
    meminfo.write_text("MemTotal:        8000000 kB\nSwapTotal:       2097148 kB\n")
    bench_with_the_child_here(monkeypatch, cgroup=None)  # (the real limited_cgroup, over the folder above)
    out = tmp_path / "b.json"
    assert S.main([path, "--bench", "--ram-budget", "3G", "--json", str(out)] + BENCH_ARGS) == 0
    res, err = json.loads(out.read_text()), capsys.readouterr().err
    assert res["memory_limited"] and res.get("swap_limited") is False and res.get("swap_past_budget") is True, res
    assert res["swap_total_bytes"] == 2097148 * 1024 and "swap is on" in err and "NOT under --ram-budget" in err, err
    assert B.swap_total_bytes() == 2097148 * 1024 and not B.swap_limited(str(cg), "v2")
    row = dict(res, budget_str="3G", pct_of_bound=0.5)
    assert "| 3G (NOT under it: swap not limited) |" in B.sweep_markdown([row])
    # no swap on: nothing changes (no warning, no mark), limited or not
    swaps.write_text(head)
    meminfo.write_text("MemTotal:        8000000 kB\nSwapTotal:             0 kB\n")
    assert B.swap_total_bytes() == 0
    assert S.main([path, "--bench", "--ram-budget", "3G", "--json", str(out)] + BENCH_ARGS) == 0
    res, err = json.loads(out.read_text()), capsys.readouterr().err
    assert res["swap_past_budget"] is False and "swap" not in err, err
    assert "| 3G |" in B.sweep_markdown([dict(res, budget_str="3G", pct_of_bound=0.5)])
    # v2 with swap limited (the write taken) and v1 with memory + swap at the limit, or not settable
    (cg / "memory.swap.max").rmdir()
    assert B.limited_cgroup(1 << 30) == (str(cg), "v2") and B.swap_limited(str(cg), "v2")
    for memsw_refused in (False, True):
        d = tmp_path / f"v1-{memsw_refused}"
        d.mkdir()
        if memsw_refused:
            (d / "memory.memsw.limit_in_bytes").mkdir()
        monkeypatch.setattr(B, "cgroup_memory_dir", lambda: (str(d), "v1"))
        monkeypatch.setattr(B, "filesystem_type", lambda p: "cgroup")
        assert B.limited_cgroup(1 << 30) == (str(d), "v1") and B.swap_limited(str(d), "v1") is not memsw_refused


def test_the_bound_says_which_rule_set_its_disk_and_memory_figures(tiny, tmp_path, monkeypatch, capsys):
    """The bound takes the mean of the disk's two probes (or decode's own read rate when higher) but the faster of the
    memory's two: the result and the printed line gave the figures without the rules, and a reader took one rule
    for both. The figures are unchanged; each rule is a field, and printed beside them."""
    m, path = tiny
    mem = iter([3e10, 5e10])
    disk = iter([1e9, 2e9])
    monkeypatch.setattr(B, "measure_disk_bandwidth", lambda *a, **k: next(disk))
    bench_with_the_child_here(monkeypatch, mem_probe=lambda: next(mem))
    out = tmp_path / "b.json"
    assert S.main([path, "--bench", "--ram-budget", "3G", "--json", str(out)] + BENCH_ARGS) == 0
    res, (printed, err) = json.loads(out.read_text()), capsys.readouterr()
    # what it does before its figures, said first (a tiny model's --bench was silent for 20-30 s)
    assert err.startswith(f"stream_bench: {path} at --ram-budget 3G: a memory probe, then a child loads it, prefills "
                          f"2 tokens and decodes 3 in its own memory cgroup, then the probe again; figures at the "
                          f"end\n"), err
    assert res["disk_bw_decode_bytes_s"] is None and res["disk_bw_bytes_s"] == 1.5e9  # all preloaded: decode read none
    assert res["disk_bw_rule"] == "mean of before and after" and res["mem_bw_bytes_s"] == 5e10
    assert res["mem_bw_rule"] == "faster of before and after"
    assert "disk 1.50 GB/s (mean of before and after: before 1.00, after 2.00)" in printed, printed
    assert "memory 50.00 GB/s (faster of before and after: before 30.0, after 50.0)" in printed, printed
    md = B.sweep_markdown([dict(res, budget_str="3G", pct_of_bound=0.5)])
    assert "| 1.50 (mean of before and after; 1.00 / 2.00 / n/a) | 50.0 (faster of before and after; 30.0 / 50.0) |" \
        in md, md
    # decode's own reads ran faster than the probes' mean: that rate, said so
    monkeypatch.setattr(B, "measure_disk_bandwidth", lambda *a, **k: 1.0)
    eng = S.load(path, ram_budget=None, preload=False)
    eng.cache.budget = 5 * eng.container.expert_nbytes
    res = B.run_bench(eng, n_prompt=4, n_new=4, mem_bw=1e10)
    assert res["disk_bw_bytes_s"] == res["disk_bw_decode_bytes_s"] > 1.0
    assert res["disk_bw_rule"] == "decode's reads (faster than mean of before and after)"
    assert res["mem_bw_rule"] == "the parent's probe before loading"
    B.print_bench(res)
    assert "(decode's reads (faster than mean of before and after): before 0.00, after 0.00" in capsys.readouterr().out


def test_a_probe_that_fails_once_is_tried_again_and_twice_is_a_failure_not_a_refusal(tiny, tmp_path, monkeypatch,
                                                                                     capsys):
    """One disk probe's read failing (EINTR) or the memory probe's momentary ENOMEM made the whole budget a refusal:
    a sweep never ran it again. A probe is tried once more; failing twice, the run failed (with the error), and the
    next round runs the budget again."""
    m, path = tiny
    calls = {"mem": 0, "disk": 0}

    def mem_probe():
        calls["mem"] += 1
        if calls["mem"] == 1:
            raise S.StreamError("measuring memory bandwidth failed (exit 1): OSError: [Errno 12] Cannot allocate "
                                "memory")
        return 2e10
    real_disk = B.measure_disk_bandwidth

    def disk_probe(*a, **k):  # round 1: the probe before loading fails twice; round 2: the one after decode once
        calls["disk"] += 1
        if calls["disk"] in (1, 2, 4):
            raise C.ContainerError(f"{path}: read error at offset 4096: Interrupted system call; check the disk")
        return real_disk(*a, **k)
    monkeypatch.setattr(B, "measure_disk_bandwidth", disk_probe)
    bench_with_the_child_here(monkeypatch, mem_probe=mem_probe)
    monkeypatch.setattr(B, "plot_sweep", lambda *a: None)  # (the PNG: ~1 s, another test's)
    rows = tmp_path / "s.json"
    assert S.main([path, "--sweep", "3G", "--repeat", "2", "--json", str(rows), "--plot", str(tmp_path / "s.png")]
                  + BENCH_ARGS) == 0
    err = capsys.readouterr().err
    row = json.loads(rows.read_text())[0]
    assert calls == {"mem": 4, "disk": 5}, calls  # mem: 1 failed + 1 (round 1), 2 (round 2); disk: 2, then 1 + 2
    assert "error" not in row and len(row["runs"]) == 1 and row["decode_tok_s"] > 0, row
    assert len(row["failed_runs"]) == 1 and "the disk probe before loading failed twice" in row["failed_runs"][0]
    assert "Interrupted system call" in row["failed_runs"][0]
    assert "the memory probe before the child failed (" in err and "trying it once more" in err
    assert "the disk probe after decode failed (" in err


def test_a_sweep_row_run_without_a_memory_cgroup_is_marked_not_under_its_budget(tmp_path, monkeypatch, capsys):
    """Without root (no memory cgroup) --ram-budget bounds the engine's own accounting, not the page cache: --bench
    warned once on stderr, but the sweep's console table and its markdown (README's) showed the row as any other."""
    import types
    row = {"decode_tok_s": 5.0, "bound_tok_s": 10.0, "prefill_tok_s": 1.0, "hit_rate": 0.5,
           "disk_bytes_per_token": 1e6, "read_wait_s_per_token": 0.01, "bound_tok_s_serial": 5.0,
           "disk_bw_bytes_s": 1e9,
           "mem_bw_bytes_s": 1e10,
           "peak_rss_bytes": 1 << 30, "page_cache_excluded": True, "cpu_steal_fraction": 0.0,
           "p50_token_latency_s": 0.2, "p99_token_latency_s": 0.3, "cache_capacity_experts": 300}
    limited = {"2G": True, "1G": False}
    monkeypatch.setattr(B, "bench_in_cgroup", lambda args, argv: dict(
        row, ram_budget=S.parse_size(args.ram_budget), memory_limited=limited[args.ram_budget]))
    monkeypatch.setattr(B, "print_bench", lambda res: None)
    monkeypatch.setattr(B, "plot_sweep", lambda *a: None)
    args = types.SimpleNamespace(sweep="2G,1G", repeat=1, json=str(tmp_path / "s.json"), plot=None,
                                 llamacpp_json=None, container="x.pcf4", ram_budget=None)
    B.run_sweep(args, [])
    assert "NOT under their budget: 1G (no memory cgroup)" in capsys.readouterr().out
    md = (tmp_path / "s.md").read_text()
    assert "| 2G | 5.00 |" in md and "| 1G (NOT under it: no memory cgroup) | 5.00 |" in md, md
