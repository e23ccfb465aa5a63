export TESSERA_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout 300 .dev/bin/cuda_ops --ignored --test-threads=1 --nocapture attention > $OUT/cuda_ops_attn.log 2>&1; echo "rc=$?"
grep -E "test result|panicked|wgmma|Wgmma" $OUT/cuda_ops_attn.log | head -30
timeout 200 .dev/bin/tessera bench attention --device cuda > $OUT/bench_attention.jsonl 2>&1; echo "rc=$?"
python3 - <<'P'
import json,os
for l in open(os.environ['OUT']+'/bench_attention.jsonl'):
    try: r=json.loads(l)
    except: print(l.strip()); continue
    print(f"{r['shape']:<20} {str(r.get('kernel')):<6} splits={r['kv_splits']} chosen={r['chosen']!s:<5} {r['median_ms']*1e3:8.1f} us {r['tflops']:6.1f} TF")
P
