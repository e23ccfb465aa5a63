#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev/pack, .dev/whl and .dev/tools): the whole
# GPU suite at one commit — the op table, every family's CUDA tests on its miniature, then each
# full-size part (Qwen-Image-2.1, Z-Image, LFM2-VL, EmbeddingGemma 2 with its bf16 floor) — and,
# while time is left, the Tessera side of issue 27's table (cuBLASLt ceiling, attention beside
# SDPA, Z-Image and Qwen-Image-2.1 generation at 1024²). Prints one line per part.
#   DEADLINE: seconds after which no further part starts (default 520)
#   PARTS=ops,gemv,pdl,mini,qfull,zfull,lfull,efull,attn,gen,quant,offload (default all; gemv: the
#     CUDA-core GEMV's products and decode A/B against the tensor-core default; pdl: decode A/B
#     without programmatic dependent launch (TESSERA_PDL=0) against the default; quant: Z-Image with FP8 products and
#     Qwen-Image-2.1 with Q4_K matrices; offload: both with --offload; each generation part with
#     its peak device memory)
# Build first: PACK=1 TESTS="cuda_ops egemma2_cuda zimage_cuda lfm2vl_cuda qwen_image_cuda" \
#   tools/device/stage.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-ops,gemv,pdl,mini,qfull,zfull,lfull,efull,attn,gen,quant,offload}
DEADLINE=${DEADLINE:-520}
export TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_ROOT=$PWD
if [ -f .dev/pack/bin.tar.xz ]; then tar -C .dev -xJf .dev/pack/bin.tar.xz; fi
. tools/device/pysite.sh
pysite || { echo "reference packages: install failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
B=.dev/bin/tessera
status=0
t0=$SECONDS

# time_left: whether the next part may start.
time_left() { [ $((SECONDS - t0)) -lt "$DEADLINE" ] || { echo "-- deadline: $1 skipped"; return 1; }; }
# part NAME LOG CMD...: run CMD into LOG, print its test summary and time, fold its status in.
part() {
  local name=$1 log=$2; shift 2
  local s=$SECONDS
  "$@" > "$OUT/$log" 2>&1; local r=$?
  status=$((status | r))
  printf '%-34s rc=%-3s %4ss  %s\n' "$name" "$r" "$((SECONDS - s))" \
    "$(grep -E '^test result' "$OUT/$log" | sed 's/test result: //; s/; 0 measured//; s/ filtered out//' | tr '\n' ' ' | cut -c1-120)"
  grep -E "panicked|^failures:|> [0-9.e-]+ *\"?,?$" "$OUT/$log" | head -8
}

if [[ $PARTS == *ops* ]] && time_left ops; then
  part "cuda_ops (op table)" cuda_ops.log timeout 240 .dev/bin/cuda_ops --ignored --test-threads=1 --nocapture
  grep -E "^total|declined" "$OUT/cuda_ops.log" | tail -3
fi
if [[ $PARTS == *gemv* ]] && time_left gemv; then
  # The CUDA-core GEMV (TESSERA_GEMV=cuda; the default is the tensor-core one): its products
  # against the CPU and its batch invariance, then LFM2-VL decoding on both (A B B A).
  TESSERA_GEMV=cuda TESSERA_OP_CASE=matmul part "cuda_ops matmul, TESSERA_GEMV=cuda" cuda_ops_cc.log \
    timeout 150 .dev/bin/cuda_ops --ignored --test-threads=1 --nocapture ops_match_cpu decoding_rows
  grep -E "^== matmul" "$OUT/cuda_ops_cc.log"
  OUT=$OUT/gemv_ab VAR=TESSERA_GEMV A=cuda B=tc BATCH=${GEMV_BATCH:-1,8,16} ITERS=2 \
    timeout 200 tools/device/lfm2vl_decode_ab.sh | tail -5
fi
if [[ $PARTS == *pdl* ]] && time_left pdl; then
  # Every kernel launched as before (TESSERA_PDL=0) against programmatic dependent launch, the
  # default on Hopper: LFM2-VL decoding A B B A, where ~160 small kernels a token feel launch gaps.
  OUT=$OUT/pdl_ab VAR=TESSERA_PDL A=0 B=1 BATCH=${PDL_BATCH:-1,8,16} ITERS=2 \
    timeout 200 tools/device/lfm2vl_decode_ab.sh | tail -5
fi
if [[ $PARTS == *mini* ]] && time_left mini; then
  part "egemma2_cuda (fixtures)" eg2_mini.log .dev/bin/egemma2_cuda --ignored --test-threads=1 --nocapture \
    --skip full_size --skip too_large
  for t in zimage_cuda qwen_image_cuda lfm2vl_cuda; do
    part "$t (miniature)" "${t}_mini.log" .dev/bin/$t --ignored --test-threads=1 --nocapture --skip full_size
    grep -E "f32:|bf16:" "$OUT/${t}_mini.log" | head -4 | cut -c1-200
  done
fi
# The full-size random-weight folders, made once per machine.
ensure_qfull() {
  [ -f /tmp/qfull/model_index.json ] || python3 tools/device/make_qwen_image_full.py /tmp/qfull \
    crates/models/assets/qwen-image-mini > "$OUT/make_qfull.log" 2>&1 || tail -5 "$OUT/make_qfull.log"
}
ensure_zfull() {
  [ -f /tmp/zfull/model_index.json ] || python3 tools/device/make_zimage_full.py /tmp/zfull \
    crates/models/assets/zimage-mini > "$OUT/make_zfull.log" 2>&1 || tail -5 "$OUT/make_zfull.log"
}
# peak_mib CMD...: run CMD while sampling the whole device's used memory (nvidia-smi, every 50 ms);
# prints the peak in MiB after CMD's own output.
peak_mib() {
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 > "$OUT/mem.txt" &
  local smi=$!
  "$@"; local r=$?
  kill $smi; wait $smi 2>/dev/null
  echo "peak GPU memory (whole device, nvidia-smi): $(sort -n "$OUT/mem.txt" | tail -1) MiB"
  return $r
}

if [[ $PARTS == *qfull* ]] && time_left qfull; then
  ensure_qfull
  TESSERA_QI_FULL=/tmp/qfull part "qwen_image_cuda (full size)" qi_full.log timeout 300 \
    .dev/bin/qwen_image_cuda --ignored --test-threads=1 --nocapture full_size
  grep -E "full size|layer|velocity" "$OUT/qi_full.log" | grep -v "^test " | head -12 | cut -c1-220
fi
if [[ $PARTS == *zfull* ]] && time_left zfull; then
  ensure_zfull
  TESSERA_ZI_FULL=/tmp/zfull part "zimage_cuda (full size)" zi_full.log timeout 300 \
    .dev/bin/zimage_cuda --ignored --test-threads=1 --nocapture full_size
  grep -E "f32:|bf16:|full size" "$OUT/zi_full.log" | grep -v "^test " | head -4 | cut -c1-220
fi
if [[ $PARTS == *lfull* ]] && time_left lfull; then
  [ -f /tmp/lfm2full/config.json ] || python3 tools/device/make_lfm2vl_full.py /tmp/lfm2full \
    > "$OUT/make_lfull.log" 2>&1 || tail -5 "$OUT/make_lfull.log"
  TESSERA_LFM2_FULL=/tmp/lfm2full part "lfm2vl_cuda (full size)" lfm2_full.log timeout 200 \
    .dev/bin/lfm2vl_cuda --ignored --test-threads=1 --nocapture full_size
  grep -E "full size" "$OUT/lfm2_full.log" | grep -v "^test " | head -4 | cut -c1-220
fi
if [[ $PARTS == *efull* ]] && time_left efull; then
  M=/tmp/eg2 P=/tmp/eg2p D=/tmp/eg2data
  if [ ! -f $P/model.safetensors ]; then
    python3 tools/device/make_eg2_full.py $M $D --no-audio > "$OUT/make_eg2.log" 2>&1 \
      && python3 tools/device/make_eg2_parity.py $M $P >> "$OUT/make_eg2.log" 2>&1 || tail -5 "$OUT/make_eg2.log"
  fi
  python3 tools/device/eg2_bf16_floor.py full $P $D/bench_inputs.json "$OUT/eg2_floor.json" 2> "$OUT/eg2_floor.err" \
    | grep "ideal bf16" | head -2 || tail -3 "$OUT/eg2_floor.err"
  TESSERA_EG2_FULL=$P TESSERA_EG2_INPUTS=$D/bench_inputs.json TESSERA_EG2_FLOOR=$OUT/eg2_floor.json \
    part "egemma2_cuda (full size)" eg2_full.log timeout 240 .dev/bin/egemma2_cuda --ignored --test-threads=1 --nocapture
  grep -E "worst|documents of" "$OUT/eg2_full.log" | head -6 | cut -c1-220
fi
echo "-- suite: status $status after $((SECONDS - t0)) s"

if [[ $PARTS == *attn* ]] && time_left attn; then
  echo "== attention (median of 20; TFLOP/s), then PyTorch SDPA in this call"
  timeout 120 $B bench attention --device cuda > "$OUT/bench_attention.jsonl" 2>&1
  python3 tools/device/attn_table.py "$OUT/bench_attention.jsonl"
  if [ -x .dev/bin/tessera-base ]; then
    echo "-- the baseline binary (.dev/bin/tessera-base), same call"
    timeout 120 .dev/bin/tessera-base bench attention --device cuda > "$OUT/bench_attention_base.jsonl" 2>&1
    python3 tools/device/attn_table.py "$OUT/bench_attention_base.jsonl" base
  fi
  timeout 120 python3 tools/device/sdpa_ref.py > "$OUT/sdpa_ref.jsonl" 2>&1
  python3 tools/device/attn_table.py "$OUT/sdpa_ref.jsonl"
fi
if [[ $PARTS == *gen* ]] && time_left gen; then
  ensure_zfull
  echo "== cuBLASLt bf16 ceiling"
  $B bench gemm --device cuda > "$OUT/gemm.log" 2>&1; grep -v gemm_shape "$OUT/gemm.log" | head -3
  echo "== Z-Image 1024², 8 steps, bf16 (5 iterations)"
  timeout 150 $B bench generate --model /tmp/zfull --device cuda --precision bf16 --size 1024x1024 --steps 8 \
    --iters 5 > "$OUT/zi_gen.log" 2>&1
  grep -E "end to end|step|decode|rror" "$OUT/zi_gen.log" | grep -v "^{" | head -6
  echo "== the same with every convolution on im2col (TESSERA_CONV=im2col; the default takes the implicit GEMM)"
  TESSERA_CONV=im2col timeout 150 $B bench generate --model /tmp/zfull --device cuda --precision bf16 \
    --size 1024x1024 --steps 8 --iters 5 > "$OUT/zi_gen_im2col.log" 2>&1
  grep -E "end to end|step|decode|rror" "$OUT/zi_gen_im2col.log" | grep -v "^{" | head -6
fi
if [[ $PARTS == *gen* ]] && time_left qgen; then
  ensure_qfull
  echo "== Qwen-Image-2.1 1024², 40 steps, bf16 (2 iterations)"
  peak_mib timeout 120 $B bench generate --model /tmp/qfull --device cuda --precision bf16 --size 1024x1024 \
    --steps 40 --iters 2 > "$OUT/qi_gen.log" 2>&1
  grep -E "end to end|step|decode|rror" "$OUT/qi_gen.log" | grep -v "^{" | head -6
fi
if [[ $PARTS == *quant* ]] && time_left quant; then
  ensure_zfull
  echo "== Z-Image 1024², 8 steps, FP8 products (--quantize fp8; 5 iterations)"
  peak_mib timeout 150 $B bench generate --model /tmp/zfull --device cuda --precision bf16 --quantize fp8 \
    --size 1024x1024 --steps 8 --iters 5 > "$OUT/zi_gen_fp8.log" 2>&1
  grep -E "end to end|step|decode|rror" "$OUT/zi_gen_fp8.log" | grep -v "^{" | head -6
fi
if [[ $PARTS == *quant* ]] && time_left qquant; then
  ensure_qfull
  echo "== Qwen-Image-2.1 1024², 40 steps, every matrix Q4_K (--quantize q4_k; 2 iterations)"
  peak_mib timeout 150 $B bench generate --model /tmp/qfull --device cuda --precision bf16 --quantize q4_k \
    --size 1024x1024 --steps 40 --iters 2 > "$OUT/qi_gen_q4k.log" 2>&1
  grep -E "end to end|step|decode|rror" "$OUT/qi_gen_q4k.log" | grep -v "^{" | head -6
fi
if [[ $PARTS == *offload* ]] && time_left offload; then
  # --offload: one component on the device at a time (text encoder, transformer, VAE decoder);
  # the peak against the resident gen/quant parts' above.
  ensure_zfull
  echo "== Z-Image 1024², 8 steps, bf16, --offload (one image)"
  peak_mib timeout 120 $B generate --model /tmp/zfull --device cuda --precision bf16 --offload --size 1024x1024 \
    --steps 8 --prompt "a red fox in the snow" --seed 1 --out "$OUT/zi_offload.png" 2>&1 | tail -2
  ensure_qfull
  echo "== Qwen-Image-2.1 1024², 40 steps, --offload --quantize q4_k (one image; quantizing at load included)"
  peak_mib timeout 300 $B generate --model /tmp/qfull --device cuda --precision bf16 --offload --quantize q4_k \
    --size 1024x1024 --steps 40 --prompt "a red fox in the snow" --seed 1 --out "$OUT/qi_offload_q4k.png" 2>&1 | tail -2
fi
(cd "$OUT" && tar czf logs.tgz ./*.log ./*.jsonl ./*.err 2>/dev/null && rm -f ./*.log ./*.err)
echo "-- total $((SECONDS - t0)) s, status $status"
exit $status
