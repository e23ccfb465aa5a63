#!/usr/bin/env bash
# On the GPU machine (via the `device` tool, carrying .dev/pack): an attention kernel change against
# a baseline binary (issue 27), in one call —
#   ops:  the op table's attention cases (cuda_ops, every flash kernel forced, against the CPU;
#         OPS_CASE picks other cases, empty for the whole table);
#   attn: `tessera bench attention` of this binary (B) and of BASE_BIN (A), alternating A B A B,
#         then PyTorch SDPA on the same shapes (tools/device/sdpa_ref.py);
#   ncu:  Nsight Compute on one launch of each of NCU_KERNELS in both binaries (speed of light,
#         pipe use, warp stalls), plus the source view of B's first kernel as CSV (ncu_src.csv).
#   PARTS=ops,attn,ncu (default all), BASE_BIN (default .dev/bin/tessera-base),
#   NCU_KERNELS (default "flash_ws_d128 flash_ws_d64"). Build first, with the baseline:
#   BASELINE=path/to/old/tessera PACK=1 TESTS=cuda_ops tools/device/stage.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-ops,attn,ncu}
BASE_BIN=${BASE_BIN:-.dev/bin/tessera-base}
NCU_KERNELS=${NCU_KERNELS:-flash_ws_d128 flash_ws_d64}
export TESSERA_CACHE_DIR=${TESSERA_CACHE_DIR:-/tmp/tessera-cache} TESSERA_ROOT=$PWD
if [ -f .dev/pack/bin.tar.xz ] && [ ! -x .dev/bin/tessera ]; then tar -C .dev -xJf .dev/pack/bin.tar.xz; fi
B=.dev/bin/tessera
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"


if [[ $PARTS == *ops* ]]; then
  echo "== op table (cuda vs cpu, every kernel forced), cases: ${OPS_CASE-attention}"
  TESSERA_OP_CASE=${OPS_CASE-attention} timeout 300 .dev/bin/cuda_ops --ignored --test-threads=1 --nocapture ops_match_cpu \
    > "$OUT/cuda_ops_attn.log" 2>&1; r=$?; status=$((status | r))
  echo "cuda_ops: rc=$r"
  grep -E "^total|declined|test result|panicked|FAIL" "$OUT/cuda_ops_attn.log" | head -12
fi
if [[ $PARTS == *attn* ]]; then
  echo "== bench attention (median of 20 launches), A = $BASE_BIN, B = this binary, A B A B"
  for round in 1 2; do
    for side in A B; do
      bin=$B; [ $side = A ] && bin=$BASE_BIN
      timeout 150 $bin bench attention --device cuda > "$OUT/attn_${side}${round}.jsonl" 2>&1 || status=1
      python3 tools/device/attn_table.py "$OUT/attn_${side}${round}.jsonl" "$side$round" --chosen \
        --shapes dit,4096x16x64,image | grep -E "ws|chosen=True"
    done
  done
  echo "== PyTorch SDPA, same shapes, same call"
  timeout 150 python3 tools/device/sdpa_ref.py > "$OUT/sdpa_ref.jsonl" 2>&1 || status=1
  python3 tools/device/attn_table.py "$OUT/sdpa_ref.jsonl"
fi
if [[ $PARTS == *ncu* ]]; then
  first=1
  for k in $NCU_KERNELS; do
    for side in B A; do
      bin=$B; [ $side = A ] && bin=$BASE_BIN
      echo "== ncu $k ($side)"
      timeout 150 ncu --clock-control none --kernel-name "$k" --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section InstructionStats --section LaunchStats --section Occupancy --section SourceCounters \
        --import-source no -o "$OUT/ncu_${k}_$side" -f $bin bench attention --device cuda > "$OUT/ncu_${k}_$side.log" 2>&1
      ncu --import "$OUT/ncu_${k}_$side.ncu-rep" --page details > "$OUT/ncu_${k}_$side.txt" 2>&1
      grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc Active|Warp Cycles Per Issued|No Eligible|Registers Per|Stall" \
        "$OUT/ncu_${k}_$side.txt" | head -16
      if [ $first = 1 ] && [ $side = B ]; then
        ncu --import "$OUT/ncu_${k}_$side.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_src.csv" 2>&1
        first=0
      fi
      ncu --import "$OUT/ncu_${k}_$side.ncu-rep" --page raw --csv > "$OUT/ncu_${k}_${side}_raw.csv" 2>&1
    done
  done
  python3 - "$OUT" $NCU_KERNELS <<'PY'
import csv, sys, os
out = sys.argv[1]
for k in sys.argv[2:]:
    for side in "BA":
        p = f"{out}/ncu_{k}_{side}_raw.csv"
        if not os.path.exists(p):
            continue
        rows = list(csv.reader(open(p)))
        hdr = next((r for r in rows if "Kernel Name" in r), None)
        if not hdr:
            print(k, side, "no raw metrics:", " ".join(" ".join(r) for r in rows[:3])[:200]); continue
        vals = rows[rows.index(hdr) + 2] if len(rows) > rows.index(hdr) + 2 else []
        d = dict(zip(hdr, vals))
        def first(prefix):
            return next((f"{h.split('.')[0].replace('sm__', '')}={v}" for h, v in d.items() if h.startswith(prefix)), "?")
        tc = first("sm__pipe_tensor_op_hmma_cycles_active")
        xu = first("sm__inst_executed_pipe_xu")
        st = {h.replace("smsp__pcsamp_warps_issue_stalled_", ""): v for h, v in d.items() if h.startswith("smsp__pcsamp_warps_issue_stalled_") and not h.endswith("not_issued")}
        def num(v):
            try: return float(v.replace(",", ""))
            except ValueError: return 0.0
        top = sorted(st.items(), key=lambda kv: -num(kv[1]))[:8]
        print(f"{k} {side}: {tc}, {xu}; stall samples: " + ", ".join(f"{n} {v}" for n, v in top))
PY
fi
(cd "$OUT" && tar czf logs.tgz ./*.log ./*.jsonl ./*.txt ./*.csv 2>/dev/null && rm -f ./*.log ./*.txt ./*_raw.csv)
exit $status
