"""Where the GPU waits: idle gaps between kernels in a torch-profiler Chrome trace, and the host calls
running during them.

    python benchmarks/trace_gaps.py TRACE.json[.gz] [--min-gap-us 20] [--top 15]

`benchmarks/gpu_profile.py` writes such traces (gzipped). Prints, as JSON: the GPU's busy share over
the trace's kernel span, the number and total length of idle gaps of at least `--min-gap-us`, a
histogram of gap lengths, and the host (CPU-side) events that overlap the gaps most, by overlapped
time. A long `cudaGraphLaunch` there means launch cost is not hidden; `cudaEventSynchronize` or
`cudaStreamSynchronize` means the host waited with nothing queued behind it.
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", trace) if e.get("ph") == "X" and "dur" in e]


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def analyse(events: list[dict], min_gap_us: float = 20.0, top: int = 15) -> dict:
    device = merged([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_CATS])
    if not device:
        return {"error": "no GPU kernels in the trace"}
    span = device[-1][1] - device[0][0]
    busy = sum(e - s for s, e in device)
    gaps = [(a[1], b[0]) for a, b in zip(device, device[1:]) if b[0] - a[1] >= min_gap_us]
    hist = defaultdict(int)
    for s, e in gaps:
        n = e - s
        hist["<50us" if n < 50 else "<200us" if n < 200 else "<1ms" if n < 1000 else ">=1ms"] += 1
    host = [e for e in events if e.get("cat") not in DEVICE_CATS and e.get("cat") != "python_function"]
    overlap: dict[str, float] = defaultdict(float)
    for e in host:
        s, t = e["ts"], e["ts"] + e["dur"]
        for gs, ge in gaps:  # (few gaps, many events: fine for one profiled window)
            if gs < t and s < ge:
                overlap[e["name"]] += min(t, ge) - max(s, gs)
    ranked = sorted(overlap.items(), key=lambda kv: -kv[1])[:top]
    return {"span_ms": round(span / 1e3, 3), "busy_share": round(busy / span, 3),
            "gaps": len(gaps), "gap_ms": round(sum(e - s for s, e in gaps) / 1e3, 3),
            "gap_histogram": dict(hist), "host_during_gaps_ms": [[n, round(v / 1e3, 3)] for n, v in ranked]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    print(json.dumps({"trace": args.trace, **analyse(load_events(args.trace), args.min_gap_us, args.top)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
