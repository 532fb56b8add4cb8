# grow: deepen a trained model (LLaMA Pro, arXiv 2401.02415: identity-initialised new blocks) and keep training it
# with a differential LR, which the field found removes the loss spike of growing with one LR (1B -> 2B: 2.446 ->
# 2.80 for thousands of steps with one LR; none with old layers low, new layers high, embeddings between).
#   python train.py config/tiny.py            # first, the model to grow (out/tiny)
#   python train.py config/tiny.py config/grow.py
# On the relay (init takes one config file; give tiny.py's keys as --key=value): relay.py init STORE config/grow.py ...
# The model fields come from the grown checkpoint (n_layer + grow_layers); data and optimiser settings from here.
init_from = "grow"
grow_from = "out/tiny"
grow_layers = 2
grow_where = "interleave"       # new blocks spread evenly over the MoE blocks, the last after the top one ("top": all at the end)
out_dir = "out/tiny-grown"
lr_mult = {"embedding": 0.3, "old": 0.1, "new": 1.0}
max_iters = 200
warmup_iters = 20
decay_frac = 0.2
