#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev): Z-Image on CUDA — op parity, model
# parity against the CPU (the miniature model, then a full-size random-weight folder at 256²),
# then `tessera bench generate` beside diffusers (eager and torch.compile) in the same call.
#   PARTS=ops,parity,full,bench,profile,ref,compile (default all)
#   GEN_SPECS: the `bench generate` runs, SIZE:ITERS:IMAGES each, space-separated (default 1024² ×1
#   and ×4 images, 2048², 1344×768)
# Writes logs, JSON and the generated PNGs under $OUT. Build everything first with
# tools/device/stage.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-ops,parity,full,bench,profile,ref,compile}
PROFILE_MODE=${PROFILE_MODE:-kernels}  # TESSERA_PROFILE of the profiled generation: 1 or kernels
export TESSERA_CACHE_DIR=/tmp/tessera-cache
. tools/device/pysite.sh
pysite || { echo "reference packages: install failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
B=.dev/bin/tessera Z=/tmp/zfull
status=0

# Peak GPU memory (MiB, whole device) while "$@" runs: nvidia-smi sampled every 50 ms.
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
  echo "== model parity: the miniature model, cuda vs cpu; bf16 against its storage floor"
  .dev/bin/zimage_cuda --ignored --test-threads=1 --nocapture --skip full_size > "$OUT/zimage_cuda_mini.log" 2>&1; r=$?; status=$((status|r))
  grep -E "f32:|bf16:|test result|panicked" "$OUT/zimage_cuda_mini.log" | head -20
fi
if [[ $PARTS =~ full|bench|profile ]] && [ ! -f $Z/model_index.json ]; then
  echo "== making the full-size folder"
  python3 tools/device/make_zimage_full.py $Z crates/models/assets/zimage-mini > "$OUT/make_full.log" 2>&1 \
    || { tail -20 "$OUT/make_full.log"; exit 1; }
  tail -1 "$OUT/make_full.log"
fi
if [[ $PARTS == *full* ]]; then
  echo "== model parity: full size at 256², cuda vs cpu"
  TESSERA_ZI_FULL=$Z timeout 420 .dev/bin/zimage_cuda --ignored --test-threads=1 --nocapture full_size > "$OUT/zimage_cuda_full.log" 2>&1; r=$?; status=$((status|r))
  grep -E "f32:|bf16:|test result|panicked" "$OUT/zimage_cuda_full.log" | head -20
fi
if [[ $PARTS == *bench* ]]; then
  echo "== cuBLASLt bf16 ceiling"
  $B bench gemm --device cuda > "$OUT/gemm.log" 2>&1
  grep -v gemm_shape "$OUT/gemm.log" | head -3
  echo "== tessera bench generate (bf16, full size)"
  for spec in ${GEN_SPECS:-1024x1024:5:1 1024x1024:3:4 2048x2048:2:1 1344x768:2:1}; do
    set -- ${spec//:/ }
    log="$OUT/gen_$1_n$3.log"
    peak_mem "$log" $B bench generate --model $Z --device cuda --precision bf16 --size $1 --steps 8 --iters $2 \
      --num-images $3 > "$log" 2>&1; r=$?; status=$((status|r))
    grep -E "end to end|peak|rror|images_per_s" "$log" | sed 's/^{.*"images_per_s":\([0-9.]*\).*/images\/s \1/'
  done
  $B generate --model $Z --device cuda --precision bf16 --size 1024x1024 --prompt "a lighthouse" \
    -o "$OUT/zimage_full_1024.png" 2>&1 | tail -1
  $B generate --device cuda --size 256x256 --prompt "a lighthouse" -o "$OUT/zimage_mini_cuda.png" 2>&1 | tail -1
  echo "== a size too large for the device's memory (refused before compute)"
  $B generate --model $Z --device cuda --size 8192x8192 --prompt "a lighthouse" -o /tmp/too_large.png 2>&1 | tail -1
fi
if [[ $PARTS == *profile* ]]; then
  # A warm generation's profile: the last ten blocks are its text encoder, eight steps and VAE.
  echo "== profile of a warm 1024² generation (TESSERA_PROFILE=$PROFILE_MODE): encode, a step, decode"
  TESSERA_PROFILE=$PROFILE_MODE $B bench generate --model $Z --device cuda --precision bf16 --size 1024x1024 \
    --iters 1 > "$OUT/profile_1024.log" 2>&1; r=$?; status=$((status|r))
  grep "^profile" "$OUT/profile_1024.log" | tail -10 | sed -n '1p;5p;10p' | cut -c1-3000
fi
if [[ $PARTS == *ref* ]]; then
  echo "== diffusers 0.42.1 eager, same call"
  python3 .dev/tools/refbench.py --only zimage > "$OUT/refbench.log" 2>&1; r=$?; status=$((status|r))
  sed -n '/SUMMARY/,$p' "$OUT/refbench.log"
fi
if [[ $PARTS == *compile* ]]; then
  echo "== diffusers with compile_repeated_blocks, same call"
  python3 .dev/tools/zimage_compile.py > "$OUT/compile.log" 2>&1; r=$?; status=$((status|r))
  tail -3 "$OUT/compile.log"
fi
# The device tool brings back a handful of files: the logs travel as one archive.
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
exit $status
