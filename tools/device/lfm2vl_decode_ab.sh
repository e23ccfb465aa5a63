#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev/pack): LFM2-VL-450M decoding with an
# environment switch off and on, interleaved A B B A in one call so that drift cancels — e.g. the
# GEMV kernels (TESSERA_GEMV=0 / cuda / tc, the default) — then a table of tokens/s per batch size.
#   VAR (TESSERA_GEMV), A (0), B (tc): the switch and its two values
#   BATCH (1,8,32), NEW (128), ITERS (3): `tessera bench chat`'s --batch, --new-tokens, --iters
#   BIN_A, BIN_B (.dev/bin/tessera): the binary each side runs — a baseline build against this one
#     (stage.sh's BASELINE puts it at .dev/bin/tessera-base), e.g. VAR=X A=base B=head
#     BIN_A=.dev/bin/tessera-base
#   PROF=1: then one stream of each side under TESSERA_PROFILE=kernels (16 new tokens, a sync per
#     kernel), its last decode step's profile line into $OUT/prof_b1_{A,B}.txt and printed
#   EXTRA: more `bench chat` flags for both sides, e.g. "--temperature 0.1 --min-p 0.15
#     --repetition-penalty 1.05" (sampled on the host) or "--quantize q4_k" (block-format weights)
# Uses the full-size random-weight folder make_lfm2vl_full.py makes (made here when absent).
# Writes JSON lines under $OUT/decode_ab/ and the table into $OUT/decode_ab.txt.
# Build first: PACK=1 TESTS=lfm2vl_cuda tools/device/stage.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/decode_ab"
VAR=${VAR:-TESSERA_GEMV} A=${A:-0} B=${B:-tc}
BATCH=${BATCH:-1,8,32} NEW=${NEW:-128} ITERS=${ITERS:-3} EXTRA=${EXTRA:-}
export TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_ROOT=$PWD
if [ -f .dev/pack/bin.tar.xz ] && [ ! -x .dev/bin/tessera ]; then tar -C .dev -xJf .dev/pack/bin.tar.xz; fi
F=/tmp/lfm2full
if [ ! -f $F/config.json ]; then
  . tools/device/pysite.sh
  pysite || { echo "reference packages: install failed"; exit 1; }
  python3 tools/device/make_lfm2vl_full.py $F > "$OUT/decode_ab/make_full.log" 2>&1 \
    || { tail -20 "$OUT/decode_ab/make_full.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/decode_ab/gpu.txt"
status=0
n=0
BIN_A=${BIN_A:-.dev/bin/tessera} BIN_B=${BIN_B:-.dev/bin/tessera}
for side in A B B A; do
  n=$((n + 1))
  v=${!side}; bin=BIN_$side
  # shellcheck disable=SC2086
  env "$VAR=$v" timeout 120 "${!bin}" bench chat --model $F --device cuda --precision bf16 \
    --images 512x512 --prefill 64 --batch "$BATCH" --new-tokens "$NEW" --iters "$ITERS" $EXTRA \
    > "$OUT/decode_ab/run${n}_$v.jsonl" 2> "$OUT/decode_ab/run${n}_$v.err" || status=1
done
python3 - "$OUT/decode_ab" "$VAR" "$A" "$B" "$EXTRA" <<'PY' | tee "$OUT/decode_ab.txt"
import glob, json, os, statistics, sys
d, var, a, b, extra = sys.argv[1:]
runs = {a: {}, b: {}}
for path in sorted(glob.glob(os.path.join(d, "run*.jsonl"))):
    v = path.rsplit("_", 1)[1][: -len(".jsonl")]
    for line in open(path):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("what") == "decode":
            runs[v].setdefault(r["batch"], []).append(r["tokens_per_s"])
print(f"LFM2-VL-450M decode, bf16, {var}={a} vs {var}={b} (A B B A){', ' + extra if extra else ''}: tokens/s")
print(f"{'batch':>5} {var + '=' + a:>24} {var + '=' + b:>24} {'B/A':>6}")
for batch in sorted(set(runs[a]) | set(runs[b])):
    xa, xb = runs[a].get(batch, []), runs[b].get(batch, [])
    fa = f"{statistics.median(xa):.0f} ({min(xa):.0f}–{max(xa):.0f})" if xa else "—"
    fb = f"{statistics.median(xb):.0f} ({min(xb):.0f}–{max(xb):.0f})" if xb else "—"
    ratio = f"{statistics.median(xb) / statistics.median(xa):.2f}" if xa and xb else "—"
    print(f"{batch:>5} {fa:>24} {fb:>24} {ratio:>6}")
PY
if [ "${PROF:-0}" = 1 ]; then
  for side in A B; do
    v=${!side}; bin=BIN_$side
    # shellcheck disable=SC2086
    env "$VAR=$v" TESSERA_PROFILE=kernels timeout 60 "${!bin}" bench chat --model $F --device cuda \
      --precision bf16 --images 512x512 --prefill 64 --batch 1 --new-tokens 16 --iters 1 $EXTRA \
      > "$OUT/prof_b1_$v.txt" 2>&1 || status=1
    echo "-- one-stream profile, $VAR=$v (last decode step):"
    grep "^profile:" "$OUT/prof_b1_$v.txt" | tail -1 | python3 -c '
import re, sys
line = sys.stdin.read().strip()
parts = [p.strip() for p in line.split("|")]
print("\n".join(parts))
print("kernels a step:", sum(int(n) for n in re.findall(r"\((\d+) ops", line)))'
  done
fi
exit $status
