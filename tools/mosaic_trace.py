"""Summarize a Mosaic GPU profiler trace (a JSON file a kernel call wrote under GLINT_MOSAIC_PROFILE=DIR, see
pallas_kernels/mosaic_keys.compiler_params): per warpgroup, each named scope's mean time and count per CTA; the mean
CTA lifetime (a warpgroup's first event to its last) and the idle time between one CTA's end and the next's start on
the same multiprocessor.

    GLINT_MOSAIC_PROFILE=/tmp/prof python3 tools/gpu_fp8_kv.py 256 640   # then:
    python3 tools/mosaic_trace.py /tmp/prof/*.json [--warpgroups N]

Traces number a CTA's warpgroups consecutively; how many a CTA has is read from the scopes (a decode kernel's
widening warpgroup's "widen_k": three, else two) unless --warpgroups says.
"""
import collections
import itertools
import json
import statistics
import sys


def summarize(path: str, warpgroups: int | None = None) -> str:
    """The table for one trace; `warpgroups` traces per CTA (the kernel's warpgroups, in order; None: three if a
    warpgroup widens, else two)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    if warpgroups is None:
        warpgroups = 3 if any(e["name"] == "widen_k" for e in events) else 2
    per_tid = collections.defaultdict(list)
    for e in events:
        per_tid[e["tid"]].append(e)
    spent = collections.defaultdict(float)  # (warpgroup, scope) -> us over all CTAs
    count = collections.Counter()
    ctas = collections.Counter()
    spans = collections.defaultdict(list)  # sm -> [(start, end)] of each CTA's first warpgroup
    lifetimes = collections.defaultdict(list)
    for tid, evs in per_tid.items():
        wg = (tid - 1) % warpgroups
        ctas[wg] += 1
        stack = []
        for e in evs:
            if e["ph"] == "B":
                stack.append(e)
            elif stack:
                b = stack.pop()
                spent[wg, b["name"]] += e["ts"] - b["ts"]
                count[wg, b["name"]] += 1
        lifetimes[wg].append(evs[-1]["ts"] - evs[0]["ts"])
        if wg == 0:
            spans[evs[0]["pid"]].append((evs[0]["ts"], evs[-1]["ts"]))
    gaps = []
    for sm_spans in spans.values():
        sm_spans.sort()
        gaps += [b[0] - a[1] for a, b in itertools.pairwise(sm_spans) if b[0] > a[1]]
    lines = [f"{path}: {ctas[0]} CTAs on {len(spans)} SMs"]
    for wg in sorted(ctas):
        life = statistics.mean(lifetimes[wg])
        lines.append(f"  warpgroup {wg}: lifetime {life:.2f} us a CTA (first to last event)")
        for (w, name), t in sorted(spent.items(), key=lambda kv: -kv[1]):
            if w == wg:
                lines.append(f"    {name:<12} {t / ctas[wg]:8.2f} us a CTA ({100 * t / ctas[wg] / life:5.1f} %), "
                             f"{count[w, name] / ctas[wg]:5.1f} times")
    if gaps:
        lines.append(f"  between CTAs on an SM (warpgroup 0): mean {statistics.mean(gaps):.2f} us, median "
                     f"{statistics.median(gaps):.2f} us over {len(gaps)} gaps")
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    wgs = int(args.pop(args.index("--warpgroups") + 1)) if "--warpgroups" in args else None
    args = [a for a in args if a != "--warpgroups"]
    for p in args:
        print(summarize(p, wgs))
