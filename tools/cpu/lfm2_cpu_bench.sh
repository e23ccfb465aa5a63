#!/usr/bin/env bash
# Issue 28's and 31's CPU table: LFM2-VL's language model decoding and prefilling on this machine,
# Tessera and llama.cpp alternating in one run, one precision or format at a time, each figure with
# the 1-minute load average when it started. Nothing else should run meanwhile.
#
#   tools/cpu/lfm2_cpu_bench.sh MODEL_DIR LLAMA_WORK OUT_DIR
#
# MODEL_DIR: a full-size LFM2-VL folder (tools/device/make_lfm2vl_full.py). LLAMA_WORK: the work
# folder of ../shared/tools/llamacpp_anchor.sh (llama.cpp built there, the language model as
# lm-<type>.gguf: f32, bf16, q8_0, q4_0, q4_k_m). Environment: BIN (default target/release/tessera),
# THREADS (default 2), ROUNDS (default 2), MODES (default "f32 bf16 q8_0 q4_0 q4_k").
#
# Tessera's rows: `bench chat --prefill 512 --batch 1 --new-tokens 64` (decode after a 16-token
# prompt, median of 3); the quantized ones quantize the safetensors folder at load (`--quantize`,
# llama.cpp's rounding) and run int8 activations (`--precision int8`). llama.cpp's: `llama-bench
# -p 512 -n 64 -r 3` on the converted file. q4_k pairs Tessera's all-Q4_K matrices with llama.cpp's
# Q4_K_M file (Q4_K with some Q6_K), the mix people download.
set -euo pipefail
M=$1 L=$2 OUT=$3
BIN=${BIN:-target/release/tessera} THREADS=${THREADS:-2} ROUNDS=${ROUNDS:-2}
MODES=${MODES:-"f32 bf16 q8_0 q4_0 q4_k"}
mkdir -p "$OUT"
load1() { cut -d' ' -f1 /proc/loadavg; }
# tag ENGINE MODE ROUND: each JSON line of stdin with the engine, mode, round and the load now.
tag() {
  python3 -c 'import json,sys; [print(json.dumps({**json.loads(l), "engine": sys.argv[1], "mode": sys.argv[2], "round": int(sys.argv[3]), "load1": float(sys.argv[4])})) for l in sys.stdin if l.strip()]' \
    "$1" "$2" "$3" "$(load1)"
}
for r in $(seq "$ROUNDS"); do
  for m in $MODES; do
    case $m in
      f32) args=(--precision f32) gguf=f32 ;;
      bf16) args=(--precision bf16) gguf=bf16 ;;
      q4_k) args=(--quantize q4_k --precision int8) gguf=q4_k_m ;;
      *) args=(--quantize "$m" --precision int8) gguf=$m ;;
    esac
    echo "== round $r: $m"
    "$BIN" --threads "$THREADS" bench chat --model "$M" --device cpu "${args[@]}" --images 256x256 \
      --prefill 512 --batch 1 --new-tokens 64 --prompt-tokens 16 --iters 3 \
      | grep -E '"what":"(prefill|decode|load)"' \
      | tag tessera "$m" "$r" | tee -a "$OUT/tessera.jsonl"
    "$L/llama/build/bin/llama-bench" -m "$L/lm-$gguf.gguf" -t "$THREADS" -p 512 -n 64 -r 3 -o jsonl 2>/dev/null \
      | tag llama.cpp "$m" "$r" | tee -a "$OUT/llama.jsonl"
  done
done
# One line per figure: tokens/s of decode and of the 512-token prefill.
python3 - "$OUT" <<'PY'
import json, sys, collections
out = sys.argv[1]
rows = collections.defaultdict(list)
for line in open(f"{out}/tessera.jsonl"):
    r = json.loads(line)
    if r["what"] in ("prefill", "decode"):
        rows[(r["mode"], "tessera", r["what"])].append(r["tokens_per_s"])
for line in open(f"{out}/llama.jsonl"):
    r = json.loads(line)
    what = "prefill" if r.get("n_prompt", 0) > 0 else "decode"
    rows[(r["mode"], "llama.cpp", what)].append(r["avg_ts"])
print(f"{'mode':<6} {'what':<8} {'tessera tok/s':<22} {'llama.cpp tok/s':<22}")
for mode in dict.fromkeys(k[0] for k in rows):
    for what in ("decode", "prefill"):
        t = ", ".join(f"{v:.1f}" for v in rows[(mode, "tessera", what)])
        l = ", ".join(f"{v:.1f}" for v in rows[(mode, "llama.cpp", what)])
        print(f"{mode:<6} {what:<8} {t:<22} {l:<22}")
PY
