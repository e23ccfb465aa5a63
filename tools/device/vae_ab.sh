#!/usr/bin/env bash
# On the GPU machine (via the `device` tool): the VAE decoders' convolution routes side by side
# (issue 27) in one call — `bench conv` on every kernel path at the decoders' shapes, then Z-Image
# and Qwen-Image-2.1 at 1024² with the default route against TESSERA_CONV=$B_ROUTE (A B B A for
# Z-Image) or, with BASE_BIN, a baseline binary (A) against this one (B), both on the default
# route; then a warm Z-Image generation under TESSERA_PROFILE=kernels for where the decode goes.
#   OUT (default /tmp/out), ZITERS (3), QSTEPS (40), QITERS (2), B_ROUTE (mma), BASE_BIN,
#   PROF_CONV (the profiles' TESSERA_CONV, default unset),
#   PARTS=conv,zimage,qwen,prof,qprof (prof: Z-Image's decode profile; qprof: Qwen-Image-2.1's)
# Needs .dev/bin/tessera and the full-size folders (/tmp/zfull, /tmp/qfull: suite.sh makes them,
# with the reference's packages from pysite.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-conv,zimage,qwen,prof}
B_ROUTE=${B_ROUTE:-mma}
export TESSERA_CACHE_DIR=${TESSERA_CACHE_DIR:-/tmp/tessera-cache} TESSERA_ROOT=$PWD
BIN=.dev/bin/tessera
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"

if [[ $PARTS == *conv* ]]; then
  echo "== bench conv (median of 20, µs and TFLOP/s per kernel path)"
  timeout 240 $BIN bench conv --device cuda --precision bf16 --iters 20 > "$OUT/conv.jsonl" 2> "$OUT/conv.err"
  python3 - "$OUT/conv.jsonl" <<'PY'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    rows.setdefault(r["shape"], {})[r["path"]] = (r["median_us"], r["tflops"])
paths = ["ws", "wgmma", "implicit", "im2col"]
print(f"{'shape':<32}" + "".join(f"{p:>20}" for p in paths))
for shape, by in rows.items():
    cells = "".join(f"{by[p][0]:9.1f} us {by[p][1]:5.0f}T" if p in by else f"{'-':>20}" for p in paths)
    print(f"{shape:<32}{cells}")
tot = {p: sum(by[p][0] for by in rows.values() if p in by) for p in paths}
print("sum of medians (µs): " + ", ".join(f"{p} {v:.0f}" for p, v in tot.items()))
PY
  tail -3 "$OUT/conv.err"
fi

# gen NAME SIDE MODEL ARGS...: one `bench generate` process for side A or B: with BASE_BIN, A is
# that binary and B this one; else both this binary, B with TESSERA_CONV=$B_ROUTE.
gen() {
  local name=$1 side=$2 model=$3 bin=$BIN route="" label; shift 3
  if [ -n "${BASE_BIN:-}" ]; then
    [ "$side" = A ] && bin=$BASE_BIN
    label=$(basename "$bin")
  else
    [ "$side" = B ] && route=$B_ROUTE
    label=${route:-default}
  fi
  TESSERA_CONV=$route timeout 200 $bin bench generate --model "$model" --device cuda --precision bf16 \
    --size 1024x1024 "$@" > "$OUT/$name.log" 2>&1
  printf '%-8s %-14s %s\n' "$name" "$label" \
    "$(grep -E 'end to end|step|decode' "$OUT/$name.log" | grep -v '^{' | sed 's/.*: end to end/end to end/' | tr '\n' ' ' | cut -c1-110)"
  grep -E 'rror' "$OUT/$name.log" | head -3
}
what() { if [ -n "${BASE_BIN:-}" ]; then echo "$BASE_BIN (A) against $BIN (B)"; else echo "default (A) against TESSERA_CONV=$B_ROUTE (B)"; fi; }

if [[ $PARTS == *zimage* ]] && [ -f /tmp/zfull/model_index.json ]; then
  echo "== Z-Image-Turbo 1024², 8 steps, bf16: $(what), A B B A"
  gen zi_a1 A /tmp/zfull --steps 8 --iters "${ZITERS:-3}"
  gen zi_b1 B /tmp/zfull --steps 8 --iters "${ZITERS:-3}"
  gen zi_b2 B /tmp/zfull --steps 8 --iters "${ZITERS:-3}"
  gen zi_a2 A /tmp/zfull --steps 8 --iters "${ZITERS:-3}"
fi
if [[ $PARTS == *qwen* ]] && [ -f /tmp/qfull/model_index.json ]; then
  echo "== Qwen-Image-2.1 1024², ${QSTEPS:-40} steps, bf16: $(what), A B"
  gen qi_a A /tmp/qfull --steps "${QSTEPS:-40}" --iters "${QITERS:-2}"
  gen qi_b B /tmp/qfull --steps "${QSTEPS:-40}" --iters "${QITERS:-2}"
fi
# prof_decode NAME MODEL: a warm generation under TESSERA_PROFILE=kernels (the first run of a
# process is cold: allocations, heuristics), then the decoder's kernels by time and the stream's
# gaps (the last forward of the run is the decoder).
prof_decode() {
  local name=$1 model=$2
  echo "== $name decode profile (TESSERA_PROFILE=kernels, TESSERA_CONV=${PROF_CONV:-}; the last forward of a warm run is the decoder)"
  TESSERA_CONV=${PROF_CONV:-} TESSERA_PROFILE=kernels timeout 200 $BIN bench generate --model "$model" --device cuda --precision bf16 \
    --size 1024x1024 --steps 2 --iters 2 > "$OUT/${name}_prof.log" 2>&1
  grep -E 'end to end' "$OUT/${name}_prof.log" | head -1
  python3 - "$OUT/${name}_prof.log" <<'PY'
import re, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("profile:")]
if lines:
    parts = lines[-1][len("profile:"):].split("|")
    rows = [(float(m.group(2)), m.group(1), m.group(3)) for p in parts
            if (m := re.match(r"\s*(\S+) ([0-9.]+) ms \((\d+) ops", p))]
    print(f"decoder GPU time {sum(r[0] for r in rows):.2f} ms in {len(rows)} kernels (by time):")
    for ms, name, n in sorted(rows, reverse=True)[:30]:
        print(f"  {ms:8.3f} ms {n:>4} ops  {name}")
PY
  grep '^profile gaps:' "$OUT/${name}_prof.log" | tail -1 | tr '|' '\n' | cut -c1-200
  grep -iE 'rror' "$OUT/${name}_prof.log" | head -3
}
if [[ ",$PARTS," == *,prof,* ]] && [ -f /tmp/zfull/model_index.json ]; then prof_decode zi /tmp/zfull; fi
if [[ ",$PARTS," == *,qprof,* ]] && [ -f /tmp/qfull/model_index.json ]; then prof_decode qi /tmp/qfull; fi
