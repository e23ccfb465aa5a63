#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev/pack, .dev/whl and .dev/tools): the
# Hopper attention work of issue 27 in one call —
#   1. the whole op table (cuda_ops: every op, f32 and bf16, every flash kernel forced);
#   2. `tessera bench attention` and PyTorch SDPA on the same shapes;
#   3. Nsight Compute on one launch of each head-128 flash kernel (speed of light, warp stalls);
#   4. Z-Image-Turbo full size, 1024², 8 steps: `bench generate` with the op's default attention
#      (TESSERA_FLASH_WS=0, flash_wgmma) and with flash_ws (=1), alternating A B B A, then a
#      TESSERA_PROFILE=kernels generation with flash_ws;
#   5. the diffusers DiT step eager and with compile_repeated_blocks (../shared/tools/zimage_compile.py);
#   6. (floor) the Z-Image and Qwen-Image miniatures' CUDA tests with flash_ws as the attention
#      (TESSERA_FLASH_WS=1): f32 parity and bf16 within 1.5× of its storage floor per tap;
#   7. (ref) the diffusers Z-Image pipeline eager end to end (../shared/tools/refbench.py).
#   PARTS=ops,attn,ncu,zimage,compile,floor,ref (default all but floor and ref);
#   OPS_CASE=attention runs only the op table's attention cases. Build first:
#   PACK=1 TESTS="cuda_ops zimage_cuda qwen_image_cuda" tools/device/stage.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-ops,attn,ncu,zimage,compile}
export TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_ROOT=$PWD
if [ -f .dev/pack/bin.tar.xz ] && [ ! -x .dev/bin/tessera ]; then tar -C .dev -xJf .dev/pack/bin.tar.xz; fi
. tools/device/pysite.sh
pysite || { echo "reference packages: install failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
B=.dev/bin/tessera Z=/tmp/zfull
status=0
if [[ $PARTS == *ops* ]]; then
  echo "== op table (cuda vs cpu, f32 and bf16, every kernel)"
  TESSERA_OP_CASE=${OPS_CASE:-} timeout 300 .dev/bin/cuda_ops --ignored --test-threads=1 --nocapture > "$OUT/cuda_ops.log" 2>&1; r=$?; status=$((status|r))
  grep -E "^attention |^total|test result|panicked|FAIL|newly|expected to be" "$OUT/cuda_ops.log" | head -20
fi
if [[ $PARTS == *zimage* ]]; then
  if [ ! -f $Z/model_index.json ]; then
    python3 tools/device/make_zimage_full.py $Z crates/models/assets/zimage-mini > "$OUT/make_zfull.log" 2>&1 \
      || { tail -20 "$OUT/make_zfull.log"; exit 1; }
  fi
  $B bench gemm --device cuda > "$OUT/gemm.log" 2>&1; grep -v gemm_shape "$OUT/gemm.log" | head -3
  echo "== Z-Image 1024², 8 steps, bf16: flash_wgmma (ws=0) and flash_ws (ws=1), A B B A"
  for ws in 0 1 1 0; do
    TESSERA_FLASH_WS=$ws $B bench generate --model $Z --device cuda --precision bf16 --size 1024x1024 --steps 8 \
      --iters 3 > "$OUT/gen_ws$ws.log.tmp" 2>&1 || status=1
    cat "$OUT/gen_ws$ws.log.tmp" >> "$OUT/gen_ws$ws.log"; rm -f "$OUT/gen_ws$ws.log.tmp"
    grep -E "end to end" "$OUT/gen_ws$ws.log" | tail -1 | sed "s/^/ws=$ws /"
  done
  TESSERA_FLASH_WS=1 TESSERA_PROFILE=kernels $B bench generate --model $Z --device cuda --precision bf16 \
    --size 1024x1024 --iters 1 > "$OUT/profile_ws1.log" 2>&1 || status=1
  grep "^profile" "$OUT/profile_ws1.log" | tail -10 | sed -n '5p' | tr ',' '\n' | grep -iE "attention|flash" | head -5
fi
if [[ $PARTS == *floor* ]]; then
  echo "== miniatures with flash_ws (TESSERA_FLASH_WS=1): f32 parity, bf16 against its storage floor"
  for t in zimage_cuda qwen_image_cuda; do
    TESSERA_FLASH_WS=1 timeout 200 .dev/bin/$t --ignored --test-threads=1 --nocapture --skip full_size \
      > "$OUT/${t}_ws.log" 2>&1; r=$?; status=$((status|r))
    grep -E "f32:|bf16:|floor|test result|panicked" "$OUT/${t}_ws.log" | head -12 | cut -c1-220
  done
fi
if [[ $PARTS == *ref* ]]; then
  echo "== diffusers 0.42.1 Z-Image eager end to end, same call"
  timeout 200 python3 .dev/tools/refbench.py --only zimage > "$OUT/refbench.log" 2>&1 || status=1
  sed -n '/SUMMARY/,$p' "$OUT/refbench.log" | head -12
fi
if [[ $PARTS == *compile* ]]; then
  echo "== diffusers 0.42.1 DiT step, eager and compile_repeated_blocks, same call"
  timeout 200 python3 .dev/tools/zimage_compile.py > "$OUT/compile.log" 2>&1 || status=1
  grep -E "step|warm-up" "$OUT/compile.log" | tail -3
fi
if [[ $PARTS == *attn* ]]; then
  echo "== bench attention (median of 20) and PyTorch SDPA, same call"
  timeout 200 $B bench attention --device cuda > "$OUT/bench_attention.jsonl" 2>&1 || status=1
  timeout 120 python3 tools/device/sdpa_ref.py > "$OUT/sdpa_ref.jsonl" 2>&1 || status=1
  python3 - "$OUT/bench_attention.jsonl" "$OUT/sdpa_ref.jsonl" <<'PY'
import json, sys
def rows(path):
    for line in open(path):
        try:
            yield json.loads(line)
        except ValueError:
            print(line.rstrip())
for r in rows(sys.argv[1]):
    if r["shape"] in ("dit 4224x30x128", "4096x16x64", "image 2394 patches") and (r["kv_splits"] == 1 or r["chosen"]):
        print(f"tessera {r['shape']:<20} {str(r.get('kernel')):<6} chunks={r['kv_splits']} {r['median_ms'] * 1e3:8.1f} us {r['tflops']:6.1f} TFLOP/s")
for r in rows(sys.argv[2]):
    if "error" not in r:
        print(f"sdpa    {r['shape']:<20} {r['backend']:<20} {r['median_ms'] * 1e3:8.1f} us {r['tflops']:6.1f} TFLOP/s")
PY
fi
if [[ $PARTS == *ncu* ]]; then
  echo "== ncu: one launch each of flash_wgmma_d128 and flash_ws_d128 (dit 4224x30x128)"
  for k in flash_wgmma_d128 flash_ws_d128; do
    timeout 150 ncu --clock-control none --kernel-name "$k" --launch-count 1 --section SpeedOfLight \
      --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
      $B bench attention --device cuda > "$OUT/ncu_$k.log" 2>&1
    grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|Achieved Occupancy|Stall|Warp Cycles Per Issued|Registers Per" "$OUT/ncu_$k.log" | head -14 | sed "s/^/$k /"
  done
fi
(cd "$OUT" && tar czf logs.tgz ./*.log ./*.jsonl 2>/dev/null && rm -f ./*.log ./*.jsonl)
exit $status
