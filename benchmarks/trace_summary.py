"""Auto's plans as stretches: reads a policy trace (`DDTREE_POLICY_TRACE=FILE`, or `TRACE=1 bash
benchmarks/h200_suite.sh grid`) and prints one line per run of consecutive plans with the same outcome at
the same batch size: where it went AR, on what rates, and how far away its next probe was.

    python benchmarks/trace_summary.py policy_trace_low.jsonl [--min-plans 1]
"""
import argparse
import json


def stretches(rows: list[dict]) -> list[list[dict]]:
    """Consecutive plans with the same outcome and batch size."""
    out: list[list[dict]] = []
    for r in rows:
        if out and (out[-1][0]["outcome"], out[-1][0]["batch"]) == (r["outcome"], r["batch"]):
            out[-1].append(r)
        else:
            out.append([r])
    return out


def describe(run: list[dict]) -> str:
    first, last = run[0], run[-1]
    line = (f"plans {first['plan']:>6}-{last['plan']:<6} {first['outcome']:>8} x{len(run):<5} batch {first['batch']:>4}"
            f"  verify steps {first['verify_steps']:>6}  interval {last['interval']:>5}")
    if "rate" in first:  # (the best budget's model rate over AR's, at the stretch's start and end)
        best = lambda r: max(r["rate"].items(), key=lambda kv: kv[1])  # noqa: E731
        (b0, r0), (b1, r1) = best(first), best(last)
        line += f"  best/AR {r0 / first['ar_rate']:.3f} (b{b0}) -> {r1 / last['ar_rate']:.3f} (b{b1})"
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--min-plans", type=int, default=1, help="only stretches of at least this many plans")
    args = p.parse_args()
    with open(args.trace) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for run in stretches(rows):
        if len(run) >= args.min_plans:
            print(describe(run))


if __name__ == "__main__":
    main()
