"""`ddtree bench sweep`, `bench serve` and `bench report`, CPU-sized, through the CLI on a tiny model pair.

One DDTree server subprocess starts at the beginning of the module (it loads while the in-process sweep
runs); the serve benchmark drives it at two concurrencies; the report reads both result files.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tiny import make_tiny_pair

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_S = 120
MTBENCH = ["--dataset", "mtbench"]


def read_rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    # long context: MT-Bench prompts are several hundred tokens for the tiny tokenizer
    return make_tiny_pair(str(tmp_path_factory.mktemp("bench")), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def launched(pair, tmp_path_factory):
    """A DDTree server process (budget 4, topk 2), started but not yet waited for."""
    model, draft = pair
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = str(tmp_path_factory.mktemp("bench_logs") / "server.log")
    cmd = [sys.executable, "-m", "ddtree.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
           "--model", model, "--draft", draft, "--spec", "ddtree", "--budget", "4", "--topk", "2",
           "--num-pages", "512", "--max-num-seqs", "4"]
    env = {k: v for k, v in os.environ.items() if k != "DDTREE_API_KEY"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        yield f"http://127.0.0.1:{port}", proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(launched) -> str:
    url, proc, log = launched
    deadline = time.monotonic() + STARTUP_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{open(log).read()}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"server not healthy within {STARTUP_S}s:\n{open(log).read()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def sweep_file(pair, launched, tmp_path_factory) -> str:
    from ddtree.cli import main
    model, draft = pair
    out = str(tmp_path_factory.mktemp("sweep") / "sweep.jsonl")
    rc = main(["bench", "sweep", "--model", model, "--draft", draft, "--device", "cpu", "--dtype", "float32",
               *MTBENCH, "--num-prompts", "2", "--max-tokens", "6", "--ignore-eos", "--concurrency", "1,2",
               "--budget", "2,4", "--topk", "1,2", "--repeats", "1", "--num-pages", "512", "--out", out])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def serve_file(server, tmp_path_factory) -> str:
    from ddtree.cli import main
    out = str(tmp_path_factory.mktemp("serve") / "serve.jsonl")
    rc = main(["bench", "serve", "--base-url", server, *MTBENCH, "--num-prompts", "3", "--concurrency", "1,2",
               "--max-tokens", "8", "--output-len", "fixed", "--warmup", "1", "--timeout", "60", "--out", out])
    assert rc == 0
    return out


COMMON = {"device", "mode", "budget", "topk", "concurrency", "dataset", "output_tok_per_s", "mean_accept_length",
          "commit", "command", "accept_length_hist"}


def test_sweep_writes_a_row_per_mode_and_concurrency_with_common_fields(sweep_file):
    rows = read_rows(sweep_file)
    grid = {(r["mode"], r["budget"], r["topk"], r["concurrency"]) for r in rows}
    expected = {("ar", 0, 1, c) for c in (1, 2)} | {("dflash", 7, 1, c) for c in (1, 2)} | \
        {("ddtree", b, k, c) for b in (2, 4) for k in (1, 2) for c in (1, 2)}
    assert grid == expected and len(rows) == len(expected)
    for r in rows:
        assert COMMON <= r.keys() and r["bench"] == "sweep" and r["device"] == "cpu" and r["dataset"] == "mtbench"
        assert r["output_tok_per_s"] > 0 and r["generated_tokens"] == 2 * 6  # ignore_eos: fixed lengths
        if r["mode"] == "ar":
            assert r["mean_accept_length"] is None and r["accept_length_hist"] == {}
        else:  # the histogram is of the same steps as the mean
            h = {int(k): v for k, v in r["accept_length_hist"].items()}
            assert r["mean_accept_length"] == pytest.approx(sum(k * v for k, v in h.items()) / sum(h.values()))
        # per category only at C=1, where each batch is one prompt
        assert ("per_category" in r) == (r["concurrency"] == 1)
        if r["concurrency"] == 1:
            assert set(r["per_category"]) == {"writing", "roleplay"}  # categories taken in turn
            assert all(v["output_tok_per_s"] > 0 and v["generated_tokens"] == 6 for v in r["per_category"].values())


def test_sweep_with_auto_adds_auto_rows_or_fails_clearly(pair, tmp_path, capsys, monkeypatch):
    from ddtree import LLM
    from ddtree.cli import main
    model, draft = pair
    out = str(tmp_path / "auto.jsonl")
    modes = []  # (spec, budget) of every generate call
    real = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, *a, **k: modes.append((self.spec, self.budget)) or
                        real(self, *a, **k))
    rc = main(["bench", "sweep", "--model", model, "--draft", draft, "--device", "cpu", "--dtype", "float32",
               "--num-prompts", "2", "--max-tokens", "4", "--concurrency", "1,2", "--budget", "2", "--topk", "1",
               "--no-ar", "--no-dflash", "--with-auto", "--repeats", "1", "--num-pages", "256", "--warmup-pass",
               "--out", out])
    if rc == 0:  # adaptive speculation is available
        rows = read_rows(out)
        assert [(r["mode"], r["budget"], r["concurrency"]) for r in rows] == \
            [("auto", "auto", 1), ("auto", "auto", 2), ("ddtree", 2, 1), ("ddtree", 2, 2)]
        # the warm-up pass: every batch of every concurrency (2 + 1), in AR, before any measured run
        assert modes[:3] == [("none", 0)] * 3 and ("none", 0) not in modes[3:], modes
    else:  # not yet: nothing measured, and the error names the missing feature
        assert rc == 2 and "budget='auto'" in capsys.readouterr().err and not os.path.exists(out)


def test_sweep_continuous_queues_every_prompt_with_at_most_c_running(pair, tmp_path, monkeypatch):
    from ddtree.cli import main
    from ddtree.engine.scheduler import Scheduler
    model, draft = pair
    out = str(tmp_path / "continuous.jsonl")
    running = []  # (cap, requests running) after every schedule
    real = Scheduler.schedule
    monkeypatch.setattr(Scheduler, "schedule", lambda self: (lambda step: running.append(
        (self.max_num_seqs, len(self.running))) or step)(real(self)))
    rc = main(["bench", "sweep", "--model", model, "--draft", draft, "--device", "cpu", "--dtype", "float32",
               "--num-prompts", "5", "--max-tokens", "4", "--ignore-eos", "--concurrency", "2,4", "--budget", "2",
               "--topk", "1", "--no-dflash", "--repeats", "1", "--num-pages", "256", "--continuous", "--out", out])
    assert rc == 0
    rows = read_rows(out)
    assert [(r["mode"], r["concurrency"], r["batching"]) for r in rows] == \
        [(m, c, "continuous") for m in ("ar", "ddtree") for c in (2, 4)]  # (C=1 too: one at a time either way)
    # every prompt once, in one queue (cycled to 2C: 8 at C=4)
    assert [r["generated_tokens"] for r in rows] == [5 * 4, 8 * 4] * 2
    # (the engine holds up to 4: at C=2 the scheduler's cap keeps the third prompt waiting)
    assert max(n for cap, n in running if cap == 2) == 2 and max(n for cap, n in running if cap == 4) == 4
    assert all(n <= cap for cap, n in running)
    # the report keeps these rows apart from batches run to completion
    assert main(["bench", "report", out, "--out", str(tmp_path / "report")]) == 0
    assert "in-process, continuous" in (tmp_path / "report" / "report.md").read_text()


def test_sweep_interleaved_runs_the_modes_in_turn_on_engines_it_keeps(pair, tmp_path, monkeypatch):
    from ddtree import LLM
    from ddtree.cli import main
    from ddtree.engine.engine import LLMEngine
    model, draft = pair
    out = str(tmp_path / "interleaved.jsonl")
    calls, built = [], []  # (engine, its mode, prompts) of every generate call; engines built
    real_generate, real_init = LLM.generate, LLMEngine.__init__
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, *a, **k: calls.append(
        (self.engine, (self.spec, self.budget), len(prompts))) or real_generate(self, prompts, *a, **k))
    monkeypatch.setattr(LLMEngine, "__init__", lambda self, *a, **k: built.append(self) or real_init(self, *a, **k))
    rc = main(["bench", "sweep", "--model", model, "--draft", draft, "--device", "cpu", "--dtype", "float32",
               "--num-prompts", "3", "--max-tokens", "4", "--ignore-eos", "--concurrency", "1,2", "--budget", "2",
               "--topk", "1", "--no-dflash", "--repeats", "2", "--num-pages", "256", "--continuous",
               "--interleave", "--out", out])
    assert rc == 0
    rows = read_rows(out)
    assert [(r["mode"], r["concurrency"], r["interleaved"]) for r in rows] == \
        [(m, c, True) for c in (1, 2) for m in ("ar", "ddtree")]
    assert all(len(r["runs_tok_per_s"]) == 2 for r in rows)
    assert [r["generated_tokens"] for r in rows] == [3 * 4] * 2 + [4 * 4] * 2  # (C=2: the queue cycled to 2C)
    # one engine per mode, built once and kept (the AR rows' is the one the LLM started with)
    assert len(built) == 2
    # at each C: a warm-up per mode, then the modes in turn, run by run, each on its own engine
    ar, dd = ("none", 0), ("ddtree", 2)
    # (every other round in reverse)
    at_1 = [ar, dd] + [ar] * 3 + [dd] * 3 + [dd] * 3 + [ar] * 3  # (C=1: a run is 3 batches of one prompt)
    at_2 = [ar, dd] + [ar, dd] + [dd, ar]  # (continuous: a run is one queue)
    assert [m for _, m, _ in calls] == at_1 + at_2
    engines = {m: {id(e) for e, mm, _ in calls if mm == m} for m in (ar, dd)}
    assert all(len(ids) == 1 for ids in engines.values())


def test_sweep_interleaved_needs_num_pages(pair, capsys):
    from ddtree.cli import main
    model, draft = pair
    rc = main(["bench", "sweep", "--model", model, "--draft", draft, "--device", "cpu", "--interleave",
               "--concurrency", "1", "--budget", "2", "--topk", "1"])
    assert rc == 2 and "--num-pages" in capsys.readouterr().err


def test_switch_mode_keeps_engines_and_points_the_layers_at_the_running_ones_cache(pair):
    from ddtree import LLM, SamplingParams
    model, draft = pair
    llm = LLM(model, draft=draft, spec="none", device="cpu", dtype="float32", num_pages=64)
    params = SamplingParams(max_tokens=6)
    ar_engine, ar_out = llm.engine, llm.generate([[5, 6, 7]], params)[0].token_ids

    def bound_to(engine) -> bool:
        return all(layer.self_attn.k_cache.data_ptr() == engine.runner.kv_cache[0, i].data_ptr()
                   for i, layer in enumerate(llm.net.model.layers))

    llm.switch_mode("ddtree", 4, 2)
    dd_engine = llm.engine
    assert dd_engine is not ar_engine and bound_to(dd_engine)
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == ar_out  # (lossless)
    llm.switch_mode("none")
    assert llm.engine is ar_engine and bound_to(ar_engine)
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == ar_out
    llm.switch_mode("dflash")  # (a second engine with the drafter: it owns the drafter's layers now)

    def drafter_bound_to(engine) -> bool:
        return all(layer.self_attn.k_cache.data_ptr() == engine.speculator.drafter.kv_cache[0, i].data_ptr()
                   for i, layer in enumerate(llm.drafter.layers))

    df_engine = llm.engine
    assert drafter_bound_to(df_engine) and bound_to(df_engine)
    llm.switch_mode("ddtree", 4, 2)
    assert llm.engine is dd_engine and bound_to(dd_engine) and drafter_bound_to(dd_engine)
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == ar_out
    llm.switch_mode("dflash")
    assert llm.engine is df_engine and drafter_bound_to(df_engine)
    llm.set_mode("none")  # (set_mode frees every kept engine)
    assert llm.engine is not ar_engine and not llm.kept


def test_serve_bench_reports_latency_stats_and_acceptance_from_metrics(serve_file):
    rows = read_rows(serve_file)
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert COMMON <= r.keys() and r["bench"] == "serve"
        # the server's mode comes from /v1/models
        assert (r["mode"], r["spec"], r["budget"], r["topk"], r["device"]) == ("ddtree", "ddtree", 4, 2, "cpu")
        n = max(3, 4 * r["concurrency"])  # closed loop: at least 4 requests per client, prompts repeating
        assert r["num_requests"] == n and r["num_errors"] == 0 and r["generated_tokens"] == n * 8
        for k in ("ttft", "tpot", "itl", "e2e"):
            stats = [r[f"{s}_{k}_ms"] for s in ("mean", "p50", "p90", "p99")]
            assert all(v is not None and v >= 0 for v in stats) and stats[1] <= stats[2] <= stats[3]
        # tau from the /metrics deltas equals that of the measured requests' own accept lengths (warm-up excluded)
        h = {int(k): v for k, v in r["accept_length_hist"].items()}
        assert r["verify_steps"] == sum(h.values()) > 0
        assert r["mean_accept_length"] == pytest.approx(sum(k * v for k, v in h.items()) / sum(h.values()))
        assert 0 < r["drafted_tokens"] <= 4 * r["verify_steps"]  # at most the budget per step
        cats = r["per_category"]
        assert set(cats) == {"writing", "roleplay", "reasoning"}
        assert sum(v["num_requests"] for v in cats.values()) == n
        assert all(v["mean_ttft_ms"] > 0 and v["output_tok_per_s"] > 0 for v in cats.values())


def test_multi_turn_serve_bench_sends_each_answer_back_and_reports_cached_prompt_tokens_per_turn(server, tmp_path):
    from ddtree.cli import main
    out = str(tmp_path / "turns.jsonl")
    assert main(["bench", "serve", "--base-url", server, *MTBENCH, "--num-prompts", "2", "--concurrency", "1",
                 "--multi-turn", "--max-tokens", "6", "--output-len", "fixed", "--warmup", "1", "--timeout", "60",
                 "--out", out]) == 0
    (r,) = read_rows(out)
    turns = r["per_turn"]
    assert r["server_prefix_caching"] is True  # (from the server's model card)
    assert set(turns) == {"1", "2"} and r["num_requests"] == 8 and r["num_errors"] == 0  # 4 conversations
    assert turns["1"]["num_requests"] == turns["2"]["num_requests"] == 4
    # a second turn holds the first turn's prompt and answer: longer, and its first pages come from the cache
    assert turns["2"]["prompt_tokens"] > turns["1"]["prompt_tokens"] + 4 * 6
    assert 0 < turns["2"]["cached_prompt_tokens"] < turns["2"]["prompt_tokens"]
    assert r["cached_prompt_tokens"] == turns["1"]["cached_prompt_tokens"] + turns["2"]["cached_prompt_tokens"]


def test_report_writes_markdown_and_plots_and_says_what_it_skipped(sweep_file, serve_file, tmp_path):
    from ddtree.cli import main
    out = tmp_path / "report"
    assert main(["bench", "report", sweep_file, serve_file, "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    pngs = sorted(p.name for p in out.glob("*.png"))
    # in process: everything; serve (one DDTree server, no AR): no per-category speedups
    assert pngs == ["in-process_mtbench_cpu_accept.png", "in-process_mtbench_cpu_categories.png",
                    "in-process_mtbench_cpu_heatmap.png", "in-process_mtbench_cpu_throughput.png",
                    "serve_mtbench_cpu_accept.png", "serve_mtbench_cpu_heatmap.png", "serve_mtbench_cpu_throughput.png"]
    assert all((out / p).stat().st_size > 1000 for p in pngs)
    for p in pngs:
        assert f"]({p})" in md
    assert "## in-process · mtbench · cpu" in md and "## serve · mtbench · cpu" in md
    assert "_No plot: needs AR and speculative rows with per-category results" in md
    assert "TTFT p50 / p99 ms" in md and "## Hardware and commits" in md
    assert "| mode | roleplay | writing |" in md  # the per-category speedup table


def test_report_goes_beside_its_results_by_default(tmp_path):
    # (a committed CPU sweep's rows: the report lands in report/ of the folder that holds them)
    from ddtree.cli import main
    rows = os.path.join(ROOT, "benchmarks", "results", "cpu_2deff17_sweep_smoke", "sweep_cpu_default_pair.jsonl")
    folder = tmp_path / "cpu_2deff17_sweep_smoke"
    folder.mkdir()
    shutil.copy(rows, folder)
    assert main(["bench", "report", str(folder / "sweep_cpu_default_pair.jsonl")]) == 0
    assert "18 result rows" in (folder / "report" / "report.md").read_text()


def test_report_tables_what_autos_bursts_realized_by_batch_size():
    # Each command's last row holds its engine's totals (bursts, tokens per request, ms); commands add up.
    from ddtree.bench.report import auto_bursts_table
    rows = [{"time": "t1", "policy": {"totals": {"0@1": [9, 9.0, 9.0]}}},  # (superseded by the next row)
            {"time": "t1", "policy": {"totals": {"0@1": [10, 11.6, 10.0], "32@1": [5, 64.0, 50.0]}}},
            {"time": "t2", "policy": {"totals": {"0@1": [10, 11.6, 10.0], "8@2": [3, 9.0, 10.0]}}}]
    md = auto_bursts_table(rows)
    assert md[2:6] == ["| batch | AR | b8 | b32 |", "|---|---|---|---|", "| 1 | 1.160 (20) | - | 1.280 (5) |",
                       "| 2 | - | 0.900 (3) | - |"]
    assert auto_bursts_table([{"time": "t", "policy": {}}]) == []


def test_acceptance_bench_replays_each_mode_and_writes_rows(pair, tmp_path):
    from ddtree.cli import main
    model, draft = pair
    out = tmp_path / "acc.jsonl"
    assert main(["bench", "acceptance", "--model", model, "--draft", draft, "--dataset", "mtbench",
                 "--num-prompts", "2", "--max-tokens", "6", "--budget", "4,6", "--topk", "1,2", "--device", "cpu",
                 "--dtype", "float32", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["budget"], r["topk"]) for r in rows] == [
        ("dflash", 7, 1), ("ddtree", 4, 1), ("ddtree", 4, 2), ("ddtree", 6, 1), ("ddtree", 6, 2)]
    for r in rows:
        assert {"commit", "device", "command", "torch", "num_prompts", "steps"} <= set(r)
        assert 1.0 <= r["mean_accept_length"] <= 8 and r["steps"] >= 2 * 5 / 8  # (6 tokens a prompt, the prefill's first)
    assert main(["bench", "acceptance", "--model", model, "--draft", draft, "--budget", "auto",
                 "--device", "cpu", "--out", str(out)]) == 2
