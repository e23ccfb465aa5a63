#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev): EmbeddingGemma 2 on CUDA, parity first,
# then benchmarks against the PyTorch reference in the same call, then a short table.
#   PARTS=parity,floor,sens,bench,image,serve,burst,ref,imgref,load (default all but burst, imgref and
#   load; parity needs the floor of the full-size model, so it computes it when floor is not asked;
#   load times loading the full-size model and its peak host memory, for .dev/bin/tessera and, when
#   stage.sh was given BASELINE, .dev/bin/tessera-base;
#   bench includes image, the image rows alone, with per-kernel profiles of one image and of mixed
#   passes; imgref the reference's image rows alone, single and mixed, for runs that measure only
#   the image rows)
#   W3_DOCS=8192  W3_PASS=…  IMG_PASS=…  PROFILES="w1 w2 w3"  PROFILE_MODE=1|kernels
# Writes logs and JSON under $OUT. Build everything first with tools/device/stage.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-parity,floor,sens,bench,serve,ref}
W3_DOCS=${W3_DOCS:-8192}
W3_PASS=${W3_PASS:-16384,32768,65536}
IMG_PASS=${IMG_PASS:-16384,32768,65536}
PROFILES=${PROFILES-w1 w2 w3}  # empty: no per-op-class profiles (also of the image runs)
PROFILE_MODE=${PROFILE_MODE:-1}  # TESSERA_PROFILE for the workload profiles: 1 (op classes) or kernels
export TESSERA_CACHE_DIR=/tmp/tessera-cache
. tools/device/pysite.sh
pysite || { echo "reference packages: install failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"

# M: the shared benchmark model (speed does not depend on weights). P: the same, conditioned like a
# trained model (q/k norm weights rescaled), for parity — see make_eg2_parity.py.
M=/tmp/eg2 P=/tmp/eg2p D=/tmp/eg2data
B=.dev/bin/tessera IMG=$D/image/img_a_641x479.png
if [ ! -f $M/model.safetensors ]; then
  python3 tools/device/make_eg2_full.py $M $D --no-audio > "$OUT/make_model.log" 2>&1 || { tail -20 "$OUT/make_model.log"; exit 1; }
  python3 tools/device/make_eg2_parity.py $M $P >> "$OUT/make_model.log" 2>&1 || { tail -5 "$OUT/make_model.log"; exit 1; }
fi
export TESSERA_EG2_FULL=$P TESSERA_EG2_INPUTS=$D/bench_inputs.json TESSERA_ROOT=$PWD
export TESSERA_EG2_FLOOR=$OUT/bf16_floor.json
status=0
if [[ $PARTS == *floor* || $PARTS == *parity* ]]; then
  echo "== bf16 floor: the parity model in float64 with only a bf16 engine's storage roundings"
  python3 tools/device/eg2_bf16_floor.py full $P $D/bench_inputs.json "$TESSERA_EG2_FLOOR" 2> "$OUT/bf16_floor.err" \
    | grep "ideal bf16" || tail -5 "$OUT/bf16_floor.err"
fi
if [[ $PARTS == *parity* ]]; then
  echo "== op parity (cuda vs cpu)"
  .dev/bin/cuda_ops --ignored --test-threads=1 --nocapture > "$OUT/cuda_ops.log" 2>&1; r=$?; status=$((status|r))
  grep -E "test result|panicked" -A1 "$OUT/cuda_ops.log" | head -12
  echo "== model parity (text and vision fixtures, full-size vs cpu, long-input error, OOM split)"
  .dev/bin/egemma2_cuda --ignored --test-threads=1 --nocapture > "$OUT/egemma2_cuda.log" 2>&1; r=$?; status=$((status|r))
  grep -E "test result|panicked|worst|documents of" -A1 "$OUT/egemma2_cuda.log" | grep -v "^--" | head -24
fi
if [[ $PARTS == *load* ]]; then
  # Wall time and peak host memory (ru_maxrss of the child) of a process that loads the full-size
  # model on the GPU and embeds one short text; three runs each, page cache warm after the first.
  echo "== load: full-size model on cuda, wall s and peak RSS MB (3 runs; new, then baseline)"
  for bin in .dev/bin/tessera .dev/bin/tessera-base; do
    [ -x $bin ] || continue
    for i in 1 2 3; do
      python3 -c 'import resource, subprocess, sys, time
t = time.time(); r = subprocess.run(sys.argv[1:], capture_output=True)
print(f"{sys.argv[1]} run {'"$i"'}: {time.time() - t:.2f} s, peak RSS {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f} MB, rc {r.returncode}")' \
        $bin embed --model $M --device cuda --text "which planet is red?" | tee -a "$OUT/load.txt"
    done
  done
fi
if [[ $PARTS == *sens* ]]; then
  echo "== rounding sensitivity vs torch float64: shared model, then the parity model"
  for model in $P; do  # the shared model $M was measured in an earlier run (BENCHMARKS.md)
    python3 tools/device/eg2_sensitivity.py $model $D/bench_inputs.json $B "$OUT/sensitivity_$(basename $model).json" \
      2> "$OUT/sensitivity_$(basename $model).err" || tail -5 "$OUT/sensitivity_$(basename $model).err"
  done
fi
if [[ $PARTS == *bench* ]]; then
  echo "== tessera bench"
  $B bench gemm --device cuda > "$OUT/bench_gemm.jsonl" 2>&1
  CEIL=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["tflops"])' "$OUT/bench_gemm.jsonl")
  $B bench attention --device cuda > "$OUT/bench_attention.jsonl" 2>&1
  $B bench embed --device cuda --model $M --inputs $D/bench_inputs.json --w3-docs "$W3_DOCS" --w3-pass-tokens "$W3_PASS" --ceiling-tflops "$CEIL" \
     > "$OUT/bench_embed.jsonl" 2> "$OUT/bench_embed.err"
  for w in $PROFILES; do
    TESSERA_PROFILE=$PROFILE_MODE $B bench embed --device cuda --model $M --inputs $D/bench_inputs.json --workloads $w \
       --w3-docs 256 --w3-pass-tokens 65536 > /dev/null 2> "$OUT/profile_$w.txt"
  done
  cat "$OUT/bench_gemm.jsonl" "$OUT/bench_attention.jsonl" "$OUT/bench_embed.jsonl"
  tail -n 2 "$OUT/bench_embed.err"
  for w in $PROFILES; do tail -1 "$OUT/profile_$w.txt"; done
