"""The no-training baselines of dense seed 44 beside Fibonacci seed 44 (issue 51): python results/baselines/table.py [EVAL_DIR]."""

import json
import sys
from pathlib import Path

d = Path(sys.argv[1] if len(sys.argv) > 1 else "results/baselines/dense_seed44")  # the run's eval/ or its copy here
rec = json.load(open("results/study/study.json"))["runs"]
SETS = ("fineweb", "wikipedia", "tinystories", "fineweb_edu")
LS = (256, 1024, 2048, 4096)


def ppl(rep):
    return {ds: {r["length"]: r["ppl"] for r in rows} for ds, rows in rep["datasets"].items()}


def merge(*reps):
    out = {ds: {} for ds in SETS}
    for r in reps:
        for ds in SETS:
            out[ds].update(r.get(ds, {}))
    return out


rows = [("dense (plain)", merge(ppl(json.loads((d / "2000.json").read_text())), ppl(json.loads((d / "2000-study-lengths_256,2048,4096.json").read_text()))))]
for f in sorted(d.glob("2000-study-*kind*")) + sorted(d.glob("2000-study-rope*")):
    label = f.stem.replace("2000-study-", "").replace("_lengths_256,1024,2048,4096", "")
    rows.append((f"dense, {label}", ppl(json.loads(f.read_text()))))
for n in ("fib_fixed_w8_seed44", "fib_stagger_w8_seed44", "dense_retrofit_stagger_w8"):
    e = rec[n]["evals"]
    k = [x for x in e if "-" not in x.replace(".json", "")][0]
    rows.append((n, merge(ppl(e[k]), *(ppl(v) for kk, v in e.items() if "lengths" in kk))))
print("| seed 44 | " + " | ".join(f"{ds} 1x / 4x / 8x / 16x" for ds in SETS) + " |")
print("|---|" + "---|" * len(SETS))
for label, p in rows:
    print(f"| {label} | " + " | ".join(" / ".join(f"{p[ds][L]:.2f}" if L in p[ds] else "-" for L in LS) for ds in SETS) + " |")
