"""`ddtree bench report`: PNG plots and one Markdown report (`report.md`) from result JSON lines.

Reads rows of `bench sweep`, `bench serve` and `bench latency` (any mix of files) and groups them by
source (sweep/latency: in process, a `--continuous` sweep apart; serve: over HTTP), dataset and
device, since only rows of one group are comparable. Per group: throughput vs concurrency per mode,
the budget x topk heatmap at C=1 (tok/s and tau), the acceptance length distribution, per-category
speedups vs AR and, for serve rows, the latency table; then the hardware and commits the rows came
from. A plot without data is skipped and the report says so. A configuration measured twice keeps its
last row.
"""
from __future__ import annotations

import json
import os
import re

SPEED_MODES = ("ar", "dflash", "ddtree", "auto")


def load_rows(paths: list[str]) -> tuple[list[dict], list[str]]:
    """Decoding-speed rows (step-time rows dropped), last row per configuration; plus notes on skipped lines."""
    rows, notes = {}, []
    for path in paths:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    notes.append(f"{path}:{n}: not JSON, skipped")
                    continue
                if not isinstance(r, dict) or r.get("output_tok_per_s") is None or "mode" not in r:
                    continue
                r["source"] = "serve" if r.get("bench") == "serve" else \
                    "in-process, continuous" if r.get("batching") == "continuous" else "in-process"
                if r.get("temperature"):  # sampled rows compare among themselves (greedy rows carry 0 or none)
                    r["source"] += f", T={r['temperature']:g}" + (f" top-p {r['top_p']:g}" if r.get("top_p", 1) < 1 else "")
                r["file"] = path
                key = (r["source"], r.get("dataset"), r.get("device"), r["mode"], str(r.get("budget")),
                       r.get("topk"), r.get("concurrency"))
                rows.pop(key, None)  # re-insert: the last measurement wins and keeps file order
                rows[key] = r
    return list(rows.values()), notes


def label(r: dict) -> str:
    return f"ddtree b{r['budget']} k{r['topk']}" if r["mode"] == "ddtree" else r["mode"]


def slug(*parts) -> str:
    return "_".join(re.sub(r"[^A-Za-z0-9]+", "-", str(p)).strip("-").lower() for p in parts)


def fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["source"], r.get("dataset"), r.get("device")), []).append(r)
    return out


def best_fixed(rows: list[dict], c: int, modes=("ar", "dflash", "ddtree")) -> dict | None:
    cand = [r for r in rows if r.get("concurrency") == c and r["mode"] in modes]
    return max(cand, key=lambda r: r["output_tok_per_s"]) if cand else None


def one(rows: list[dict], mode: str, c: int) -> dict | None:
    """The row of a non-grid mode (ar, dflash, auto) at concurrency c."""
    return next((r for r in rows if r["mode"] == mode and r.get("concurrency") == c), None)


def plt_figure(*args, **kw):
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on servers and in CI
    import matplotlib.pyplot as plt
    return plt, plt.subplots(*args, **kw)


