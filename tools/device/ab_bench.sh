#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev): the same EmbeddingGemma 2 benchmarks
# with two tessera binaries interleaved A B B A on one machine, so that drift between them
# cancels: `bench embed` (W1, W2, W3) and `bench image`. A = .dev/bin/tessera-base (stage.sh with
# BASELINE=…), B = .dev/bin/tessera. Uses the full-size model eg2_cuda.sh makes (made here when
# absent). Writes JSON lines under $OUT and prints a table of medians.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
A=${A:-.dev/bin/tessera-base} B=${B:-.dev/bin/tessera}
M=/tmp/eg2 D=/tmp/eg2data
export TESSERA_CACHE_DIR=/tmp/tessera-cache
if [ ! -f $M/model.safetensors ]; then
  . tools/device/pysite.sh
  pysite || { echo "reference packages: install failed"; exit 1; }
  python3 .dev/tools/make_eg2_full.py $M $D --no-audio > "$OUT/make_model.log" 2>&1 || { tail -20 "$OUT/make_model.log"; exit 1; }
fi
CEIL=${CEIL:-784}
for bin in $A $B $B $A; do
  tag=$(basename "$bin")
  $bin bench embed --device cuda --model $M --inputs $D/bench_inputs.json --w3-docs 8192 \
    --w3-pass-tokens 131072 --ceiling-tflops "$CEIL" >> "$OUT/ab_embed_$tag.jsonl" 2>> "$OUT/ab.err"
  $bin bench image --device cuda --model $M --image $D/image/img_a_641x479.png \
    --pass-patches 65536 >> "$OUT/ab_image_$tag.jsonl" 2>> "$OUT/ab.err"
done
python3 - "$OUT" "$(basename "$A")" "$(basename "$B")" <<'PY'
import json, statistics, sys
out, a, b = sys.argv[1:]
def rows(tag):
    r = {}
    for f in (f"{out}/ab_embed_{tag}.jsonl", f"{out}/ab_image_{tag}.jsonl"):
        for line in open(f):
            if line.startswith("{"):
                j = json.loads(line)
                r.setdefault(j["name"], []).append(j)
    return r
ra, rb = rows(a), rows(b)
print(f"{'workload':<26}{a:>22}{b:>22}{'B/A':>8}")
for name, key in [("eg2_W1_query", "median_ms"), ("eg2_W2_doc", "median_ms"), ("eg2_W3_docs256", "docs_per_s"),
                  ("eg2_image_single", "median_ms"), ("eg2_images_mixed", "images_per_s")]:
    va = [j[key] for j in ra.get(name, [])]; vb = [j[key] for j in rb.get(name, [])]
    if va and vb:
        ma, mb = statistics.mean(va), statistics.mean(vb)
        print(f"{name + ' ' + key:<26}{' / '.join(f'{v:.3f}' for v in va):>22}{' / '.join(f'{v:.3f}' for v in vb):>22}{mb / ma:>8.3f}")
PY
(cd "$OUT" && tar czf /tmp/ab.tgz . && find . -mindepth 1 -delete && mv /tmp/ab.tgz .)
