#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev/pack and .dev/tools): one call for a
# change to the VAE decoders' kernels (issue 27) — the op table while the full-size folders are
# made, `bench conv` on every kernel path, Z-Image and Qwen-Image-2.1 at 1024² against a baseline
# binary (BASE_BIN, default .dev/bin/tessera-base), then the two families' miniature and full-size
# CUDA tests, then Qwen-Image-2.1's decode profile (ATTN=1: the attention A/B of attn_ab.sh too,
# before the convolutions). Each phase leaves an archive in $OUT
# (r0.tgz … r4.tgz: the device tool returns eight files, and a call cut short keeps what it made).
# Build first: [BASELINE=path/to/old/tessera] PACK=1 TESTS="cuda_ops zimage_cuda qwen_image_cuda" \
#   tools/device/stage.sh (without a baseline, the A/B is the default route against
#   TESSERA_CONV=$B_ROUTE, default ws; PROF_CONV sets the profiles' route)
# Call it without `| tail`: the device tool keeps the last 12,000 characters itself, and a pipe
# cut by the time limit prints nothing (run g18 returned neither output nor an archive: r0.tgz,
# the op table's, now comes first).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
O=/tmp/decode_suite; mkdir -p $O
tar -C .dev -xJf .dev/pack/bin.tar.xz
. tools/device/pysite.sh
pysite || { echo "reference packages: install failed"; exit 1; }
export TESSERA_CACHE_DIR=/tmp/tessera-cache TESSERA_ROOT=$PWD
snap() { tar czf "$OUT/$1.tgz" -C $O . 2>/dev/null; }
# The folders are built on the GPU; nothing timed runs beside them.
(
  [ -f /tmp/zfull/model_index.json ] || python3 tools/device/make_zimage_full.py /tmp/zfull \
    crates/models/assets/zimage-mini > $O/make_z.log 2>&1
  echo "zfull made: $?"
  [ -f /tmp/qfull/model_index.json ] || python3 tools/device/make_qwen_image_full.py /tmp/qfull \
    crates/models/assets/qwen-image-mini > $O/make_q.log 2>&1
  echo "qfull made: $?"
) &
OUT=$O/s PARTS=ops tools/device/suite.sh
snap r0
wait
# ATTN=1: an attention change too — `bench attention` of both binaries (A B A B) and PyTorch SDPA.
if [ "${ATTN:-0}" = 1 ]; then OUT=$O/a PARTS=attn tools/device/attn_ab.sh; fi
# CONV=0 leaves out `bench conv` (a short call when the kernels' own rates are known).
if [ "${CONV:-1}" = 1 ]; then OUT=$O/c PARTS=conv tools/device/vae_ab.sh; fi
snap r1
# Against the baseline binary where one was staged, else the default route against
# TESSERA_CONV=$B_ROUTE (default ws) in this binary.
if [ -z "${BASE_BIN:-}" ] && [ -f .dev/bin/tessera-base ]; then BASE_BIN=.dev/bin/tessera-base; fi
OUT=$O/v BASE_BIN=${BASE_BIN:-} B_ROUTE=${B_ROUTE:-ws} PARTS=zimage,qwen QSTEPS=${QSTEPS:-40} tools/device/vae_ab.sh
snap r2
# SUITE_PARTS=mini: the miniatures alone (a short call; the full-size parity runs take ~2 minutes).
OUT=$O/p PARTS=${SUITE_PARTS:-mini,zfull,qfull} DEADLINE=${DEADLINE:-200} tools/device/suite.sh
snap r3
OUT=$O/q PARTS=qprof,prof PROF_CONV=${PROF_CONV:-} tools/device/vae_ab.sh
snap r4
