#!/usr/bin/env bash
# The GPU runbook (docs/gpu.md): on a CUDA machine, from the repository root, one step at a time
# (each fits a 10-minute call) or all of them:
#   bash scripts/gpu/runbook.sh env|tests|decode|eagle3|weights|loop|summary|all
#   bash scripts/gpu/runbook.sh lease   every step but loop in one 10-minute device call, each
#                                       under its own time limit (the device tool's 15 minutes)
#   bash scripts/gpu/runbook.sh recheck  a second lease: every GPU test (FlashInfer's too), the
#                                       weight updates and the tiny RL loop, each time-limited
#   bash scripts/gpu/runbook.sh moe-adaptive  a third lease: the MoE/MLA and adaptive GPU tests,
#                                       then adaptive EAGLE-3 against plain and fixed at 8B
#   bash scripts/gpu/runbook.sh adaptive  a fourth: adaptive EAGLE-3 at batch 1-128 (perfect
#                                       draft) and the per-step probe (scripts.gpu.probe_adaptive)
#   bash scripts/gpu/runbook.sh probe ARGS  the probe alone (ARGS: its flags, e.g. --profile python)
#   bash scripts/gpu/runbook.sh host      a fifth: adaptive EAGLE-3 at batch 32 and 128 with the
#                                       engines side by side (--interleave), the host's profile of
#                                       a batch-32 step, and the GPU tests of the paths it changed
#   bash scripts/gpu/runbook.sh host-all  the same comparison at batch 1-128, then the probe's
#                                       per-step times at batch 128 (fixed, forced, plain)
#   bash scripts/gpu/runbook.sh host-pad  the graph tests, then fixed EAGLE-3 against plain at
#                                       batch 64 and 128 (under four minutes of device time)
#   bash scripts/gpu/runbook.sh scale   the next lease (under 8 minutes): the GPU tests of what
#                                       landed since (fused kernels, pinned uploads, overlap on,
#                                       FP8 releases), plain and EAGLE-3 at batch 1 / 32 / 128
# Results (logs, JSON, summary.md naming the device) go to $OUT (the device tool's), else to
# docs/benchmarks/data/gpu_<device>/ to commit. Archives made by scripts/gpu/pack.sh in .gpu_pack/ are
# unpacked first (a machine without internet); with internet, `pip install -e ".[gpu]"` instead.
set -uo pipefail
cd "$(dirname "$0")/../.."
device_slug() {
  python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_') if torch.cuda.is_available() else 'no_gpu')" 2>/dev/null || echo no_gpu
}
RESULTS=${OUT:-docs/benchmarks/data/gpu_$(device_slug)}
WORK=${WORK:-/tmp/specrl-bench}  # random 8B checkpoints, built once and reused by later steps
SITE=/tmp/specrl-site
mkdir -p "$RESULTS" "$WORK"

