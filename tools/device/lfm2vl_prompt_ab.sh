#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev/pack): LFM2-VL-450M's image prompt —
# host preprocessing, the prefill to the first token, and (binaries that print it) the image
# encoder alone — two binaries interleaved A B B A in one call, then one kernel profile of B's.
#   BIN_A (.dev/bin/tessera-base), BIN_B (.dev/bin/tessera)
#   IMAGES (512x512,1024x768), ITERS (10): `tessera bench chat`'s --images and --iters
#   MODEL (/tmp/lfm2full): the folder; the default, the 450M full-size random-weight folder
#     make_lfm2vl_full.py makes, is made here when absent (another, e.g. the 1.6B's from
#     `make_lfm2vl_full.py --variant 1.6b`, must exist)
# Writes JSON lines under $OUT/prompt_ab/, the table into $OUT/prompt_ab.txt and B's kernel
# profile of one 512² image prompt (a sync per kernel) into $OUT/prof_prompt.txt.
# Build first: PACK=1 TESTS=lfm2vl_cuda BASELINE=… tools/device/stage.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/prompt_ab"
IMAGES=${IMAGES:-512x512,1024x768} ITERS=${ITERS:-10}
BIN_A=${BIN_A:-.dev/bin/tessera-base} BIN_B=${BIN_B:-.dev/bin/tessera}
export TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_ROOT=$PWD
if [ -f .dev/pack/bin.tar.xz ] && [ ! -x .dev/bin/tessera ]; then tar -C .dev -xJf .dev/pack/bin.tar.xz; fi
F=${MODEL:-/tmp/lfm2full}
if [ ! -f $F/config.json ] && [ "$F" = /tmp/lfm2full ]; then
  . tools/device/pysite.sh
  pysite || { echo "reference packages: install failed"; exit 1; }
  python3 tools/device/make_lfm2vl_full.py $F > "$OUT/prompt_ab/make_full.log" 2>&1 \
    || { tail -20 "$OUT/prompt_ab/make_full.log"; exit 1; }
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  lscpu | grep -E "^Model name|^CPU\(s\)"; } | tee "$OUT/prompt_ab/machine.txt"
status=0
n=0
for side in A B B A; do
  n=$((n + 1))
  bin=BIN_$side
  timeout 120 "${!bin}" bench chat --model $F --device cuda --precision bf16 --images "$IMAGES" \
    --prefill 64 --batch 1 --new-tokens 2 --iters "$ITERS" \
    > "$OUT/prompt_ab/run${n}_$side.jsonl" 2> "$OUT/prompt_ab/run${n}_$side.err" || status=1
done
python3 - "$OUT/prompt_ab" <<'PY' | tee "$OUT/prompt_ab.txt"
import glob, json, os, statistics, sys
d = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(d, "run*.jsonl"))):
    side = path.rsplit("_", 1)[1][: -len(".jsonl")]
    for line in open(path):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("what") == "image prompt":
            for k in ("preprocess_ms", "prefill_ms"):
                rows.setdefault((r["image"], k), {}).setdefault(side, []).append(r[k])
        elif r.get("what") == "image encoder":
            rows.setdefault((r["image"], "encoder_ms"), {}).setdefault(side, []).append(r["ms"])
print(f"LFM2-VL image prompt ({os.environ.get('MODEL', '/tmp/lfm2full')}), bf16, A B B A (each run the median of its iterations): ms")
print(f"{'image':>10} {'what':>14} {'A':>22} {'B':>22} {'B/A':>6}")
fmt = lambda x: f"{statistics.median(x):.3f} ({min(x):.3f}–{max(x):.3f})" if x else "—"
for (image, k), sides in sorted(rows.items()):
    a, b = sides.get("A", []), sides.get("B", [])
    ratio = f"{statistics.median(b) / statistics.median(a):.2f}" if a and b else "—"
    print(f"{image:>10} {k:>14} {fmt(a):>22} {fmt(b):>22} {ratio:>6}")
PY
# One 512² image prompt of B under the kernel profiler: the first profile lines are the prompt's.
TESSERA_PROFILE=kernels timeout 60 "$BIN_B" bench chat --model $F --device cuda --precision bf16 \
  --images 512x512 --prefill 8 --batch 1 --new-tokens 2 --iters 1 > "$OUT/prof_prompt.txt" 2>&1 || status=1
echo "-- B, one 512² image prompt under TESSERA_PROFILE=kernels (the timed iteration's report):"
python3 - "$OUT/prof_prompt.txt" <<'PY'
import re, sys
lines = [l.rstrip() for l in open(sys.argv[1]) if l.startswith("profile")]
reports, cur = [], []
for l in lines:
    if l.startswith("profile:") and cur:
        reports.append(cur); cur = []
    cur.append(l)
if cur:
    reports.append(cur)
if len(reports) < 2:
    print("no second report"); sys.exit(0)
rep = reports[1]
parts = rep[0][len("profile: "):].split(" | ")
total = parts.pop()
rows = []
for p in parts:
    m = re.match(r"(.*) ([0-9.]+) ms \((\d+) ops", p)
    if m:
        rows.append((float(m.group(2)), int(m.group(3)), m.group(1)))
rows.sort(reverse=True)
print(total, "in", sum(r[1] for r in rows), "ops")
for ms, n, name in rows[:22]:
    print(f"{ms:8.3f} ms {n:4d}  {name}")
for l in rep[1:]:
    print(l[:600])
PY
exit $status
