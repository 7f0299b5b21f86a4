"""The GPU benchmark scripts that have a CPU mode still run (CI has no GPU: this keeps them from rotting)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_auto_overhead_runs_on_the_cpu(tmp_path):
    out = tmp_path / "auto_overhead.jsonl"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "auto_overhead.py"), str(out), "2",
                           "--cpu", "--sync-parts"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["concurrency"] == 2 and row["ar"]["tok_per_s"] > 0 and row["auto"]["tok_per_s"] > 0
    assert row["auto"]["stats"]["budget_hist"] and row["auto"]["policy"]["table"]["batch"]
    assert {"scheduler.schedule", "spec.ar_steps", "drafter.store_pending"} <= row["auto"]["host_s"].keys()
