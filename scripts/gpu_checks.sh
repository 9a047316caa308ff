#!/usr/bin/env bash
# The GPU checks of benchmarks/RESULTS.md ("Still to measure on a GPU") as one bounded script, for a
# session that is lent a GPU for a few minutes: every section has its own time limit, all of them fit
# in BUDGET_S seconds (a section gets what is left), a section that fails or runs out does not stop
# the next, and everything lands in $OUT as plain files (log.txt, JSON, junit XML; at most 8).
#
#   OUT=/tmp/gpu BUDGET_S=480 bash scripts/gpu_checks.sh [sections]
#   sections (in priority order): env,tests,diag,requant,bench,train,compile,profile,group,groupprof,tiles
#   (group, groupprof: int8_g64's Triton GEMM in decode, eager and CUDA graphs, against int8 and bf16;
#   tiles: its launch-shape variants per 7B layer, benchmarks/bench_group_gemm.py)
#   TESTS: test files for the tests section (default: tests); COMPILE_QUANT, COMPILE_MODES: the
#   compile section's schemes and modes (default: bf16,fp8 and none,reduce-overhead); BENCH_QUANT: the
#   bench section's schemes (default: bf16,int8,fp8,fp8_channel)
#
# No install step: the GPU image's python3 already has torch, transformers, safetensors, pyyaml, tqdm,
# numpy and pytest; flashrl runs from src/ (math-verify and gguf are imported lazily, unused here).
set -u
OUT=${OUT:-/tmp/flashrl-gpu}
SECTIONS=${1:-env,tests,diag,requant,bench,train,compile,profile,group,groupprof,tiles}
BUDGET_S=${BUDGET_S:-540}  # the tests section alone needs about 250 s on an H100
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
LOG="$OUT/log.txt"
# `flashrl` as a command (timeout runs commands, not shell functions)
mkdir -p "$OUT/.bin"
printf '#!/bin/sh\nexec python3 -c "import sys; from flashrl.cli import main; sys.exit(main())" "$@"\n' \
  >"$OUT/.bin/flashrl"
chmod +x "$OUT/.bin/flashrl"
export PATH="$OUT/.bin:$PATH"

section() {  # section NAME LIMIT_S COMMAND...: run one bounded section, log its status and time
  local name=$1 limit=$2; shift 2
  [[ ",$SECTIONS," == *",$name,"* ]] || return 0
  echo "=== [$name] limit ${limit}s: $*" | tee -a "$LOG"
  local left=$((BUDGET_S - SECONDS - 15))
  ((left < limit)) && limit=$left
  if ((limit < 10)); then echo "=== [$name] skipped: budget spent" | tee -a "$LOG"; return 0; fi
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== [$name] rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
}

env_report() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,
"| transformers", transformers.__version__, "| triton", triton.__version__,
"| device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'
}

B7="--random-weights qwen2.5-7b --batch 64 --prompt-len 256 --device cuda"
export -f env_report
section env 30 bash -c env_report
section tests ${TESTS_LIMIT_S:-300} python3 -m pytest -m gpu ${TESTS:-tests} -v -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml"
section diag 60 python3 scripts/gpu_kv_graph_diag.py
section requant 60 python3 benchmarks/bench_requant.py --device cuda --kernels triton,torch \
  --shapes 4096x4096,4096x14336,14336x4096 --out "$OUT/requant_cuda.json"
section bench ${BENCH_LIMIT_S:-130} flashrl bench $B7 --quant ${BENCH_QUANT:-bf16,int8,fp8,fp8_channel} --output-len 256 \
  --out "$OUT/bench_7b_b64.json"
section train 60 flashrl train --preset tiny-cpu --run.device cuda --run.compare bf16,int8,fp8 \
  --run.steps 20 --run.output-dir "$OUT/train"
section compile ${COMPILE_LIMIT_S:-150} flashrl bench $B7 --quant ${COMPILE_QUANT:-bf16,fp8} --output-len 256 --compile ${COMPILE_MODES:-none,reduce-overhead} \
  --out "$OUT/bench_7b_b64_compile.json"
section profile ${PROFILE_LIMIT_S:-200} python3 benchmarks/profile_decode_step.py --random-weights qwen2.5-7b \
  --quant ${PROFILE_QUANT:-bf16,fp8,int8} --batch 64 --prompt-len 256 --output-len 64 --compile reduce-overhead \
  --out "$OUT/profile_7b_b64.json"
section group ${GROUP_LIMIT_S:-200} flashrl bench $B7 --quant bf16,int8_g64,int8 --output-len ${GROUP_OUTPUT_LEN:-128} \
  --compile none,reduce-overhead --out "$OUT/bench_7b_b64_group.json"
section groupprof ${GROUPPROF_LIMIT_S:-90} python3 benchmarks/profile_decode_step.py --random-weights qwen2.5-7b \
  --quant int8,int8_g64 --batch 64 --prompt-len 256 --output-len 64 --compile none --out "$OUT/profile_7b_b64_group.json"
section tiles ${TILES_LIMIT_S:-120} python3 benchmarks/bench_group_gemm.py --device cuda --out "$OUT/group_gemm_tiles.json"
find "$OUT/train" -name 'summary*' -exec cp -f {} "$OUT/" \; 2>/dev/null
rm -rf "$OUT/train" "$OUT/.bin"
echo "=== done in ${SECONDS}s; files in $OUT"
