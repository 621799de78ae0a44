#!/usr/bin/env python3
"""Summarizes a rank's `minimax::step` debug lines (RUST_LOG=info,minimax::step=debug): per step
of N tokens, the compute's forward and answer ms and the idle gap since the previous compute
ended, as medians and p90 over the steps of each size. With device-fed tokens (one CUDA rank,
`MINIMAX_DEVICE_FEED=1`, the default) a decode step's lines say "launched, then read back": its
"forward" is the launch alone and its "answer" runs until it is read back, which includes the
step before it, and the "idle" gap is between launches; those steps are counted apart.
  tools/gpu/step_split.py LOG..."""
import re, sys, statistics as st
from collections import defaultdict

ansi = re.compile(r"\x1b\[[0-9;]*m")
comp = defaultdict(list)
launched = 0
idle = []
for path in sys.argv[1:]:
    for line in open(path, errors="replace"):
        line = ansi.sub("", line)
        if "minimax::step" not in line:
            continue
        kv = dict(re.findall(r"(\w+)=(-?[0-9.]+)", line))
        if "forward_ms" in kv and "tokens" in kv:
            key = int(kv["tokens"])
            if "launched, then read back" in line:
                launched += 1
                key = f"{key} (launched)"
            comp[key].append((float(kv["forward_ms"]), float(kv["answer_ms"])))
        elif "idle_ms" in kv and float(kv["idle_ms"]) >= 0:
            idle.append(float(kv["idle_ms"]))

def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p / 100 * len(v)))] if v else float("nan")

print("| tokens | steps | forward ms p50 / p90 | answer ms p50 / p90 |")
print("| --- | --- | --- | --- |")
for n in sorted(comp, key=str):
    f = [a for a, _ in comp[n]]
    a = [b for _, b in comp[n]]
    print(f"| {n} | {len(f)} | {q(f, 50):.3f} / {q(f, 90):.3f} | {q(a, 50):.3f} / {q(a, 90):.3f} |")
if launched:
    print(f"{launched} steps launched before the step they follow was read back: their forward is the launch, their answer includes the step before; idle is between launches")
if idle:
    print(f"idle between computes: {len(idle)} gaps, p10 / p50 / p90 {q(idle, 10):.3f} / {q(idle, 50):.3f} / {q(idle, 90):.3f} ms")
