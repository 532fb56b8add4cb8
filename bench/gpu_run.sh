#!/bin/bash
# One lent GPU session's checks in one call (the device tool gives ~15 minutes, start-up included; nothing can be
# fetched there, so it uses the machine's own torch/triton and carries data/local's shards):
#   1. bench/gpu_check.py on a random micro container: Triton int4 kernels vs the reference, the CUDA engine's
#      greedy tokens vs the reference kernel's, with a quarter of the experts streamed; ms, GB/s, tok/s.
#   2. train.py config/nano.py (the headline model, full size) on the local corpus, eager and then torch.compile'd:
#      tok/s and MFU from its log lines. Killed (SIGKILL) after a fixed time: the run's final checkpoint (~31 GB
#      with the optimizer) would take the session's minutes, and the CPU tests cover saving.
# Usage (device tool): bash bench/gpu_run.sh   with carry ["data/local"] (run data/local/prepare.py here first)
set -u
OUT=${OUT:-/tmp/gpu_run_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
say() { echo "== $* ($(date +%T))"; }
NANO_LOCAL=(config/nano.py --dataset=local '--stages=[]' --max_iters=100000 --warmup_iters=20 --decay_frac=0.1
            --grad_accum=1 --eval_interval=100000 --ckpt_interval=100000 --log_interval=10 --sample_tokens=0)
{
  say environment
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  nproc; free -g | head -2; df -h /tmp | tail -1
  say micro container
  timeout 150 $PY container.py --random-config config/micro.py --out /tmp/micro.pcf4 2>&1 | tr '\r' '\n' | grep -v "blob/s]$" | tail -5
  say gpu_check
  timeout 220 $PY bench/gpu_check.py --container /tmp/micro.pcf4 --json "$OUT/gpu_check.json"
  echo "gpu_check exit $?"
  say train nano eager
  timeout -s KILL ${EAGER_S:-100} $PY train.py "${NANO_LOCAL[@]}" --compile=False --out_dir=/tmp/nano_eager
  echo "train eager exit $? (137: killed on time, as planned)"
  say train nano compiled
  timeout -s KILL ${COMPILED_S:-170} $PY train.py "${NANO_LOCAL[@]}" --compile=True --out_dir=/tmp/nano_compiled
  echo "train compiled exit $? (137: killed on time, as planned)"
  say done
} 2>&1 | tee "$OUT/gpu_run.log"
