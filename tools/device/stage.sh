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
for spec in "tessera-backend --test cuda_ops" "tessera-runtime --test egemma2_cuda" "tessera-runtime --test zimage_cuda"; do
  # shellcheck disable=SC2086
  exe=$(cargo test --release --locked -p $spec --no-run --message-format=json \
        | python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact" and m.get("executable")][-1])')
  name=${spec##* }
  cp "$exe" ".dev/bin/$name"
done
# The binary of a baseline commit, for before/after measurements (BASELINE=path/to/tessera).
if [ -n "${BASELINE:-}" ]; then cp "$BASELINE" .dev/bin/tessera-base; fi
strip .dev/bin/*  # the device tool carries at most 64 MiB
cp ../shared/tools/make_eg2_full.py ../shared/tools/refbench.py ../shared/tools/zimage_compile.py .dev/tools/
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
# The whole transformers wheel (13.8 MB) leaves no room for the binaries under the device tool's
# 64 MiB: keep only the model folders EmbeddingGemma 2's reference imports (and their kin).
w=.dev/whl/transformers-5.25.0-py3-none-any.whl
if [ "$(stat -c %s "$w")" -gt 5000000 ]; then
  python3 ../shared/tools/trim_wheel.py "$w" "$w.trimmed" transformers/models/ \
    auto,embedding_gemma2,gemma4,gemma3,gemma3n,gemma,gemma2,siglip,siglip2,qwen3,qwen2 && mv "$w.trimmed" "$w"
fi
du -sh .dev
