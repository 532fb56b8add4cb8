# micro: the streaming benchmark model (issue 9 item 7), the seeds' next step after nano.
# python model.py config/micro.py prints:
#   total params 7.210B, active per token 0.969B (top_k=2; 0.868B at top_k=1)
# 17 layers (1 dense + 16 MoE), d_model 2048, 16 heads of 128, 4 kv heads, 64 experts x 1024, top-2, shared 4096.
# Its int4 container (group 64, int8 embeddings) is 4.12 GB (3.84 GiB): streaming is real with 1-2 GB budgets.
# Build one with random weights, layer by layer (it never exists in fp32; 4.6 min and 0.5 GB peak RSS here):
#   python container.py --random-config config/micro.py --out micro.pcf4
vocab_size = 32768
n_layer = 17
n_dense_layers = 1
d_model = 2048
n_head = 16
n_kv_head = 4
dense_ffn = 8192
n_experts = 64
expert_ffn = 1024
n_shared = 4
top_k = 2
route_scale = 1.0
rope_theta = 10000.0
max_seq_len = 4096
tie_embeddings = False
