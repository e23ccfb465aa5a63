#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev): LFM2-VL on CUDA — op parity of its
# ops, model parity (the miniatures: f32 against the CPU with the reference's greedy tokens, bf16
# against its storage floor; a full-size random-weight folder against the CPU), then
# `tessera bench chat` beside transformers 5.25 in the same call.
#   PARTS=ops,parity,full,bench,profile,ref (default all)
# Writes logs under $OUT. Build everything first: TESTS="cuda_ops lfm2vl_cuda" tools/device/stage.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-ops,parity,full,bench,profile,ref}
OP_CASES=${OP_CASES:-short_conv|over keys|matmul}
export TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_ROOT=$PWD
# The reference's wheels (staged in .dev/whl; a run without the ref part may leave them behind).
if [ -f .dev/pack/site.tar.xz ] || ls .dev/whl/*.whl >/dev/null 2>&1; then
  . tools/device/pysite.sh
  pysite || { echo "reference packages: install failed"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
B=.dev/bin/tessera F=/tmp/lfm2full
status=0

if [[ $PARTS == *ops* ]]; then
  echo "== op parity (cuda vs cpu, f32 and bf16): LFM2-VL's ops"
  IFS='|' read -ra cases <<< "$OP_CASES"
  for c in "${cases[@]}"; do
    TESSERA_OP_CASE="$c" .dev/bin/cuda_ops --ignored --test-threads=1 --nocapture > "$OUT/cuda_ops_$(echo "$c" | tr -c "a-zA-Z0-9\n" _).log" 2>&1; r=$?; status=$((status|r))
    echo "-- $c"; grep -E "^total|test result|panicked|FAIL" "$OUT/cuda_ops_$(echo "$c" | tr -c "a-zA-Z0-9\n" _).log" | head -12
  done
fi
if [[ $PARTS == *parity* ]]; then
  echo "== model parity: miniatures, cuda f32 vs cpu and the reference's greedy tokens; bf16 vs its floor"
  .dev/bin/lfm2vl_cuda --ignored --test-threads=1 --nocapture --skip full_size > "$OUT/lfm2vl_cuda.log" 2>&1; r=$?; status=$((status|r))
  grep -E "rel|identical|floor|test result|panicked" "$OUT/lfm2vl_cuda.log" | grep -v "^f32: .*features" | head -40
fi
if [[ $PARTS =~ full|bench|ref ]] && [ ! -f $F/config.json ]; then
  echo "== making the full-size folder"
  python3 tools/device/make_lfm2vl_full.py $F > "$OUT/make_full.log" 2>&1 || { tail -20 "$OUT/make_full.log"; exit 1; }
  tail -1 "$OUT/make_full.log"
fi
if [[ $PARTS == *full* ]]; then
  echo "== model parity: full size, cuda f32 vs cpu"
  TESSERA_LFM2_FULL=$F timeout 300 .dev/bin/lfm2vl_cuda --ignored --test-threads=1 --nocapture full_size > "$OUT/lfm2vl_full.log" 2>&1; r=$?; status=$((status|r))
  grep -E "full size|test result|panicked" "$OUT/lfm2vl_full.log" | head
fi
if [[ $PARTS == *bench* ]]; then
  echo "== tessera bench chat (bf16, full size)"
  $B bench chat --model $F --device cuda --precision bf16 --images 512x512,1024x768 --prefill 64,1024,4096 \
    --batch 1,8,32 --new-tokens 128 --iters 5 > "$OUT/bench_chat.log" 2>&1; r=$?; status=$((status|r))
  cat "$OUT/bench_chat.log" | head -20
  echo "== tessera chat, the CLI, once"
  $B chat --model $F --device cuda --image tests/fixtures/lfm2vl/images/tiled400x368.png --prompt "What is this?" \
    --max-tokens 64 2>&1 >/dev/null | tail -2
fi
if [[ $PARTS == *profile* ]]; then
  # Kernel times of decoding (graphs off while profiling): where a step's time goes.
  for b in 1 8; do
    echo "== profile: decode steps at batch $b (TESSERA_PROFILE=kernels)"
    TESSERA_PROFILE=kernels $B bench chat --model $F --device cuda --precision bf16 --images 64x64 --prefill 64 --batch $b \
      --new-tokens 16 --iters 1 > "$OUT/profile_b$b.log" 2>&1; r=$?; status=$((status|r))
    grep "^profile" "$OUT/profile_b$b.log" | tail -1 | cut -c1-2500
  done
fi
if [[ $PARTS == *ref* ]]; then
  echo "== transformers 5.25 (bf16, sdpa), same call"
  python3 tools/device/lfm2vl_ref_bench.py $F --device cuda --prompt-tokens 64,1024,4096 --new-tokens 128 --batch 1,8,32 \
    --iters 5 > "$OUT/ref_bench.log" 2>&1; r=$?; status=$((status|r))
  grep "^{" "$OUT/ref_bench.log" | head -20; tail -3 "$OUT/ref_bench.log" | grep -v "^{"
fi
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
exit $status