def plot_throughput(rows: list[dict], title: str, path: str) -> bool:
    levels = sorted({r["concurrency"] for r in rows if r["mode"] in SPEED_MODES})
    if len(levels) < 2:
        return False
    plt, (fig, ax) = plt_figure(figsize=(7, 4.5))
    series = {m: [one(rows, m, c) for c in levels] for m in ("ar", "dflash", "auto")}
    series["ddtree (best of grid)"] = [best_fixed(rows, c, ("ddtree",)) for c in levels]
    for name, pts in series.items():
        xs = [c for c, r in zip(levels, pts) if r]
        if xs:
            ax.plot(xs, [r["output_tok_per_s"] for r in pts if r], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tok/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_heatmap(rows: list[dict], title: str, path: str) -> bool:
    grid = [r for r in rows if r["mode"] == "ddtree" and r.get("concurrency") == 1]
    if not grid:
        return False
    budgets, topks = sorted({r["budget"] for r in grid}), sorted({r["topk"] for r in grid})
    plt, (fig, axes) = plt_figure(1, 2, figsize=(4 + 1.1 * len(topks) * 2, 1.5 + 0.5 * len(budgets)))
    for ax, key, name in zip(axes, ("output_tok_per_s", "mean_accept_length"), ("tok/s", "tau")):
        cell = {(r["budget"], r["topk"]): r.get(key) for r in grid}
        data = [[cell.get((b, k)) if cell.get((b, k)) is not None else float("nan") for k in topks] for b in budgets]
        im = ax.imshow(data, cmap="viridis", aspect="auto", origin="lower")
        for i, b in enumerate(budgets):
            for j, k in enumerate(topks):
                if cell.get((b, k)) is not None:
                    v = cell[(b, k)]
                    digits = (0 if v >= 100 else 1) if key == "output_tok_per_s" else 2
                    ax.text(j, i, fmt(v, digits), ha="center", va="center", color="w", fontsize=8)
        ax.set_xticks(range(len(topks)), [str(k) for k in topks])
        ax.set_yticks(range(len(budgets)), [str(b) for b in budgets])
        ax.set_xlabel("topk")
        ax.set_ylabel("budget")
        ax.set_title(f"{name} at C=1", fontsize=9)
        fig.colorbar(im, ax=ax)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def hist_rows(rows: list[dict]) -> list[dict]:
    """At the lowest concurrency: DFlash, auto, the fastest DDTree config and the default pair (b8 k4)."""
    spec = [r for r in rows if r["mode"] in ("dflash", "ddtree", "auto") and r.get("accept_length_hist")]
    if not spec:
        return []
    c = min(r["concurrency"] for r in spec)
    at = [r for r in spec if r["concurrency"] == c]
    picked = [r for r in at if r["mode"] in ("dflash", "auto")]
    ddt = [r for r in at if r["mode"] == "ddtree"]
    if ddt:
        picked.append(max(ddt, key=lambda r: r["output_tok_per_s"]))
        picked += [r for r in ddt if (r["budget"], r["topk"]) == (8, 4) and r not in picked]
    return picked


def plot_accept_hist(rows: list[dict], title: str, path: str) -> bool:
    picked = hist_rows(rows)
    if not picked:
        return False
    plt, (fig, ax) = plt_figure(figsize=(7, 4))
    width, longest = 0.8 / len(picked), 1
    for i, r in enumerate(picked):
        h = {int(k): v for k, v in r["accept_length_hist"].items()}
        total, xs = sum(h.values()), sorted(h)
        longest = max(longest, xs[-1])
        ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], [h[x] / total for x in xs], width,
               label=f"{label(r)} (tau {fmt(r.get('mean_accept_length'), 2)})")
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlim(0.5, longest + 0.5)
    ax.set_xlabel("tokens committed per verify step")
    ax.set_ylabel("fraction of steps")
    ax.set_title(f"{title}, C={picked[0]['concurrency']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def category_speedups(rows: list[dict]) -> tuple[int, dict[str, dict[str, float]]] | None:
    """(C, {mode label: {category: tok/s over AR's}}) at the lowest C where AR has per-category results."""
    ars = sorted((r for r in rows if r["mode"] == "ar" and r.get("per_category")), key=lambda r: r["concurrency"])
    for ar in ars:
        c = ar["concurrency"]
        modes = [r for r in rows if r.get("concurrency") == c and r.get("per_category") and r["mode"] != "ar"]
        ddt = [r for r in modes if r["mode"] == "ddtree"]
        picked = [r for r in modes if r["mode"] in ("dflash", "auto")]
        picked += [max(ddt, key=lambda r: r["output_tok_per_s"])] if ddt else []
        out = {}
        for r in picked:
            out[label(r)] = {cat: v["output_tok_per_s"] / ar["per_category"][cat]["output_tok_per_s"]
                             for cat, v in r["per_category"].items()
                             if cat in ar["per_category"] and ar["per_category"][cat]["output_tok_per_s"]}
        if out:
            return c, out
    return None


def plot_categories(speedups: dict[str, dict[str, float]], title: str, path: str) -> None:
    cats = sorted({c for v in speedups.values() for c in v})
    plt, (fig, ax) = plt_figure(figsize=(max(6, 0.9 * len(cats) * len(speedups)), 4))
    width = 0.8 / len(speedups)
    for i, (name, v) in enumerate(speedups.items()):
        ax.bar([j - 0.4 + width * (i + 0.5) for j in range(len(cats))], [v.get(c, 0) for c in cats], width,
               label=name)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_ylabel("speedup vs AR")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def auto_bursts_table(rows: list[dict]) -> list[str]:
    """What auto's timed bursts realized by batch bucket and budget (0: AR), tokens per ms and request.
    A row's policy state adds up over the rows one engine ran (one command: one `time`), so the last
    row of each command counts; empty without any."""
    last = {r.get("time"): r["policy"]["totals"] for r in rows if r.get("policy", {}).get("totals")}
    sums = {}  # (bucket, budget) -> [bursts, tokens per request, ms]
    for totals in last.values():
        for key, (n, tokens, ms) in totals.items():
            budget, bucket = (int(x) for x in key.split("@"))
            s = sums.setdefault((bucket, budget), [0, 0.0, 0.0])
            s[0], s[1], s[2] = s[0] + n, s[1] + tokens, s[2] + ms
    if not sums:
        return []
    cells = {}  # bucket -> budget -> "rate (bursts)"
    for (bucket, budget), (n, tokens, ms) in sums.items():
        cells.setdefault(bucket, {})[budget] = f"{tokens / ms:.3f} ({n})" if ms > 0 else f"- ({n})"
    budgets = sorted({b for row in cells.values() for b in row})
    md = ["What auto's bursts realized, tokens per ms and request (bursts), by batch size (up to):", "",
          "| batch | " + " | ".join("AR" if b == 0 else f"b{b}" for b in budgets) + " |",
          "|---" * (len(budgets) + 1) + "|"]
    md += [f"| {k} | " + " | ".join(cells[k].get(b, "-") for b in budgets) + " |" for k in sorted(cells)]
    return md + [""]


def throughput_table(rows: list[dict]) -> list[str]:
    levels = sorted({r["concurrency"] for r in rows if r["mode"] in SPEED_MODES})
    lines = ["| C | AR tok/s | DFlash tok/s (tau) | best fixed (tau) | auto tok/s (tau) | auto / AR | auto / best |",
             "|---|---|---|---|---|---|---|"]
    for c in levels:
        ar, df, au, best = one(rows, "ar", c), one(rows, "dflash", c), one(rows, "auto", c), best_fixed(rows, c)

        def cell(r):
            return "-" if r is None else f"{r['output_tok_per_s']:.1f} ({fmt(r.get('mean_accept_length'), 2)})"

        best_cell = "-" if best is None else f"{label(best)}: {cell(best)}"
        # (three decimals: the goals are thresholds, >= 1x AR and >= 0.95x the best, that two would blur)
        vs_ar = f"{au['output_tok_per_s'] / ar['output_tok_per_s']:.3f}x" if au and ar else "-"
        vs_best = f"{au['output_tok_per_s'] / best['output_tok_per_s']:.3f}x" if au and best else "-"
        lines.append(f"| {c} | {fmt(ar and ar['output_tok_per_s'])} | {cell(df)} | {best_cell} | {cell(au)} | "
                     f"{vs_ar} | {vs_best} |")
    return lines


def serve_table(rows: list[dict]) -> list[str]:
    lines = ["| mode | budget | topk | C | tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | tau |"
             " errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (label(r), r["concurrency"])):
        lat = " | ".join(f"{fmt(r.get(f'p50_{k}_ms'))} / {fmt(r.get(f'p99_{k}_ms'))}" for k in ("ttft", "tpot", "itl"))
        lines.append(f"| {r['mode']} | {r.get('budget')} | {r.get('topk')} | {r['concurrency']} | "
                     f"{r['output_tok_per_s']:.1f} | {lat} | {fmt(r.get('mean_accept_length'), 2)} | "
                     f"{r.get('num_errors', 0)} |")
    return lines


def provenance(rows: list[dict]) -> list[str]:
    keys = ("device", "commit", "torch", "transformers", "python")
    seen: dict[tuple, dict] = {}
    for r in rows:
        k = tuple(r.get(x) for x in keys)
        e = seen.setdefault(k, {"rows": 0, "files": set(), "times": []})
        e["rows"] += 1
        e["files"].add(os.path.basename(r["file"]))
        if r.get("time"):
            e["times"].append(r["time"])
    lines = ["| device | commit | torch | transformers | python | rows | files | measured |",
             "|---|---|---|---|---|---|---|---|"]
    for k, e in seen.items():
        when = f"{min(e['times'])} .. {max(e['times'])}" if e["times"] else "-"
        lines.append("| " + " | ".join(str(x) for x in k) + f" | {e['rows']} | {', '.join(sorted(e['files']))} | "
                     f"{when} |")
    return lines


def main(args) -> int:
    for p in args.results:
        if not os.path.exists(p):
            raise FileNotFoundError(f"no results file {p}")
    rows, notes = load_rows(args.results)
    if args.out is None:  # the report lives with the results it shows
        args.out = os.path.join(os.path.dirname(args.results[0]), "report")
    os.makedirs(args.out, exist_ok=True)
    md = ["# ddtree benchmark report", "",
          f"{len(rows)} result rows from {', '.join(f'`{p}`' for p in args.results)}. Throughput is output "
          "tokens per second; tau is the mean number of tokens committed per verify step. In-process rows "
          "(`bench sweep` / `bench latency`) and HTTP rows (`bench serve`) are reported separately.", ""]
    if not rows:
        md += ["No decoding-speed rows found: nothing to plot.", ""]
    for (source, dataset, device), g in groups(rows).items():
        title = f"{source} · {dataset} · {device}"
        base = slug(source, dataset, device)

        def figure(heading: str, name: str, plot, why_not: str) -> None:
            """A section with the plot `plot(g, title, path)` draws, or a note saying why there is none."""
            png = f"{base}_{name}.png"
            drawn = plot(g, title, os.path.join(args.out, png))
            md.extend([f"### {heading}", "", f"![{heading.lower()}]({png})" if drawn else f"_No plot: {why_not}._", ""])

        md += [f"## {title}", ""]
        figure("Throughput vs concurrency", "throughput", plot_throughput, "fewer than two concurrency levels")
        md += throughput_table(g) + [""]
        peers = [r for r in g if r["mode"] not in SPEED_MODES]
        if peers:  # e.g. transformers generate and the reference dflash from `bench latency --peers`
            md += ["Other engines:", "", "| mode | C | tok/s | tau |", "|---|---|---|---|"]
            md += [f"| {r['mode']} | {r.get('concurrency')} | {r['output_tok_per_s']:.1f} | "
                   f"{fmt(r.get('mean_accept_length'), 2)} |" for r in peers] + [""]
        chosen = sorted((r for r in g if r["mode"] == "auto" and r.get("budget_hist")), key=lambda r: r["concurrency"])
        if chosen:  # what adaptive speculation picked, as shares of request-steps (0 = plain AR)
            md += ["Budgets chosen by auto (share of request-steps):", "", "| C | budgets |", "|---|---|"]
            for r in chosen:
                total = sum(r["budget_hist"].values())
                md.append(f"| {r['concurrency']} | " + ", ".join(f"{b}: {n / total:.0%}"
                                                               for b, n in r["budget_hist"].items()) + " |")
            md += [""]
            md += auto_bursts_table(chosen)
        if source == "serve":
            md += ["### Latency (serve)", ""] + serve_table(g) + [""]
        figure("Budget x topk at C=1", "heatmap", plot_heatmap, "no DDTree rows at concurrency 1")
        figure("Acceptance length distribution", "accept", plot_accept_hist,
               "no speculative rows with an acceptance length histogram")
        md += ["### Per-category speedup vs AR", ""]
        cs = category_speedups(g)
        if cs is None:
            md += ["_No plot: needs AR and speculative rows with per-category results (MT-Bench)._", ""]
        else:
            c, sp = cs
            png = f"{base}_categories.png"
            plot_categories(sp, f"{title}, C={c}", os.path.join(args.out, png))
            cats = sorted({k for v in sp.values() for k in v})
            md += [f"![per-category speedup]({png})", "", f"C={c}; per-category tok/s over AR's.", "",
                   "| mode | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
            md += [f"| {m} | " + " | ".join(f"{v[k]:.2f}x" if k in v else "-" for k in cats) + " |"
                   for m, v in sp.items()]
            md += [""]
    md += ["## Hardware and commits", ""] + (provenance(rows) if rows else ["_No rows._"]) + [""]
    commands = sorted({r.get("command") for r in rows if r.get("command")})
    if commands:
        md += ["Commands:", ""] + [f"- `{c}`" for c in commands] + [""]
    if notes:
        md += ["Skipped input lines:", ""] + [f"- {n}" for n in notes] + [""]
    path = os.path.join(args.out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(md))
    print(f"report written to {path}")
    return 0
