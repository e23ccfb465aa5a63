#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev/pack): issue 29's editing table in one
# call, Tessera and diffusers 0.42.1 on the same card —
#   1. a full-size random-weight Qwen-Image-2.1 with the published 27-block vision tower in
#      /tmp/qedit (make_qwen_image_full.py --vision-depth 27), unless it is there;
#   2. a 1024² RGBA condition PNG (a gradient with a transparent corner);
#   3. `tessera bench generate --image` (bf16, 1024², STEPS steps, ITERS timed runs after one
#      warm-up): prompt → PNG end to end and by stage (plan, VAE encode, vision tower, text encoder
#      and prefill per prompt branch, each step, decode, PNG);
#   4. `tessera bench generate` without the image (the text-to-image step the cached edit step is
#      held to), same settings, one timed run;
#   5. tools/device/qwen_image_edit_ref.py: diffusers' VAE encode alone, then the same edit with its
#      prefix cache (use_kv_cache=True, the default) and without (every step recomputes the prefix);
# then a short table. Logs go into $OUT/edit_logs.tgz; the table into $OUT/edit_table.txt.
#   DEADLINE: seconds after which no part starts and running ones are cut (default 520; the
#     whole call stays under 540 s on an H200)
#   GUIDANCE: true CFG scale for both (default 1: none, the model's default and the table's
#     setting); above 1 both run true CFG with NEG as the negative prompt (default " ")
#   STEPS (40), ITERS (3), REF_ITERS (2), PARTS=make,tessera,t2i,ref (default all), QEDIT (the
#     folder, default /tmp/qedit)
# Build first (any TESTS; only .dev/bin/tessera runs here):
#   PACK=1 TESTS=qwen_image_cuda tools/device/stage.sh   and carry .dev/pack
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE=${DEADLINE:-520}
GUIDANCE=${GUIDANCE:-1} NEG=${NEG:- } STEPS=${STEPS:-40} ITERS=${ITERS:-3} REF_ITERS=${REF_ITERS:-2}
PARTS=${PARTS:-make,tessera,t2i,ref}
export TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_ROOT=$PWD
t0=$SECONDS
L=/tmp/qedit_logs; rm -rf "$L"; mkdir -p "$L"
if [ -f .dev/pack/bin.tar.xz ] && [ ! -x .dev/bin/tessera ]; then tar -C .dev -xJf .dev/pack/bin.tar.xz; fi
. tools/device/pysite.sh
pysite || { echo "reference packages: install failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$L/gpu.txt"
B=.dev/bin/tessera Q=${QEDIT:-/tmp/qedit} COND=/tmp/qedit_cond_1024.png
status=0

# left: seconds before the deadline; time_left NAME: whether a part may start (30 s at least).
left() { echo $((DEADLINE - (SECONDS - t0))); }
time_left() { [ "$(left)" -gt 30 ] || { echo "-- deadline: $1 skipped"; return 1; }; }
# run LOG CMD...: CMD into $L/LOG, cut at the deadline; its status folds into the script's.
run() {
  local log=$1; shift
  local s=$SECONDS
  timeout "$(left)" "$@" > "$L/$log" 2>&1; local r=$?
  status=$((status | r))
  printf -- '-- %-28s rc=%-3s %4ss\n' "$log" "$r" "$((SECONDS - s))"
  [ $r -eq 0 ] || grep -E "rror|panicked|FAILED|Traceback" "$L/$log" | head -5
  return $r
}
CFG=(); REF_CFG=()
if awk "BEGIN{exit !($GUIDANCE > 1)}"; then
  CFG=(--guidance "$GUIDANCE" --negative-prompt "$NEG")
  REF_CFG=(--guidance "$GUIDANCE" --negative-prompt "$NEG")
fi

if [[ $PARTS == *make* ]] && [ ! -f $Q/model_index.json ] && time_left make; then
  echo "== full-size folder with the 27-block vision tower"
  run make_qedit.log python3 tools/device/make_qwen_image_full.py $Q crates/models/assets/qwen-image-mini \
    --vision-depth 27 || tail -5 "$L/make_qedit.log"
  tail -1 "$L/make_qedit.log"
fi
python3 - "$COND" <<'PY' || { echo "could not write the condition image"; status=1; }
import sys
import numpy as np
from PIL import Image
h = w = 1024
y, x = np.mgrid[0:h, 0:w]
px = np.stack([x * 255 // (w - 1), y * 255 // (h - 1), (x + y) * 255 // (w + h - 2),
               np.where((x < w // 4) & (y < h // 4), 0, 255)], -1).astype(np.uint8)
Image.fromarray(px, "RGBA").save(sys.argv[1])
PY

GEN=(bench generate --model $Q --device cuda --precision bf16 --steps "$STEPS" "${CFG[@]}")
if [[ $PARTS == *tessera* ]] && time_left tessera; then
  echo "== tessera: edit 1024² with one 1024² condition image, $STEPS steps, bf16, guidance $GUIDANCE"
  run tessera_edit.log $B "${GEN[@]}" --image $COND --iters "$ITERS"
  grep -vE "^\{" "$L/tessera_edit.log" | tail -2
fi
if [[ $PARTS == *t2i* ]] && time_left t2i; then
  echo "== tessera: text to image 1024², same settings (the step the cached edit step is held to)"
  run tessera_t2i.log $B "${GEN[@]}" --size 1024x1024 --iters 1
  grep -vE "^\{" "$L/tessera_t2i.log" | tail -2
fi
if [[ $PARTS == *ref* ]] && time_left ref; then
  echo "== diffusers 0.42.1: VAE encode, the edit with its prefix cache and without"
  # The reference skips its no-cache run when it would start too late for the table.
  run ref_edit.log python3 tools/device/qwen_image_edit_ref.py --model $Q --image $COND --steps "$STEPS" \
    --iters "$REF_ITERS" "${REF_CFG[@]}" --budget $(( $(left) - 60 ))
  grep -E "^RESULT" "$L/ref_edit.log" | cut -c1-260
fi

python3 - "$L" "$GUIDANCE" <<'PY' | tee "$OUT/edit_table.txt"
import json, os, sys
d, g = sys.argv[1], sys.argv[2]


def tessera(name):
    try:
        lines = [l for l in open(os.path.join(d, name)) if l.startswith("{")]
        return json.loads(lines[-1]) if lines else {}
    except OSError:
        return {}


ref = {}
try:
    for l in open(os.path.join(d, "ref_edit.log")):
        if l.startswith("RESULT "):
            r = json.loads(l[7:])
            ref[r["name"]] = r
except OSError:
    pass
e, t = tessera("tessera_edit.log"), tessera("tessera_t2i.log")
st = e.get("stages", {})
c = next((v for k, v in ref.items() if k.startswith("edit_e2e_") and k.endswith("_cache")), {})
n = next((v for k, v in ref.items() if k.startswith("edit_e2e_") and k.endswith("_nocache")), {})
vae = next((v for k, v in ref.items() if k.startswith("edit_vae_encode_")), {})
pre = ref.get("edit_prefix", {})
br = max(e.get("branches") or 1, 1)


def f(v, unit="ms", scale=1.0):
    return "—" if v is None else f"{v * scale:.1f} {unit}" if unit == "ms" else f"{v * scale:.2f} {unit}"


def ratio(a, b):
    return "—" if a is None or b is None or not b else f"{a / b:.2f}×"


e2e = e.get("e2e_ms")
rows = [
    ("edit end to end, prompt → PNG", f(e2e, "s", 1e-3), f(c.get("e2e_s"), "s"), f(n.get("e2e_s"), "s"),
     f"≤ 4.3 s; vs diffusers: {ratio(c.get('e2e_s'), e2e and e2e / 1e3)} (cache), {ratio(n.get('e2e_s'), e2e and e2e / 1e3)} (no cache); ≥ 1.5×"),
    (f"prefill of {pre.get('prefix_rows', '~4,200')} prefix rows, per branch", f(st.get("prefill_ms") and st["prefill_ms"] / br),
     "— (in step 0)", "—", "≤ 30 ms"),
    ("step (cached prefix)", f(e.get("step_ms")), f(c.get("later_step_ms")), f(n.get("later_step_ms")),
     f"≤ 1.15× t2i step {f(t.get('step_ms'))}: {ratio(e.get('step_ms'), t.get('step_ms'))}"),
    ("step 0 (diffusers: prefill + step)", "—", f(c.get("step0_ms")), f(n.get("step0_ms")), ""),
    ("VAE encode 1024²", f(st.get("vae_encode_ms")), f(vae.get("median_ms")) + " (alone)", f(c.get("vae_encode_ms")) + " (in call)",
     "≤ 40 ms"),
    ("vision tower", f(st.get("vision_ms")), f(c.get("vision_ms")), f(n.get("vision_ms")), "diffusers: once per branch"),
    ("text encoder (all branches)", f(st.get("text_encoder_ms")), f(c.get("encode_prompt_ms")) + " (+vision)",
     f(n.get("encode_prompt_ms")) + " (+vision)", ""),
    ("plan (host: tokenise, resize)", f(st.get("plan_ms")), f(c.get("preprocess_ms")), f(n.get("preprocess_ms")), ""),
    ("decode (+ PNG / PIL)", f(e.get("decode_ms")) + f" + {f(e.get('png_ms'))}", f(c.get("decode_ms")), f(n.get("decode_ms")), ""),
]
print(f"== issue 29 edit table (guidance {g}; Tessera median of {e.get('iters', '?')} runs, diffusers of "
      f"{c.get('iters', '?')}; device {e.get('device', '?')})")
print(f"{'':44} {'tessera':>16} {'diffusers cache':>22} {'diffusers no cache':>22}  target")
for name, a, b, cc, tgt in rows:
    print(f"{name:44} {a:>16} {b:>22} {cc:>22}  {tgt}")
if "edit_peak_mem" in ref:
    print(f"diffusers peak memory {ref['edit_peak_mem']['gb']} GB")
PY
(cd "$L" && tar czf "$OUT/edit_logs.tgz" ./*)
echo "-- total $((SECONDS - t0)) s, status $status"
exit $status
