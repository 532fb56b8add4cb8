# sft: chat fine-tune of a pretrained checkpoint on the loss-masked chat corpus (loss on assistant tokens only).
#
#   python data/smoltalk/prepare.py --tokenizer out/tiny   # rows of 256 (tiny's max_seq_len) = seq_len below
#   python train.py config/sft.py                           # tiny (CPU), defaults below
#   python chat.py pick out/sft --data data/smoltalk        # read the candidates, pick one
#   python chat.py out/sft/step_NNNNNNN                     # chat with it
#
# nano (the headline model, ~1,500 updates on one GPU):
#   python data/smoltalk/prepare.py --tokenizer out/nano   # rows of 2048
#   python train.py config/sft.py --finetune_from=out/nano --out_dir=out/nano_sft --device=cuda --dtype=bfloat16 \
#       --compile=True --seq_len=2048 --batch_size=16 --grad_accum=2 --learning_rate=1e-4 --min_lr=1e-5 \
#       "--stages=[{'name': 'warmup', 'steps': 50, 'lr_phase': 'warmup'}, {'name': 'stable', 'steps': 1150, 'lr_phase': 'stable'}, {'name': 'decay', 'steps': 300, 'lr_phase': 'decay'}]" \
#       --eval_interval=100 --eval_iters=40 --ckpt_interval=250 --keep_last=6
#   (16 x 2048 x 2 = 65,536 tokens per update, 1,500 updates = ~98M tokens; a checkpoint every 250 updates and the
#   stage ends at 50 and 1200, eight kept, so `chat.py pick` can compare them: the lowest val loss is not always the best chat model.)
#
# On the relay (an SFT leg is a leg): make the SFT run's step-0 checkpoint here, then hand it to the relay:
#   python train.py config/sft.py --finetune_from=out/nano --out_dir=out/nano_sft --stop_after_steps=0 [nano keys]
#   python relay.py init hf://owner/nano-sft --from-checkpoint out/nano_sft     # legs then resume this plan
#   python relay.py run hf://owner/nano-sft --hours 1                           # (each leg needs data/smoltalk)
# (tried with file:// stores: a leg resumed the SFT plan and pushed.)
# Or in one step: relay.py init runs train.py with this config's init_from=finetune (tried with the tiny model):
#   python relay.py init hf://owner/nano-sft config/sft.py --finetune_from=out/nano [nano keys]
#
# The model's shape comes from the checkpoint (init_from=finetune ignores the model fields here); the optimizer,
# the plan and the data position start fresh. Masks: shards.py sets the targets of non-assistant tokens to -1,
# so train.py's loss and its val loss are over assistant tokens only; doc_mask (on by default) keeps each packed
# conversation's attention to itself (a row holds several; served, a conversation never sees another).
# A row's <|bos|> padding is routed but not counted in the expert load (it would steer the balancing bias).
init_from = "finetune"
finetune_from = "out/tiny"
out_dir = "out/sft"
dataset = "smoltalk"
device = "cpu"
dtype = "float32"
compile = False

# seq_len should equal prepare.py's --max-len (rows of whole conversations; another length cuts conversations at
# window edges, warned once; back at a multiple of the rows, a position left mid-row skips to the next row start,
# warned); the tiny model's max_seq_len is 256
batch_size = 8
seq_len = 256
grad_accum = 1

# its own schedule: a short warmup, constant, then a (1 - sqrt) decay (WSD) over the last ~20%
learning_rate = 1e-3        # tiny; nano: 1e-4 (about a third of pretraining's peak)
min_lr = 1e-4
weight_decay = 0.0          # a short fine-tune: do not pull the pretrained weights towards zero
stages = [
    dict(name="warmup", steps=20, lr_phase="warmup"),
    dict(name="stable", steps=220, lr_phase="stable"),
    dict(name="decay", steps=60, lr_phase="decay"),
]

eval_interval = 50
eval_iters = 10
log_interval = 10
ckpt_interval = 60          # 6 checkpoints to choose from (chat.py pick): every 60 steps and the warmup's end
keep_last = 6
sample_tokens = 0
