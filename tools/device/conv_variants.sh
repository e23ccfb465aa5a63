#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev/pack): the conv_ws variants side by side
# (issue 27) in one call — the op table's convolution cases under each TESSERA_CONV_WS variant
# while the full-size folders are made, `bench conv` under each, Z-Image and Qwen-Image-2.1 at 1024²
# against the baseline binary (.dev/bin/tessera-base) with this binary's default routes, then both
# families' miniature CUDA tests. Each phase leaves its archive in $OUT (cv1.tgz … cv4.tgz) and
# prints as it goes: a call cut short by the device's time still returns what it measured (run
# g16 returned nothing when an archive at the end and a `| tail` were all it had).
#   VARIANTS (default " m1 p2": unset, then each TESSERA_CONV_WS value); SKIP_GEN=1 leaves out the
#   full-size folders and the generations (a short call: op table and `bench conv` alone)
# Build first: BASELINE=path/to/old/tessera PACK=1 TESTS="cuda_ops zimage_cuda qwen_image_cuda" \
#   tools/device/stage.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
O=/tmp/conv_variants; mkdir -p $O
snap() { tar czf "$OUT/$1.tgz" -C $O . 2>/dev/null; }
tar -C .dev -xJf .dev/pack/bin.tar.xz
. tools/device/pysite.sh
pysite || { echo "reference packages: install failed"; exit 1; }
export TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_ROOT=$PWD
VARIANTS=${VARIANTS:-" m1 p2"}
IFS=' ' read -r -a VS <<< "${VARIANTS# }"
VS=("" "${VS[@]}")
[ "${SKIP_GEN:-0}" = 1 ] || (
  [ -f /tmp/zfull/model_index.json ] || python3 tools/device/make_zimage_full.py /tmp/zfull \
    crates/models/assets/zimage-mini > $O/make_z.log 2>&1
  [ -f /tmp/qfull/model_index.json ] || python3 tools/device/make_qwen_image_full.py /tmp/qfull \
    crates/models/assets/qwen-image-mini > $O/make_q.log 2>&1
  echo "folders made"
) &
# bench_phase: `bench conv` under each variant and one table of them (cv1.tgz).
bench_phase() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
  for v in "${VS[@]}"; do
    TESSERA_CONV_WS=$v timeout 200 .dev/bin/tessera bench conv --device cuda --precision bf16 --iters 20 \
      > "$O/conv_${v:-default}.jsonl" 2> "$O/conv_${v:-default}.err"
  done
  python3 - $O "${VS[@]}" <<'PY'
import json, sys
d, vs = sys.argv[1], sys.argv[2:]
rows, cols = {}, []
for v in vs:
    for line in open(f"{d}/conv_{v or 'default'}.jsonl"):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        p = r["path"] if r["path"] != "ws" else f"ws{('_' + v) if v else ''}"
        if r["path"] != "ws" and v:
            continue  # the other paths once, from the default run
        rows.setdefault(r["shape"], {})[p] = (r["median_us"], r["tflops"])
        if p not in cols:
            cols.append(p)
print(f"{'shape':<30}" + "".join(f"{p:>18}" for p in cols))
for shape, by in rows.items():
    print(f"{shape:<30}" + "".join(f"{by[p][0]:8.1f}us {by[p][1]:4.0f}T" if p in by else f"{'-':>18}" for p in cols))
print("sum of medians (us): " + ", ".join(f"{p} {sum(b[p][0] for b in rows.values() if p in b):.0f}" for p in cols))
PY
  snap cv1
}
# ops_phase: the op table's convolution cases under each variant (cv2.tgz).
ops_phase() {
  for v in "${VS[@]}"; do
    TESSERA_CONV_WS=$v TESSERA_OP_CASE=conv2d timeout 150 .dev/bin/cuda_ops --ignored --test-threads=1 --nocapture \
      > "$O/ops_${v:-default}.log" 2>&1
    echo "op table conv2d cases, TESSERA_CONV_WS=${v}: rc=$? $(grep -E '^total' "$O/ops_${v:-default}.log" | tail -1)"
    grep -E "FAILED|failed:" "$O/ops_${v:-default}.log" | head -5
  done
  snap cv2
}
# Timed work never runs beside the folders being made: the op table does, then the benchmarks.
if [ "${SKIP_GEN:-0}" = 1 ]; then
  bench_phase
  ops_phase
else
  ops_phase
  wait
  bench_phase
fi
[ "${SKIP_GEN:-0}" = 1 ] || OUT=$O/v BASE_BIN=.dev/bin/tessera-base PARTS=zimage,qwen QSTEPS=${QSTEPS:-40} tools/device/vae_ab.sh
snap cv3
for t in zimage_cuda qwen_image_cuda; do
  timeout 100 .dev/bin/$t --ignored --test-threads=1 --nocapture --skip full_size > "$O/${t}_mini.log" 2>&1
  echo "$t (miniature): rc=$? $(grep -E '^test result' "$O/${t}_mini.log" | tail -1)"
done
snap cv4
