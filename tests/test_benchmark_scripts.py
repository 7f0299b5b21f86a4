"""The GPU benchmark scripts that have a CPU mode still run (CI has no GPU: this keeps them from rotting)."""
import json
import os
import subprocess
import sys
import tempfile

import torch

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
    assert {"scheduler.schedule", "policy.hopeless", "ar._feed"} <= row["auto"]["host_s"].keys()


def test_table_ab_runs_on_the_cpu(tmp_path):
    # auto's cost table on the scratch page and on distinct pages (spec/decode.py `padding_inputs`)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "table_ab.py"), str(tmp_path), "1,2",
                           "--cpu"], capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "profile.jsonl").read_text().splitlines()]
    assert [(r["batch"], r["layout"], r["context"]) for r in rows] == \
        [(b, n, c) for b in (1, 2) for n, c in (("scratch", 256), ("distinct", 256), ("distinct", 640))]
    assert all(set(r["step_ms"]) == {"4", "8", "16", "32"} and r["ar_ms"] > 0 for r in rows)


def test_distinct_padding_inputs_give_each_fake_request_its_own_pages():
    from ddtree import LLM
    from ddtree.models.dflash import random_drafter
    from ddtree.ops.attention import page_slots
    from tiny import make_tiny_model
    llm = LLM(make_tiny_model(tempfile.mkdtemp(), "qwen2", num_hidden_layers=2), spec="none", device="cpu",
              dtype="float32", num_pages=128)
    llm.drafter = random_drafter(llm.config, num_layers=1, block_size=8, target_layer_ids=[0, 1])
    llm.set_mode("ddtree", budget=8, topk=2)
    spec = llm.engine.speculator
    shared, own = spec.padding_inputs(3, 40), spec.padding_inputs(3, 40, distinct=True)
    assert (shared.block_tables == spec.runner.scratch_page).all() and (shared.ctx_slots == spec.drafter.scratch_slot).all()
    pages = own.block_tables.flatten().tolist()
    assert len(set(pages)) == len(pages) and spec.runner.scratch_page not in pages
    assert torch.equal(own.ctx_slots, page_slots(own.block_tables, own.ctx_pos, spec.runner.page_size))


def test_random_hybrid_writes_a_target_and_drafter_that_load(tmp_path, tiny_qwen2):
    # (the hybrid issue's GPU runs start from it: a Qwen3.5 text config's shapes, random weights)
    from ddtree import LLM, SamplingParams
    from tiny import make_config
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"text_config": make_config("qwen3_5", 384).to_dict()}))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "random_hybrid.py"), str(config),
                           str(tmp_path / "out"), "--dtype", "float32", "--block", "4", "--tokenizer", tiny_qwen2],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    made = json.loads(proc.stdout.strip().splitlines()[-1])
    assert made["linear_layers"] == 3
    llm = LLM(made["target"], draft=made["drafter"], spec="ddtree", budget=4, topk=2, device="cpu", dtype="float32",
              num_pages=64)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
