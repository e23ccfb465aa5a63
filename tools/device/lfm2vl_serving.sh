#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev/pack): issue 28's Tessera column in one
# call — LFM2-VL-450M bf16 decoding at 1, 8 and 32 streams, RUNS separate processes (the 32-stream
# figure must be stable across runs, so each run is its own process and all are printed), then the
# follow-up turn over HTTP (tools/device/lfm2vl_followup.py) at each HISTORY, then LFM2-VL-1.6B's
# one-stream decode where time is left.
#   RUNS (3), NEW (128), ITERS (3): processes, `bench chat --new-tokens`, `--iters`
#   HISTORY ("200 2000 4000"), FOLLOW_N (9): the follow-up's history sizes and conversations
#   over HTTP; FOLLOW_BENCH ("200,2000,4000"): the same turn timed inside `bench chat`
#   (`--follow-up`: the device step alone, no HTTP), in every decode run
#   PROFILE=1: one follow-up turn after 2,000 tokens under TESSERA_PROFILE=kernels
#     ($D/prof_follow.txt: where the step's time goes)
#   BIG=0: skip the 1.6B part; DEADLINE (480): seconds after which no part starts
#   REF=1: then transformers' static cache + torch.compile on the same shapes, in the same call
#     (refbench_qi21_lfm2vl.sh's lfm450s, and lfm16s with BIG=1; its own random weights), as
#     issue 28's table asks; REF_DEADLINE (300) seconds for it
# Writes under $OUT/serving/, prints one table per part, and leaves everything in
# $OUT/serving.tgz too (the device tool brings back at most 8 files).
# Build first: PACK=1 TESTS=lfm2vl_cuda tools/device/stage.sh; with REF=1 the reference's
# packages must fit beside the tree: PACK=1 TESTS="" SITE=transformers tools/device/stage.sh,
# then carry .dev/pack and .dev/tools (the staged reference scripts).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; D=$OUT/serving; mkdir -p "$D"
RUNS=${RUNS:-3} NEW=${NEW:-128} ITERS=${ITERS:-3} HISTORY=${HISTORY:-"200 2000 4000"}
FOLLOW_BENCH=${FOLLOW_BENCH:-200,2000,4000}
FOLLOW_N=${FOLLOW_N:-9} BIG=${BIG:-1} DEADLINE=${DEADLINE:-480}
export TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_ROOT=$PWD
if [ -f .dev/pack/bin.tar.xz ] && [ ! -x .dev/bin/tessera ]; then tar -C .dev -xJf .dev/pack/bin.tar.xz; fi
t0=$SECONDS
time_left() { [ $((SECONDS - t0)) -lt "$DEADLINE" ] || { echo "-- deadline: $1 skipped"; return 1; }; }
ensure() { # ensure DIR [make_lfm2vl_full.py flags]: a full-size random-weight folder
  local dir=$1; shift
  [ -f "$dir/config.json" ] && return 0
  # The staged reference packages where carried, else the machine's own transformers.
  . tools/device/pysite.sh
  if [ -f .dev/pack/site.tar.xz ] || ls .dev/whl/*.whl >/dev/null 2>&1; then
    pysite || { echo "reference packages: install failed"; return 1; }
  fi
  python3 tools/device/make_lfm2vl_full.py "$dir" "$@" > "$D/make_$(basename "$dir").log" 2>&1 \
    || { tail -5 "$D/make_$(basename "$dir").log"; return 1; }
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$D/gpu.txt"
status=0
ensure /tmp/lfm2full || exit 1
for r in $(seq "$RUNS"); do
  timeout 120 .dev/bin/tessera bench chat --model /tmp/lfm2full --device cuda --precision bf16 \
    --images 512x512 --prefill 64 --batch 1,8,32 --new-tokens "$NEW" --iters "$ITERS" \
    --follow-up "$FOLLOW_BENCH" > "$D/decode_run$r.jsonl" 2> "$D/decode_run$r.err" || status=1
done
echo "== follow-up turn inside bench chat (20 new tokens after the history; ms, one line a run)"
grep -h '"what":"follow-up"' "$D"/decode_run*.jsonl
if [ "${PROFILE:-0}" = 1 ]; then
  TESSERA_PROFILE=kernels timeout 60 .dev/bin/tessera bench chat --model /tmp/lfm2full --device cuda \
    --precision bf16 --images 64x64 --prefill 8 --batch 1 --new-tokens 2 --iters 1 --follow-up 2000 \
    > "$D/prof_follow.txt" 2>&1 || status=1
fi
python3 - "$D" "$RUNS" <<'PY' | tee "$D/decode.txt"
import json, sys
d, runs = sys.argv[1], int(sys.argv[2])
rows = {}
for r in range(1, runs + 1):
    for line in open(f"{d}/decode_run{r}.jsonl"):
        try:
            x = json.loads(line)
        except ValueError:
            continue
        if x.get("what") == "decode":
            rows.setdefault(x["batch"], {})[r] = x["tokens_per_s"]
print("LFM2-VL-450M bf16 decode, tokens/s, one process a run")
print(f"{'batch':>5} " + " ".join(f"{'run ' + str(r):>9}" for r in range(1, runs + 1)))
for b in sorted(rows):
    print(f"{b:>5} " + " ".join(f"{rows[b].get(r, float('nan')):>9.0f}" for r in range(1, runs + 1)))
PY
for h in $HISTORY; do
  time_left "follow-up $h" || break
  timeout 150 python3 tools/device/lfm2vl_followup.py --bin .dev/bin/tessera --model /tmp/lfm2full \
    --device cuda --n "$FOLLOW_N" --history "$h" --port $((18431 + h % 1000)) \
    > "$D/followup_$h.txt" 2>&1 || status=1
  echo "== follow-up, history $h"; tail -12 "$D/followup_$h.txt"
done
if [ "$BIG" = 1 ] && time_left "1.6B"; then
  if ensure /tmp/lfm16 --variant 1.6b --no-check; then
    timeout 150 .dev/bin/tessera bench chat --model /tmp/lfm16 --device cuda --precision bf16 \
      --images 512x512 --prefill 64 --batch 1 --new-tokens "$NEW" --iters "$ITERS" \
      > "$D/decode_16b.jsonl" 2> "$D/decode_16b.err" || status=1
    echo "== LFM2-VL-1.6B bf16, one stream"; grep -E '"what":"(decode|prefill)"' "$D/decode_16b.jsonl"
  else
    status=1
  fi
fi
if [ "${REF:-0}" = 1 ] && time_left "the compiled reference"; then
  . tools/device/pysite.sh
  pysite || { echo "reference packages: install failed"; status=1; }
  parts="lfm450s"; [ "$BIG" = 1 ] && parts="lfm450s lfm16s"
  OUT=$D/ref DEADLINE=${REF_DEADLINE:-300} PARTS=$parts \
    bash .dev/tools/refbench_qi21_lfm2vl.sh > "$D/ref.log" 2>&1 || status=1
  echo "== transformers, static cache + torch.compile (same call)"
  sed -n '/=== SUMMARY/,$p' "$D/ref.log" | grep -E "SUMMARY|decode|vision|FAILED|SKIP|EXIT"
fi
tar czf "$OUT/serving.tgz" -C "$D" .
exit $status
