#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev/pack and .dev/tools): one call for a
# change to the diffusion steps' products (issues 27, 31) — the op table while the Z-Image
# full-size folder is made, the Z-Image miniature CUDA tests (FP8 included), then at 1024²:
# `--quantize fp8` generation of a baseline binary (A, .dev/bin/tessera-base) against this one
# (B), A B B A; this binary in bf16; the FP8 step's kernel profile; and diffusers' DiT step eager
# and with `compile_repeated_blocks` (../shared/tools/zimage_compile.py), in the same call; with
# `qwen` in PARTS, Qwen-Image-2.1 at 1024² (bf16, 40 steps, two processes) and diffusers' regional
# compile of its DiT (refbench_qi21_lfm2vl.sh's `qi21c`) too.
# Each phase leaves an archive in $OUT (r0.tgz …), so a call cut short keeps what it made.
# Build first: BASELINE=path/to/old/tessera PACK=1 TESTS="cuda_ops zimage_cuda" tools/device/stage.sh
#   PARTS=ops,mini,fp8,bf16,prof,compile,qwen,qfp8 (default all but qwen and qfp8; qfp8:
#   Qwen-Image-2.1 under --quantize fp8 too); ZITERS (3)
# Call it without `| tail`: the device tool keeps the last 12,000 characters itself.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-ops,mini,fp8,bf16,prof,compile}
O=/tmp/step_suite; mkdir -p $O
tar -C .dev -xJf .dev/pack/bin.tar.xz
. tools/device/pysite.sh
pysite || { echo "reference packages: install failed"; exit 1; }
export TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_ROOT=$PWD
BIN=.dev/bin/tessera BASE=.dev/bin/tessera-base
snap() { tar czf "$OUT/$1.tgz" -C $O . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee $O/gpu.txt
(
  [ -f /tmp/zfull/model_index.json ] || python3 tools/device/make_zimage_full.py /tmp/zfull \
    crates/models/assets/zimage-mini > $O/make_z.log 2>&1
  echo "zfull made: $?"
  if [[ $PARTS == *qwen* || $PARTS == *qfp8* ]]; then
    [ -f /tmp/qfull/model_index.json ] || python3 tools/device/make_qwen_image_full.py /tmp/qfull \
      crates/models/assets/qwen-image-mini > $O/make_q.log 2>&1
    echo "qfull made: $?"
  fi
) &
if [[ $PARTS == *ops* ]]; then OUT=$O/s PARTS=ops tools/device/suite.sh; fi
snap r0
wait
if [[ $PARTS == *mini* ]]; then
  timeout 120 .dev/bin/zimage_cuda --ignored --test-threads=1 --nocapture --skip full_size > $O/zimage_mini.log 2>&1
  echo "zimage_cuda (miniature) rc=$?: $(grep -E '^test result' $O/zimage_mini.log)"
  grep -E "FP8|panicked" $O/zimage_mini.log | cut -c1-300
fi
snap r1
# gen NAME BIN ARGS...: one `bench generate` process at 1024², its summary line.
gen() {
  local name=$1 bin=$2; shift 2
  timeout 240 $bin bench generate --model /tmp/zfull --device cuda --size 1024x1024 "$@" > $O/$name.log 2>&1
  printf '%-10s %-14s %s\n' "$name" "$(basename $bin)" \
    "$(grep -E 'end to end' $O/$name.log | grep -v '^{' | sed 's/.*: end to end/end to end/' | head -1 | cut -c1-110)"
  grep -E 'rror' $O/$name.log | head -3
}
if [[ $PARTS == *fp8* ]] && [ -f $BASE ]; then
  echo "== Z-Image-Turbo 1024², 8 steps, --quantize fp8: $BASE (A) against $BIN (B), A B B A"
  for s in a1 b1 b2 a2; do
    b=$BIN; [[ $s == a* ]] && b=$BASE
    gen fp8_$s $b --precision bf16 --quantize fp8 --steps 8 --iters "${ZITERS:-3}"
  done
fi
if [[ $PARTS == *bf16* ]]; then
  echo "== Z-Image-Turbo 1024², 8 steps, bf16, this binary"
  gen bf16_b1 $BIN --precision bf16 --steps 8 --iters "${ZITERS:-3}"
fi
snap r2
if [[ $PARTS == *prof* ]]; then
  echo "== FP8 step profile (TESSERA_PROFILE=kernels, 2 steps, warm run; the last step)"
  TESSERA_PROFILE=kernels timeout 200 $BIN bench generate --model /tmp/zfull --device cuda --precision bf16 \
    --quantize fp8 --size 1024x1024 --steps 2 --iters 2 > $O/fp8_prof.log 2>&1
  python3 - $O/fp8_prof.log <<'PY'
import re, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("profile:")]
if len(lines) >= 2:
    parts = lines[-2][len("profile:"):].split("|")  # the last step; the decoder's comes after it
    rows = [(float(m.group(2)), m.group(1), m.group(3)) for p in parts
            if (m := re.match(r"\s*(\S+) ([0-9.]+) ms \((\d+) ops", p))]
    print(f"step GPU time {sum(r[0] for r in rows):.2f} ms in {len(rows)} kernels (by time):")
    for ms, name, n in sorted(rows, reverse=True)[:16]:
        print(f"  {ms:8.3f} ms {n:>4} ops  {name}")
PY
  grep '^profile wall' $O/fp8_prof.log | tail -3 | cut -c1-200
  grep -iE 'rror' $O/fp8_prof.log | head -3
fi
snap r3
if [[ $PARTS == *compile* ]]; then
  echo "== diffusers 0.42.1 Z-Image DiT step, eager and compile_repeated_blocks, same call"
  timeout 240 python3 .dev/tools/zimage_compile.py > $O/compile.log 2>&1
  echo "rc=$?"; grep -E "step|warm-up|rror" $O/compile.log | tail -4
fi
snap r4
if [[ $PARTS == *qwen* ]]; then
  echo "== Qwen-Image-2.1 1024², 40 steps, bf16, this binary (two processes, median of 2 each)"
  for i in 1 2; do
    timeout 200 $BIN bench generate --model /tmp/qfull --device cuda --precision bf16 --size 1024x1024 \
      --steps 40 --iters 2 > $O/qi_$i.log 2>&1
    echo "qi_$i $(grep -E 'end to end' $O/qi_$i.log | grep -v '^{' | sed 's/.*: end to end/end to end/' | head -1 | cut -c1-110)"
  done
  snap r5
  echo "== diffusers 0.42.1 Qwen-Image-2.1 DiT, regional compile, same call"
  OUT=$O/ref PARTS="qi21c" DEADLINE=${REF_DEADLINE:-230} bash .dev/tools/refbench_qi21_lfm2vl.sh > $O/refbench.log 2>&1
  sed -n '/=== SUMMARY/,$p' $O/refbench.log | cut -c1-260
  snap r6
fi
if [[ $PARTS == *qfp8* ]]; then
  echo "== Qwen-Image-2.1 1024², 40 steps, --quantize fp8, this binary (one process, median of 2)"
  timeout 200 $BIN bench generate --model /tmp/qfull --device cuda --precision bf16 --quantize fp8 \
    --size 1024x1024 --steps 40 --iters 2 > $O/qi_fp8.log 2>&1
  echo "qi_fp8 $(grep -E 'end to end' $O/qi_fp8.log | grep -v '^{' | sed 's/.*: end to end/end to end/' | head -1 | cut -c1-110)"
  grep -iE 'rror' $O/qi_fp8.log | head -3
  snap r7
fi
