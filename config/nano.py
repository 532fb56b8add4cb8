# nano: the headline run. python model.py config/nano.py prints:
#   total params 2.604B, active per token 0.361B (top_k=2; 0.325B at top_k=1)
# 24 layers (1 dense + 23 MoE), d_model 1024, 16 heads of 64, 4 kv heads, 64 experts x 512, top-2, shared 2048.
# One H200, bf16 (train.py's memory plan: ~92 GiB at batch_size 16; on an 80 GB H100 use --batch_size=8
# --grad_accum=16, same tokens per update). Plan: FineWeb-Edu, ~5.2B tokens in ~20k updates of 256k tokens (WSD; decay over the
# last ~15%). Prepare the data first: python data/fineweb_edu/prepare.py --max-tokens 5500000000
out_dir = "out/nano"
dataset = "fineweb_edu"
device = "cuda"
dtype = "bfloat16"
compile = True
gpu_hourly_usd = 3.0

vocab_size = 32768
n_layer = 24
n_dense_layers = 1
d_model = 1024
n_head = 16
n_kv_head = 4
dense_ffn = 4096
n_experts = 64
expert_ffn = 512
n_shared = 4
top_k = 2
route_scale = 1.0
bias_update_rate = 1e-3
rope_theta = 10000.0
max_seq_len = 2048      # the trained length: chat, eval and exports default to it (raise it with a longer stage)
tie_embeddings = False

batch_size = 16
seq_len = 2048
grad_accum = 8          # 16 * 2048 * 8 = 262,144 tokens per update
learning_rate = 3e-4
min_lr = 3e-5
weight_decay = 0.1

# the run's plan as data (tokens per stage; 20,000 updates x 262,144 tokens = 5.24B tokens)
stages = [
    dict(name="warmup", mix={"fineweb_edu": 1.0}, tokens=500 * 262144, seq_len=2048, lr_phase="warmup"),
    dict(name="stable", mix={"fineweb_edu": 1.0}, tokens=16500 * 262144, seq_len=2048, lr_phase="stable"),
    dict(name="decay", mix={"fineweb_edu": 1.0}, tokens=3000 * 262144, seq_len=2048, lr_phase="decay"),
]

eval_interval = 500
eval_iters = 40
log_interval = 10
ckpt_interval = 1000
checkpoint_minutes = 15
keep_last = 3
