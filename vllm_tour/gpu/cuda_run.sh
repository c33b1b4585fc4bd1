#!/usr/bin/env bash
# One command for every GPU-machine run of the CUDA sequence (see vllm_tour/gpu/runner.py):
#   runs 1-3 carry one payload part each: assemble.sh stages it and exits 3 (so does this script);
#   run 4 carries the last part: upstream vLLM 0.21.0 is assembled into /tmp/vllm-cuda, then the runner
#   runs every step (doctor, trace, compare, tokens, race, pack) with results under $OUT.
# Usage (repo root on the GPU machine): bash vllm_tour/gpu/cuda_run.sh [runner options, e.g. --steps race]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/tour-out}"; mkdir -p "$OUT"
t0=$(date +%s)
bash .gpu/cuda/assemble.sh; rc=$?
echo "[cuda_run] assemble rc=$rc in $(( $(date +%s) - t0 )) s"
[[ $rc -eq 0 ]] || exit $rc
export SITE=/tmp/vllm-cuda
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=0 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -m vllm_tour.gpu.runner all --out "$OUT" --deadline-s "${DEADLINE_S:-$(( 560 - ($(date +%s) - t0) ))}" "$@"
rc=$?
# At most 8 files come back, 16 MiB each: everything but the log goes into one archive, captures left out
# (the runner's `archive`, tested on CPU; it drops the biggest files if still too big and says so).
python3 -m vllm_tour.gpu.runner archive --out "$OUT" || echo "[cuda_run] archive failed"
exit $rc
