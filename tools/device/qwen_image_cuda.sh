#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev): Qwen-Image-2.1 on CUDA — op parity,
# model parity against the CPU (the miniature, then a full-size random-weight folder at 256²),
# component timings (`tessera bench qwen-image-parts`: text encoder, prefill of 100 and 1,000
# rows, a step over each, VAE), then
# `tessera bench generate` at 1024² / 40 steps, a profile, and diffusers beside it in the same call.
#   PARTS=ops,parity,full,parts,bench,profile,ref,compile (default all but compile)
# Writes logs, JSON and the generated PNGs under $OUT. Build everything first with
# PACK=1 TESTS="cuda_ops qwen_image_cuda" tools/device/stage.sh, and carry .dev/pack, .dev/whl and
# .dev/tools. To fit the 64 MiB carry, the transformers wheel was trimmed (run q1/q2) with
#   python3 ../shared/tools/trim_wheel.py IN.whl .dev/whl/transformers-5.25.0-py3-none-any.whl \
#     transformers/models/ auto,qwen3_vl,qwen2_vl,qwen2,qwen3,llama,clip,t5,siglip,siglip2,gemma,\
#     gemma2,gemma3,bert,lfm2,lfm2_vl,dinov2_with_registers,vit_mae
# (diffusers imports the last two; the reference script hides peft, which would import more).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-ops,parity,full,parts,bench,profile,ref}
export TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_ROOT=$PWD
# The binaries may travel packed (the device tool carries at most 64 MiB): .dev/pack/bin.tar.xz.
if [ -f .dev/pack/bin.tar.xz ]; then tar -C .dev -xJf .dev/pack/bin.tar.xz; fi
. tools/device/pysite.sh
pysite || { echo "reference packages: install failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
B=.dev/bin/tessera Q=/tmp/qfull
status=0

peak_mem() {
  local log=$1; shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 > "$log.mem" & local s=$!
  "$@"; local r=$?
  kill $s 2>/dev/null; wait $s 2>/dev/null
  echo "peak GPU memory $(sort -n "$log.mem" | tail -1) MiB" >> "$log"
  rm -f "$log.mem"
  return $r
}

if [[ $PARTS == *ops* ]]; then
  echo "== op parity (cuda vs cpu, f32 and bf16)"
  .dev/bin/cuda_ops --ignored --test-threads=1 --nocapture > "$OUT/cuda_ops.log" 2>&1; r=$?; status=$((status|r))
  grep -E "^total|test result|panicked|FAIL" "$OUT/cuda_ops.log" | head -30
fi
if [[ $PARTS == *parity* ]]; then
  echo "== model parity: the miniature, cuda vs cpu; bf16 against its storage floor"
  .dev/bin/qwen_image_cuda --ignored --test-threads=1 --nocapture --skip full_size > "$OUT/qi_cuda_mini.log" 2>&1; r=$?; status=$((status|r))
  grep -E "f32:|bf16:|test result|panicked" "$OUT/qi_cuda_mini.log" | head -20
fi
if [[ $PARTS =~ full|parts|bench|profile ]] && [ ! -f $Q/model_index.json ]; then
  echo "== making the full-size folder"
  python3 tools/device/make_qwen_image_full.py $Q crates/models/assets/qwen-image-mini > "$OUT/make_full.log" 2>&1 \
    || { tail -20 "$OUT/make_full.log"; exit 1; }
  tail -1 "$OUT/make_full.log"
fi
if [[ $PARTS == *full* ]]; then
  echo "== model parity: full size at 256², cuda vs cpu"
  TESSERA_QI_FULL=$Q timeout 400 .dev/bin/qwen_image_cuda --ignored --test-threads=1 --nocapture full_size > "$OUT/qi_cuda_full.log" 2>&1; r=$?; status=$((status|r))
  grep -E "f32:|bf16:|test result|panicked" "$OUT/qi_cuda_full.log" | head -20
fi
if [[ $PARTS == *parts* ]]; then
  echo "== component timings (bf16, full size)"
  timeout 300 $B bench qwen-image-parts --model $Q --device cuda --precision bf16 > "$OUT/qi_parts.log" 2>&1; r=$?; status=$((status|r))
  grep -E "^timing|rror" "$OUT/qi_parts.log" | head -20
fi
if [[ $PARTS == *bench* ]]; then
  echo "== cuBLASLt bf16 ceiling"
  $B bench gemm --device cuda > "$OUT/gemm.log" 2>&1
  grep -v gemm_shape "$OUT/gemm.log" | head -3
  echo "== tessera bench generate (bf16, full size, 40 steps)"
  for spec in ${GEN_SPECS:-1024x1024:2:1 512x512:2:1}; do
    set -- ${spec//:/ }
    log="$OUT/gen_$1_n$3.log"
    peak_mem "$log" $B bench generate --model $Q --device cuda --precision bf16 --size $1 --steps 40 --iters $2 \
      --num-images $3 > "$log" 2>&1; r=$?; status=$((status|r))
    grep -E "end to end|peak|rror" "$log"
  done
  $B generate --model $Q --device cuda --precision bf16 --size 1024x1024 --prompt "a lighthouse" \
    -o "$OUT/qi_full_1024.png" 2>&1 | tail -1
  $B generate --model bundled:qwen-image --device cuda --size 256x256 --prompt "a lighthouse" -o "$OUT/qi_mini_cuda.png" 2>&1 | tail -1
  echo "== a size too large for the device's memory (refused before compute)"
  $B generate --model $Q --device cuda --size 8192x8192 --prompt "a lighthouse" -o /tmp/too_large.png 2>&1 | tail -1
fi
if [[ $PARTS == *profile* ]]; then
  echo "== profile of a warm 1024² generation (TESSERA_PROFILE=kernels), 3 steps"
  TESSERA_PROFILE=kernels $B bench generate --model $Q --device cuda --precision bf16 --size 1024x1024 \
    --steps 3 --iters 1 > "$OUT/profile_1024.log" 2>&1; r=$?; status=$((status|r))
  grep "^profile" "$OUT/profile_1024.log" | tail -6 | cut -c1-2500
fi
if [[ $PARTS == *ref* ]]; then
  echo "== diffusers 0.42.1 eager (and regional compile with PARTS=…compile), same call"
  ref_parts="env matmul qi21"; [[ $PARTS == *compile* ]] && ref_parts="$ref_parts qi21c"
  OUT=$OUT/ref PARTS="$ref_parts" DEADLINE=${REF_DEADLINE:-400} bash .dev/tools/refbench_qi21_lfm2vl.sh > "$OUT/refbench.log" 2>&1; r=$?; status=$((status|r))
  cp "$OUT/ref/results.jsonl" "$OUT/ref_results.jsonl" 2>/dev/null
  grep -E "^RESULT" "$OUT/refbench.log" | cut -c1-300 | head -40
fi
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
exit $status
