#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev): `tessera serve` generating images with
# a full-size random-weight Z-Image-Turbo beside a full-size random-weight EmbeddingGemma 2, both on
# one GPU, driven by `tessera bench serve-images`:
#   - images/s (and request latency) at 512² and 1024² for 1 and 8 concurrent clients, with requests
#     batched through the DiT and one at a time (`--no-image-batching`);
#   - the p50/p95 latency of an embedding request idle and while 4 clients generate without pause,
#     with the embedding model's CUDA stream at the highest priority (the server's default beside an
#     image model) and, in the `nopriority` part, without (`--no-stream-priority`).
# Builds nothing: stage first (TESTS=" " tools/device/stage.sh — no test executables are needed —
# puts .dev/bin/tessera, the wheels that make_zimage_full.py and
# make_eg2_full.py need).
#   PARTS=make,batched,single,nopriority (default all; about 7 minutes on an H200. The models stay in
#   /tmp/zfull and /tmp/eg2 while the machine is warm, so the parts may be split over calls:
#   PARTS=make,batched, then PARTS=single,nopriority)
#   SIZES=512x512,1024x1024 CLIENTS=1,8 STEPS=8 REQUESTS=24 EMBED_REQUESTS=200 GEN_CLIENTS=4
#   PHASE_SECS=60 DEVICE=cuda PRECISION=bf16 TESSERA_BIN=.dev/bin/tessera
# TINY=1 checks the script's logic on a CPU with the bundled miniatures (no Python models, no GPU):
#   TINY=1 TESSERA_BIN=target/release/tessera OUT=/tmp/images-serve tools/device/images_serve.sh
# Writes the bench JSON lines and stderr, the server logs, summary.txt and summary.json under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-make,batched,single,nopriority}
B=${TESSERA_BIN:-.dev/bin/tessera}
if [ -n "${TINY:-}" ]; then
  SIZES=${SIZES:-64x64,128x128} CLIENTS=${CLIENTS:-1,8} STEPS=${STEPS:-2} REQUESTS=${REQUESTS:-16}
  EMBED_REQUESTS=${EMBED_REQUESTS:-40} GEN_CLIENTS=${GEN_CLIENTS:-2} PHASE_SECS=${PHASE_SECS:-60}
  DEVICE=${DEVICE:-cpu} PRECISION=${PRECISION:-f32}
  Z=bundled:zimage M=bundled:egemma2
  PARTS=${PARTS//make/}
else
  SIZES=${SIZES:-512x512,1024x1024} CLIENTS=${CLIENTS:-1,8} STEPS=${STEPS:-8} REQUESTS=${REQUESTS:-24}
  EMBED_REQUESTS=${EMBED_REQUESTS:-200} GEN_CLIENTS=${GEN_CLIENTS:-4} PHASE_SECS=${PHASE_SECS:-60}
  DEVICE=${DEVICE:-cuda} PRECISION=${PRECISION:-bf16}
  Z=/tmp/zfull M=/tmp/eg2
  export TESSERA_CACHE_DIR=/tmp/tessera-cache
fi
[ -x "$B" ] || { echo "no tessera binary at $B: stage it first (TESTS=\" \" tools/device/stage.sh)"; exit 1; }
status=0

if [[ $PARTS == *make* ]]; then
  if [ -f .dev/pack/site.tar.xz ] || ls .dev/whl/*.whl >/dev/null 2>&1; then
    . tools/device/pysite.sh
    pysite || { echo "reference packages: install failed"; exit 1; }
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  if [ ! -f $Z/model_index.json ]; then
    echo "== making the full-size Z-Image-Turbo folder (random weights)"
    python3 tools/device/make_zimage_full.py $Z crates/models/assets/zimage-mini > "$OUT/make_zimage.log" 2>&1 \
      || { tail -20 "$OUT/make_zimage.log"; exit 1; }
    tail -1 "$OUT/make_zimage.log"
  fi
  if [ ! -f $M/config.json ]; then
    echo "== making the full-size EmbeddingGemma 2 folder (random weights)"
    python3 tools/device/make_eg2_full.py $M /tmp/eg2data --no-audio > "$OUT/make_eg2.log" 2>&1 \
      || { tail -20 "$OUT/make_eg2.log"; exit 1; }
    tail -1 "$OUT/make_eg2.log"
  fi
fi

# One run of the load test: batched (the default), single (one request at a time) or nopriority
# (batched, every stream at one priority; only the first size at one client, for the embedding
# phases).
bench() {
  local mode=$1 extra=() sizes=$SIZES clients=$CLIENTS requests=$REQUESTS
  [ "$mode" = single ] && extra=(--server-args "--no-image-batching")
  if [ "$mode" = nopriority ]; then
    extra=(--server-args "--no-stream-priority") sizes=${SIZES%%,*} clients=1 requests=4
  fi
  echo "== tessera bench serve-images: $mode ($sizes, $STEPS steps, clients $clients; embeddings beside)"
  "$B" bench serve-images --image-model "$Z" --embed-model "$M" --device "$DEVICE" --precision "$PRECISION" \
    --sizes "$sizes" --clients "$clients" --steps "$STEPS" --requests "$requests" \
    --embed-requests "$EMBED_REQUESTS" --gen-clients "$GEN_CLIENTS" --phase-secs "$PHASE_SECS" \
    --max-queue 64 --server-log "$OUT/server_$mode.log" "${extra[@]}" --check \
    > "$OUT/bench_$mode.jsonl" 2> "$OUT/bench_$mode.err"
  local r=$?
  grep -v '^{' "$OUT/bench_$mode.err" | tail -12
  return $r
}
for mode in batched single nopriority; do
  if [[ $PARTS == *$mode* ]]; then
    bench $mode; r=$?; status=$((status|r))
  fi
done

# The table and the JSON summary from whatever runs are there.
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {}
for mode in ("batched", "single", "nopriority"):
    f = out / f"bench_{mode}.jsonl"
    if f.exists():
        lines = [json.loads(l) for l in f.read_text().splitlines() if l.strip().startswith("{")]
        runs[mode] = {l["phase"]: l for l in lines}
def num(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)
rows, summary = [], {"generation": [], "embedding": {}}
phases = sorted({p for m in ("batched", "single") for p in runs.get(m, {}) if p.startswith("gen_") and p != "gen_beside_embed"},
                key=lambda p: (int(p.split("_")[1].split("x")[0]), int(p.split("_c")[1])))
lines = ["| size | clients | batched images/s | one-at-a-time images/s | batched / one | p50 / p95 latency batched (s) | p50 / p95 one-at-a-time (s) |",
         "|---|---|---|---|---|---|---|"]
for p in phases:
    b, s = runs.get("batched", {}).get(p, {}), runs.get("single", {}).get(p, {})
    bi, si = b.get("images_per_s"), s.get("images_per_s")
    ratio = bi / si if bi and si else None
    size, clients = p.split("_")[1], int(p.split("_c")[1])
    lat = lambda r: f"{num(r.get('p50_ms') and r['p50_ms'] / 1e3)} / {num(r.get('p95_ms') and r['p95_ms'] / 1e3)}"
    lines.append(f"| {size} | {clients} | {num(bi)} | {num(si)} | {num(ratio, '{:.2f}×')} | {lat(b)} | {lat(s)} |")
    summary["generation"].append({"size": size, "clients": clients, "batched_images_per_s": bi,
        "single_images_per_s": si, "batched_over_single": ratio,
        "batched_p50_ms": b.get("p50_ms"), "batched_p95_ms": b.get("p95_ms"),
        "single_p50_ms": s.get("p50_ms"), "single_p95_ms": s.get("p95_ms")})
lines += ["", "| embedding request (one short text) | p50 ms | p95 ms | p99 ms | requests |", "|---|---|---|---|---|"]
for mode, r in runs.items():
    for p, what in (("embed_idle", "idle"), ("embed_during", "while {} clients generate at {}")):
        e = r.get(p)
        if not e:
            continue
        what = what.format(e.get("gen_clients"), e.get("size"))
        lines.append(f"| {what} ({mode}) | {num(e.get('p50_ms'))} | {num(e.get('p95_ms'))} | {num(e.get('p99_ms'))} | {e.get('ok')} |")
        summary["embedding"][f"{p}_{mode}"] = {k: e.get(k) for k in ("p50_ms", "p95_ms", "p99_ms", "ok", "gen_clients", "size")}
    g = r.get("gen_beside_embed")
    if g:
        summary["generation_beside_embeddings_" + mode] = {k: g.get(k) for k in ("size", "images_per_s", "p50_ms", "p95_ms", "ok")}
bad = {m: {p: l["unexpected"] for p, l in r.items() if l.get("unexpected")} for m, r in runs.items()}
summary["unexpected_answers"] = {m: v for m, v in bad.items() if v}
text = "\n".join(lines)
(out / "summary.txt").write_text(text + "\n")
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(text)
if summary["unexpected_answers"]:
    print("unexpected answers:", summary["unexpected_answers"])
EOF
exit $status
