#!/usr/bin/env bash
# Run cpu-lfm2c: issue 31's CPU table (tools/cpu/lfm2_cpu_bench.sh, one round each) with the
# weight prefetch off (A: TESSERA_PREFETCH=0, the kernels as before 5b22047) and on (B: the
# default), alternating A B A B; llama.cpp runs beside Tessera in every round.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=benchmarks/2026-12-07/cpu-lfm2c
for r in 1 2; do
  TESSERA_PREFETCH=0 ROUNDS=1 tools/cpu/lfm2_cpu_bench.sh /tmp/lfm2full /tmp/llama $D/a$r > $D/a$r.txt 2>&1
  ROUNDS=1 tools/cpu/lfm2_cpu_bench.sh /tmp/lfm2full /tmp/llama $D/b$r > $D/b$r.txt 2>&1
done
