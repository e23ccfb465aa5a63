"""One line per row of a `tessera bench attention` or `tools/device/sdpa_ref.py` JSON-lines file,
for the device scripts' tables (suite.sh, quick_attn.sh, attn_ab.sh):

    python3 attn_table.py FILE [LABEL] [--chosen] [--shapes SUBSTR,...]

LABEL prefixes each line (default: the file's kind, `tessera` or `sdpa`); --chosen keeps only the
unsplit launch and the op's own choice of each shape; --shapes keeps shapes containing one of the
substrings. Lines that are not JSON (a tool's error output) are printed as they are."""
import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("label", nargs="?")
    ap.add_argument("--chosen", action="store_true")
    ap.add_argument("--shapes", default="")
    a = ap.parse_args()
    shapes = [s for s in a.shapes.split(",") if s]
    for line in open(a.file):
        try:
            r = json.loads(line)
        except ValueError:
            print(line.rstrip())
            continue
        if shapes and not any(s in r.get("shape", "") for s in shapes):
            continue
        if "backend" in r:  # PyTorch SDPA
            label = a.label or "sdpa"
            if "error" in r:
                print(f"{label:<8} {r['shape']:<20} {r['backend']:<20} {r['error'][:80]}")
            else:
                print(f"{label:<8} {r['shape']:<20} {r['backend']:<20} {r['median_ms'] * 1e3:8.1f} us "
                      f"{r['tflops']:6.1f} TFLOP/s")
            continue
        if a.chosen and not (r.get("kv_splits") == 1 or r.get("chosen")):
            continue
        label = a.label or "tessera"
        print(f"{label:<8} {r['shape']:<20} {str(r.get('kernel')):<6} chunks={r['kv_splits']} "
              f"chosen={r['chosen']!s:<5} {r['median_ms'] * 1e3:8.1f} us {r['tflops']:6.1f} TFLOP/s")


if __name__ == "__main__":
    main()
