#!/usr/bin/env bash
# Build here what the GPU machine runs, into the git-ignored .dev/ (carried with the `device` tool):
# the release `tessera` binary, the GPU test executables, the reference helper scripts and the
# Python wheels the reference needs there (transformers 5.25 and friends; see DESIGN.md).
# Nothing is built on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .dev/bin .dev/tools .dev/whl
cargo build --release --locked -p tessera-cli
cp target/release/tessera .dev/bin/
# Test executables (release, so parity runs at speed); cargo prints their paths as JSON.
# TESTS picks the GPU test executables (default all); the carried tree must stay under 64 MiB, so
# a run of one family stages only its own: TESTS="cuda_ops zimage_cuda" tools/device/stage.sh
# TESTS="" stages the `tessera` binary alone (a run that needs no test executable, e.g. a serving
# benchmark beside the reference: lfm2vl_serving.sh REF=1).
TESTS=${TESTS-cuda_ops egemma2_cuda zimage_cuda}
rm -f .dev/bin/cuda_ops .dev/bin/egemma2_cuda .dev/bin/zimage_cuda .dev/bin/lfm2vl_cuda .dev/bin/qwen_image_cuda
for t in $TESTS; do
  case $t in
    cuda_ops) spec="tessera-backend --test cuda_ops" ;;
    *) spec="tessera-runtime --test $t" ;;
  esac
  # shellcheck disable=SC2086
  exe=$(cargo test --release --locked -p $spec --no-run --message-format=json \
        | python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact" and m.get("executable")][-1])')
  name=${spec##* }
  cp "$exe" ".dev/bin/$name"
done
# The binary of a baseline commit, for before/after measurements (BASELINE=path/to/tessera).
if [ -n "${BASELINE:-}" ]; then cp "$BASELINE" .dev/bin/tessera-base; fi
strip .dev/bin/*  # the device tool carries at most 64 MiB
cp ../shared/tools/refbench.py ../shared/tools/zimage_compile.py \
  ../shared/tools/refbench_qi21_lfm2vl.py ../shared/tools/refbench_qi21_lfm2vl.sh .dev/tools/
if [ ! -f .dev/whl/transformers-5.25.0-py3-none-any.whl ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    transformers==5.25.0 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
    click==8.5.1 idna==3.20 importlib_metadata -d .dev/whl
fi
# Z-Image's reference (tools/device/zimage_cuda.sh, make_zimage_full.py).
if ! ls .dev/whl/diffusers-0.42.1-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 diffusers==0.42.1 -d .dev/whl
fi
# The transformers wheel stays whole (13.8 MB): diffusers imports every autoencoder and, where peft
# is installed (the GPU machine has it), peft imports models of its own, so a wheel trimmed to the
# models Tessera compares against breaks `import diffusers`. Everything still fits the device
# tool's 64 MiB with the repository when one family's test executables are staged (TESTS).
# PACK=1: the binaries as one xz archive (.dev/pack/bin.tar.xz, about 20% of their size), for
# runs that also carry the reference's packages; the run scripts unpack both.
if [ "${PACK:-0}" = 1 ]; then
  # One solid stream with xz -9's 64 MiB dictionary: the executables share most of their code,
  # so this packs all six into 14 MB where -6 -T0 (independent blocks) took 24.5 MB.
  mkdir -p .dev/pack && tar -C .dev -cf - bin | xz -9 -T1 > .dev/pack/bin.tar.xz
  # The wheels unpacked, as one archive (tools/device/pysite.sh installs it): zip compresses each
  # file alone, xz the whole tree, 6 MB where the wheels take 21 MB. Carry .dev/pack alone then.
  rm -rf .dev/site && mkdir -p .dev/site
  # SITE=transformers leaves diffusers out (1.8 MB less packed): what LFM2-VL's and
  # EmbeddingGemma 2's references need, when the carried tree is near its 64 MiB.
  for w in .dev/whl/*.whl; do
    case "${SITE:-all}:$w" in transformers:*diffusers-*) continue ;; esac
    python3 -m zipfile -e "$w" .dev/site
  done
  tar -C .dev/site -cf - . | xz -9 -T0 > .dev/pack/site.tar.xz && rm -rf .dev/site
fi
du -sh .dev