fi
if [[ $PARTS == *bench* || $PARTS == *image* ]]; then
  echo "== tessera bench image"
  $B bench image --device cuda --model $M --image $IMG --pass-patches "$IMG_PASS" > "$OUT/bench_image.jsonl" 2> "$OUT/bench_image.err"
  cat "$OUT/bench_image.jsonl"; tail -n 2 "$OUT/bench_image.err"
  if [ -n "$PROFILES" ]; then
    # GPU time per op class of one image's forward, warm (graph replay off): the rest is host time.
    TESSERA_PROFILE=1 $B bench image --device cuda --model $M --image $IMG --images 8 \
      --pass-patches 16384 > /dev/null 2> "$OUT/profile_image.txt"
    sed -n '40,41p' "$OUT/profile_image.txt"
    # Per-kernel GPU time of the mixed-size passes (64 images, one 65,536-patch pass size).
    TESSERA_PROFILE=kernels $B bench image --device cuda --model $M --image $IMG --images 64 \
      --pass-patches 65536 > /dev/null 2> "$OUT/profile_image_mixed.txt"
    tail -n 30 "$OUT/profile_image_mixed.txt"
  fi
fi
if [[ $PARTS == *serve* ]]; then
  echo "== tessera bench serve (loopback, full-size model): lanes, then fifo"
  for sched in lanes fifo; do
    $B bench serve --model $M --device cuda --schedule $sched --requests 2000 --phase-secs 20 \
      --clients 1,16 --image-clients 4 --image-size 1024x768 --max-queue 64 --burst 256 --burst-images 4 --check \
      --server-log "$OUT/serve_$sched.server.log" > "$OUT/serve_$sched.jsonl" 2> "$OUT/serve_$sched.err"; r=$?; status=$((status|r))
    cat "$OUT/serve_$sched.jsonl"; tail -n 3 "$OUT/serve_$sched.err"
  done
fi
if [[ $PARTS == *burst* ]]; then
  # Is memory bounded by the server's limits rather than by the burst? The same burst at 4× the size.
  # --max-rss-growth-mb: the server's 2,048 MiB decoded-image budget plus 512 MiB for bodies in flight.
  echo "== serve bursts of 256 and 1024 requests × 4 images (max queue 64)"
  for n in 256 1024; do
    $B bench serve --model $M --device cuda --requests 100 --phase-secs 5 --clients 16 --image-clients 4 \
      --image-size 1024x768 --max-queue 64 --burst $n --burst-images 4 --check --max-rss-growth-mb 2560 \
      > "$OUT/burst_$n.jsonl" 2> "$OUT/burst_$n.err"; r=$?; status=$((status|r))
    grep -v tower_http "$OUT/burst_$n.err" | tail -n 9
  done
fi
if [[ $PARTS == *imgref* ]]; then
  echo "== reference image rows (transformers 5.25, bf16, sdpa)"
  python3 tools/device/eg2_image_ref.py $M > "$OUT/ref_images.jsonl" 2> "$OUT/ref_images.err"
  grep '^{' "$OUT/ref_images.jsonl"; tail -n 2 "$OUT/ref_images.err"
elif [[ $PARTS == *ref* ]]; then
  echo "== reference (transformers 5.25, bf16, sdpa)"
  python3 .dev/tools/refbench.py --only egemma2 > "$OUT/refbench.jsonl" 2> "$OUT/refbench.err"
  python3 tools/device/eg2_image_ref.py $M > "$OUT/ref_images.jsonl" 2> "$OUT/ref_images.err"
  grep '^{' "$OUT/refbench.jsonl" "$OUT/ref_images.jsonl"; tail -n 2 "$OUT/refbench.err" "$OUT/ref_images.err"
fi
# The device tool returns at most 8 files: everything travels as one archive.
(cd "$OUT" && tar czf /tmp/logs.tgz --exclude='*.server.log' . && find . -mindepth 1 -delete && mv /tmp/logs.tgz .)
exit $status
