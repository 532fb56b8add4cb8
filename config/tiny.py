# tiny: the whole loop on a laptop CPU in a few minutes, on the offline local corpus (data/local/prepare.py).
# python model.py config/tiny.py prints its size.
out_dir = "out/tiny"
dataset = "local"
device = "cpu"
dtype = "float32"
compile = False

# model: 4 layers (1 dense + 3 MoE), 16 experts of width 64, top-2, shared width 128, GQA 4x
vocab_size = 8192
n_layer = 4
n_dense_layers = 1
d_model = 128
n_head = 4
n_kv_head = 1
dense_ffn = 384
n_experts = 16
expert_ffn = 64
n_shared = 2
top_k = 2
bias_update_rate = 1e-2   # a short run needs a faster balancing step than nano's 1e-3
max_seq_len = 256
tie_embeddings = True

# optimisation: WSD built from max_iters (warmup, stable, then a (1 - sqrt) decay over the last decay_frac)
batch_size = 16
seq_len = 128
grad_accum = 1
learning_rate = 3e-3
min_lr = 3e-4
max_iters = 300
warmup_iters = 30
decay_frac = 0.2
weight_decay = 0.1

eval_interval = 100
eval_iters = 10
log_interval = 10
ckpt_interval = 100
sample_tokens = 64