setup() {
  if ls .gpu_pack/*.tar.xz >/dev/null 2>&1 && [ ! -e "$SITE/.unpacked" ]; then
    mkdir -p "$SITE"
    for archive in .gpu_pack/*.tar.xz; do tar -C "$SITE" -xJf "$archive"; done
    touch "$SITE/.unpacked"
  fi
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  # FlashInfer compiles its kernels on first use with the CUDA toolkit that nvcc belongs to.
  if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    export CUDA_HOME
  fi
}

step_env() {
  {
    nvidia-smi || echo "nvidia-smi: not found"
    python3 - <<'PY'
import importlib.util

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)
for name in ("flashinfer", "megatron.core", "ray", "fastapi", "transformers"):
    print(name, "present" if importlib.util.find_spec(name) else "MISSING")
PY
    echo "CUDA_HOME=${CUDA_HOME:-unset}"
  } 2>&1 | tee "$RESULTS/env.txt"
}

step_tests() {
  python3 -m pytest tests/gpu/test_gpu.py -m gpu -q -rs -p no:cacheprovider \
    --junitxml="$RESULTS/pytest_gpu.xml" 2>&1 | tee "$RESULTS/pytest_gpu.txt"
}

step_decode() {  # plain decode, batch 1..256, an 8B-shaped bf16 model, against the HBM roofline
  python3 -m scripts.bench_rollout --preset llama-3.1-8b --device cuda --dtype bfloat16 \
    --algorithms baseline --batch-sizes 1 2 4 8 16 32 64 128 256 --input-len 128 \
    --output-len 128 --context-length 2048 --repeats 2 --work-dir "$WORK" \
    --json "$RESULTS/decode.json" 2>&1 | tee "$RESULTS/decode.txt"
}

step_eagle3() {  # EAGLE-3 against plain decoding at full acceptance (a perfect draft's speed)
  python3 -m scripts.bench_rollout --preset llama-3.1-8b --device cuda --dtype bfloat16 \
    --algorithms baseline eagle3 --batch-sizes 1 8 32 64 --steps 3 --topk 1 --forced-acceptance \
    --input-len 128 --output-len 128 --context-length 2048 --repeats 2 --work-dir "$WORK" \
    --json "$RESULTS/eagle3.json" 2>&1 | tee "$RESULTS/eagle3.txt"
}

step_weights() {  # weight updates of an 8B model, the colocated push among them
  python3 -m scripts.bench_weight_sync --preset llama-3.1-8b --device cuda --dtype bfloat16 \
    --repeats 2 --work-dir "$WORK" --json "$RESULTS/weight_sync.json" 2>&1 \
    | tee "$RESULTS/weight_sync.txt"
}

step_loop() {  # the tiny RL run on the GPU, trainer and engine colocated on it
  OUT="$WORK/tiny-gpu" bash scripts/run-tiny-cpu.sh --colocate --num-rollout 10 2>&1 \
    | tee "$RESULTS/loop.txt"
}

step_summary() {
  python3 -m scripts.gpu.summarize "$RESULTS" 2>&1 | tee "$RESULTS/summary.md"
}

step_lease() {  # one call: each step time-limited, the most telling first; <= 8 files to $OUT
  local out=${OUT:-}
  RESULTS=/tmp/specrl-results
  mkdir -p "$RESULTS"
  step_env
  timeout 160 python3 -m pytest tests/gpu/test_gpu.py -m gpu -k "not flashinfer" -q -rs \
    -p no:cacheprovider 2>&1 | tee "$RESULTS/pytest_gpu.txt"
  timeout 140 python3 -m scripts.bench_rollout --preset llama-3.1-8b --device cuda \
    --dtype bfloat16 --algorithms baseline --batch-sizes 1 8 32 64 128 256 --input-len 128 \
    --output-len 128 --context-length 512 --repeats 2 --work-dir "$WORK" \
    --json "$RESULTS/decode.json" 2>&1 | tee "$RESULTS/decode.txt"
  timeout 100 python3 -m scripts.bench_rollout --preset llama-3.1-8b --device cuda \
    --dtype bfloat16 --algorithms baseline eagle3 --batch-sizes 1 32 --steps 3 --topk 1 \
    --forced-acceptance --input-len 128 --output-len 128 --context-length 512 --repeats 2 \
    --work-dir "$WORK" --json "$RESULTS/eagle3.json" 2>&1 | tee "$RESULTS/eagle3.txt"
  timeout 60 python3 -m scripts.bench_weight_sync --preset llama-3.1-8b --device cuda \
    --dtype bfloat16 --repeats 2 --work-dir "$WORK" --json "$RESULTS/weight_sync.json" 2>&1 \
    | tee "$RESULTS/weight_sync.txt"
  timeout 50 python3 -m pytest tests/gpu/test_gpu.py -m gpu -k flashinfer -q -rs \
    -p no:cacheprovider 2>&1 | tee "$RESULTS/pytest_flashinfer.txt"
  step_summary
  if [ -n "$out" ]; then
    tar -C "$RESULTS" -czf "$out/all.tar.gz" .
    for f in env.txt pytest_gpu.txt decode.json eagle3.json weight_sync.json summary.md; do
      [ -e "$RESULTS/$f" ] && cp "$RESULTS/$f" "$out/"
    done
  fi
}

step_recheck() {  # one call after a lease's fixes: what it failed or left out; <= 8 files to $OUT
  local out=${OUT:-}
  RESULTS=/tmp/specrl-results
  mkdir -p "$RESULTS"
  step_env
  timeout 280 python3 -m pytest tests/gpu/test_gpu.py -m gpu -q -rs -p no:cacheprovider 2>&1 \
    | tee "$RESULTS/pytest_gpu.txt"
  timeout 130 python3 -m scripts.bench_weight_sync --preset llama-3.1-8b --device cuda \
    --dtype bfloat16 --repeats 2 --work-dir "$WORK" --json "$RESULTS/weight_sync.json" 2>&1 \
    | tee "$RESULTS/weight_sync.txt"
  OUT="$WORK/tiny-gpu" timeout 130 bash scripts/run-tiny-cpu.sh --colocate --num-rollout 10 2>&1 \
    | tee "$RESULTS/loop.txt"
  step_summary
  if [ -n "$out" ]; then
    for f in env.txt pytest_gpu.txt weight_sync.json weight_sync.txt loop.txt summary.md; do
      [ -e "$RESULTS/$f" ] && tail -c 200000 "$RESULTS/$f" > "$out/$f"
    done
  fi
}

step_moe_adaptive() {  # one call: what landed after the second lease; <= 8 files to $OUT
  local out=${OUT:-}
  RESULTS=/tmp/specrl-results
  mkdir -p "$RESULTS"
  step_env
  timeout 230 python3 -m pytest tests/gpu/test_gpu_moe.py tests/gpu/test_gpu_adaptive.py -m gpu -q -rs \
    -p no:cacheprovider -o junit_family=legacy --junitxml="$RESULTS/pytest_moe_adaptive.xml" 2>&1 \
    | tee "$RESULTS/pytest_moe_adaptive.txt"
  # A perfect draft (--forced-acceptance), then the random draft as it is (accepting ~nothing):
  # adaptive must track the better of plain and fixed EAGLE-3 in both.
  timeout 190 python3 -m scripts.bench_rollout --preset llama-3.1-8b --device cuda \
    --dtype bfloat16 --algorithms baseline eagle3 eagle3-adaptive --batch-sizes 1 32 128 \
    --steps 3 --topk 1 --forced-acceptance --input-len 128 --output-len 128 \
    --context-length 512 --repeats 1 --work-dir "$WORK" --json "$RESULTS/adaptive_forced.json" \
    2>&1 | tee "$RESULTS/adaptive.txt"
  timeout 110 python3 -m scripts.bench_rollout --preset llama-3.1-8b --device cuda \
    --dtype bfloat16 --algorithms baseline eagle3 eagle3-adaptive --batch-sizes 1 32 \
    --steps 3 --topk 1 --input-len 128 --output-len 128 --context-length 512 --repeats 1 \
    --work-dir "$WORK" --json "$RESULTS/adaptive_random.json" 2>&1 | tee -a "$RESULTS/adaptive.txt"
  if [ -n "$out" ]; then
    for f in env.txt pytest_moe_adaptive.txt pytest_moe_adaptive.xml adaptive.txt \
      adaptive_forced.json adaptive_random.json; do
      [ -e "$RESULTS/$f" ] && tail -c 300000 "$RESULTS/$f" > "$out/$f"
    done
  fi
}

step_adaptive() {  # one call: the cost model's fixes at every batch, and why steps differ
  local out=${OUT:-}
  RESULTS=/tmp/specrl-results
  mkdir -p "$RESULTS"
  step_env
  timeout 330 python3 -m scripts.bench_rollout --preset llama-3.1-8b --device cuda \
    --dtype bfloat16 --algorithms baseline eagle3 eagle3-adaptive --batch-sizes 1 8 32 64 128 \
    --steps 3 --topk 1 --forced-acceptance --input-len 128 --output-len 128 \
    --context-length 512 --repeats 1 --work-dir "$WORK" --json "$RESULTS/adaptive_forced.json" \
    2>&1 | tee "$RESULTS/adaptive.txt"
  for batch in 32 1; do
    timeout 110 python3 -m scripts.gpu.probe_adaptive --work-dir "$WORK" --batch $batch \
      --json "$RESULTS/probe_b$batch.json" 2>&1 | tail -n 20 | tee -a "$RESULTS/probe.txt"
  done
  if [ -n "$out" ]; then
    for f in env.txt adaptive.txt adaptive_forced.json probe.txt probe_b32.json probe_b1.json; do
      [ -e "$RESULTS/$f" ] && tail -c 2000000 "$RESULTS/$f" > "$out/$f"
    done
  fi
}

step_host() {  # one call: the host-side batching at the batch sizes where steps are host-bound
  local out=${OUT:-}
  RESULTS=/tmp/specrl-results
  mkdir -p "$RESULTS"
  step_env
  timeout 300 python3 -m scripts.bench_rollout --preset llama-3.1-8b --device cuda \
    --dtype bfloat16 --algorithms baseline eagle3 eagle3-adaptive --batch-sizes 32 128 \
    --steps 3 --topk 1 --forced-acceptance --input-len 128 --output-len 128 \
    --context-length 512 --repeats 2 --interleave --work-dir "$WORK" \
    --json "$RESULTS/adaptive_interleaved.json" 2>&1 | tee "$RESULTS/adaptive.txt"
  timeout 80 python3 -m scripts.gpu.probe_adaptive --work-dir "$WORK" --batch 32 \
    --profile python --cases fixed --json "$RESULTS/probe_b32.json" 2>&1 | tail -n 60 \
    | tee "$RESULTS/probe.txt"
  timeout 120 python3 -m pytest tests/gpu/test_gpu.py tests/gpu/test_gpu_adaptive.py -m gpu \
    -k "flashinfer or graphs or adaptive" -q -rs -p no:cacheprovider 2>&1 \
    | tee "$RESULTS/pytest_gpu.txt"
  if [ -n "$out" ]; then
    for f in env.txt adaptive.txt adaptive_interleaved.json probe.txt probe_b32.json \
      pytest_gpu.txt; do
      [ -e "$RESULTS/$f" ] && tail -c 2000000 "$RESULTS/$f" > "$out/$f"
    done
  fi
}

step_host_all() {  # one call after `host`: every batch size, and why batch 128 runs plain
  local out=${OUT:-}
  RESULTS=/tmp/specrl-results
  mkdir -p "$RESULTS"
  timeout 340 python3 -m scripts.bench_rollout --preset llama-3.1-8b --device cuda \
    --dtype bfloat16 --algorithms baseline eagle3 eagle3-adaptive --batch-sizes 1 8 32 64 128 \
    --steps 3 --topk 1 --forced-acceptance --input-len 128 --output-len 128 \
    --context-length 512 --repeats 2 --interleave --work-dir "$WORK" \
    --json "$RESULTS/adaptive_interleaved.json" 2>&1 | tee "$RESULTS/adaptive.txt"
  timeout 120 python3 -m scripts.gpu.probe_adaptive --work-dir "$WORK" --batch 128 \
    --cases fixed adaptive_forced_deepest adaptive_forced_plain_then_deepest plain \
    --json "$RESULTS/probe_b128.json" 2>&1 | tail -n 40 | tee "$RESULTS/probe.txt"
  if [ -n "$out" ]; then
    for f in adaptive.txt adaptive_interleaved.json probe.txt probe_b128.json; do
      [ -e "$RESULTS/$f" ] && tail -c 2000000 "$RESULTS/$f" > "$out/$f"
    done
  fi
}

step_host_pad() {  # a short call: the padded extend masks built batch-wide (graph_runner)
  local out=${OUT:-}
  RESULTS=/tmp/specrl-results
  mkdir -p "$RESULTS"
  timeout 80 python3 -m pytest tests/gpu/test_gpu.py -m gpu -k "graphs" -q -rs -p no:cacheprovider \
    2>&1 | tee "$RESULTS/pytest_gpu.txt"
  timeout 140 python3 -m scripts.bench_rollout --preset llama-3.1-8b --device cuda \
    --dtype bfloat16 --algorithms baseline eagle3 --batch-sizes 64 128 --steps 3 --topk 1 \
    --forced-acceptance --input-len 128 --output-len 128 --context-length 512 --repeats 2 \
    --interleave --work-dir "$WORK" --json "$RESULTS/eagle3_interleaved.json" 2>&1 \
    | tee "$RESULTS/eagle3.txt"
  if [ -n "$out" ]; then
    for f in pytest_gpu.txt eagle3.txt eagle3_interleaved.json; do
      [ -e "$RESULTS/$f" ] && tail -c 2000000 "$RESULTS/$f" > "$out/$f"
    done
  fi
}

step_scale() {  # one call (under 8 minutes): what landed after the fifth lease; <= 8 files to $OUT
  local out=${OUT:-}
  RESULTS=/tmp/specrl-results
  mkdir -p "$RESULTS"
  step_env
  timeout 150 python3 -m pytest tests/gpu/test_gpu_scale.py tests/gpu/test_gpu.py -m gpu \
    -k "scale or fused or graphs" -q -rs -p no:cacheprovider 2>&1 | tee "$RESULTS/pytest_gpu.txt"
  timeout 120 python3 -m scripts.bench_rollout --preset llama-3.1-8b --device cuda \
    --dtype bfloat16 --algorithms baseline --batch-sizes 1 32 128 --input-len 128 \
    --output-len 128 --context-length 512 --repeats 2 --work-dir "$WORK" \
    --json "$RESULTS/decode.json" 2>&1 | tee "$RESULTS/decode.txt"
  timeout 120 python3 -m scripts.bench_rollout --preset llama-3.1-8b --device cuda \
    --dtype bfloat16 --algorithms baseline eagle3 --batch-sizes 1 32 128 --steps 3 --topk 1 \
    --forced-acceptance --input-len 128 --output-len 128 --context-length 512 --repeats 2 \
    --work-dir "$WORK" --json "$RESULTS/eagle3.json" 2>&1 | tee "$RESULTS/eagle3.txt"
  step_summary
  if [ -n "$out" ]; then
    for f in env.txt pytest_gpu.txt decode.json eagle3.json decode.txt eagle3.txt summary.md; do
      [ -e "$RESULTS/$f" ] && tail -c 2000000 "$RESULTS/$f" > "$out/$f"
    done
  fi
}

step_probe() {  # the 8B checkpoints (built once), then scripts.gpu.probe_adaptive "$@"
  RESULTS=${OUT:-$RESULTS}
  python3 -m scripts.bench_rollout --preset llama-3.1-8b --device cuda --dtype bfloat16 \
    --algorithms eagle3 --batch-sizes 1 --input-len 8 --output-len 8 --context-length 512 \
    --repeats 1 --work-dir "$WORK" > "$RESULTS/probe_build.txt" 2>&1
  python3 -m scripts.gpu.probe_adaptive --work-dir "$WORK" --json "$RESULTS/probe.json" "$@" \
    2>&1 | tee "$RESULTS/probe.txt" | tail -n 200
}

setup
case "${1:-all}" in
  env) step_env ;;
  tests) step_tests ;;
  decode) step_decode ;;
  eagle3) step_eagle3 ;;
  weights) step_weights ;;
  loop) step_loop ;;
  summary) step_summary ;;
  all) step_env; step_tests; step_decode; step_eagle3; step_weights; step_loop; step_summary ;;
  lease) step_lease ;;
  recheck) step_recheck ;;
  moe-adaptive) step_moe_adaptive ;;
  adaptive) step_adaptive ;;
  host) step_host ;;
  host-all) step_host_all ;;
  host-pad) step_host_pad ;;
  scale) step_scale ;;
  probe) shift; step_probe "$@" ;;
  *) echo "usage: bash scripts/gpu/runbook.sh env|tests|decode|eagle3|weights|loop|summary|all|lease|recheck|moe-adaptive|adaptive|host|host-all|host-pad|scale|probe ARGS" >&2
     exit 2 ;;
esac
