"""The maintained GPU tools in benchmarks/ stay runnable where CI can run them: every script imports on
the CPU, and the ones with a CPU path run it."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_imports(name, monkeypatch):
    # (their own imports and the package's names they use; main() is not run)
    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "benchmarks"), *sys.path])
    spec = importlib.util.spec_from_file_location(f"bench_{name[:-3]}", os.path.join(ROOT, "benchmarks", name))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_scripts_take_nothing_from_the_tests():
    for name in SCRIPTS:
        with open(os.path.join(ROOT, "benchmarks", name)) as f:
            text = f.read()
        assert '"tests"' not in text and "from tiny" not in text and "policy_sim" not in text, name


def test_random_hybrid_writes_a_target_and_drafter_that_load(tmp_path, tiny_qwen2):
    # (the hybrid GPU runs start from it: a Qwen3.5 text config's shapes, random weights)
    from ddtree import LLM, SamplingParams
    from tiny import make_config
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"text_config": make_config("qwen3_5", 384).to_dict()}))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "random_hybrid.py"), str(config),
                           str(tmp_path / "out"), "--dtype", "float32", "--block", "4", "--tokenizer", tiny_qwen2],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    made = json.loads(proc.stdout.strip().splitlines()[-1])
    assert made["linear_layers"] == 3 and made["params"] > 0
    llm = LLM(made["target"], draft=made["drafter"], spec="ddtree", budget=4, topk=2, device="cpu", dtype="float32",
              num_pages=64)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_random_targets_follow_their_config(tmp_path):
    # gpu_sanity's model: the default target's widths, six layers, weights N(0, 0.08), biases N(0, 0.02)
    from safetensors.torch import load_file

    from ddtree.bench.random_model import num_parameters, qwen2_config, save_random_drafter, save_random_target
    from ddtree.config import ModelConfig
    cfg = qwen2_config(vocab_size=384, intermediate_size=256, num_hidden_layers=2, tie_word_embeddings=False)
    target = save_random_target(cfg, str(tmp_path / "t"), "float32", std=0.08, bias_std=0.02, sharpen=2.0)
    w = load_file(str(tmp_path / "t" / "model.safetensors"))
    mc = ModelConfig.from_dir(target)
    assert (mc.hidden_size, mc.num_layers, mc.vocab_size) == (896, 2, 384)
    assert abs(w["model.layers.0.mlp.up_proj.weight"].std().item() - 0.08) < 0.005
    assert abs(w["lm_head.weight"].std().item() - 0.16) < 0.01  # (sharpened)
    assert abs(w["model.layers.0.self_attn.q_proj.bias"].std().item() - 0.02) < 0.005
    assert (w["model.norm.weight"] == 1).all()
    assert num_parameters(target) == sum(t.numel() for t in w.values())
    drafter = save_random_drafter(target, str(tmp_path / "d"), [0, 1], block=4, dtype="float32")
    with open(os.path.join(drafter, "config.json")) as f:
        assert json.load(f)["block_size"] == 4


def test_the_tree_and_attention_kernels_compile_for_hopper(tmp_path):
    # The interpreter runs the kernels' semantics on the CPU; this builds the real thing through Triton's
    # sm_90 compiler and the ptxas that triton ships, read back with cuobjdump (benchmarks/
    # kernel_resources.py, in a process without the interpreter): the tree kernel at each split the
    # autotuner may pick (33-node trees), the default target's attention at each step's tiles and warps.
    from ddtree.ops.triton_gdn import TREE_SPLITS
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    tool = os.path.join(ROOT, "benchmarks", "kernel_resources.py")
    for kernel in ("tree", "attention"):
        subprocess.run([sys.executable, tool, str(tmp_path / f"{kernel}.json"), "--kernel", kernel],
                       env=env, check=True, capture_output=True, timeout=600)
    tree = json.loads((tmp_path / "tree.json").read_text())
    assert sorted((r["block_v"], r["warps"]) for r in tree) == sorted(
        (c.kwargs["BLOCK_V"], c.num_warps) for c in TREE_SPLITS)
    attention = json.loads((tmp_path / "attention.json").read_text())
    assert {r["step"] for r in attention if r["chosen"]} == {"ar", "draft16", "verify33", "prefill"}
    for row in tree + attention:
        assert 0 < row["registers"] <= 255 and row["mma"] > 0 and row["instructions"] > row["mma"], row


def test_the_tensor_parallel_check_compares_each_size_and_mode_prompt_by_prompt(tmp_path, tiny_qwen2):
    # tp_gpu.py --check, the multi-GPU run's correctness half, over 2 gloo ranks on the CPU: HumanEval
    # prompts, AR and DDTree at 1 and 2 ranks, every output equal (float32).
    from ddtree.config import ModelConfig
    from ddtree.models.dflash import random_drafter, save_drafter
    cfg = ModelConfig.from_dir(tiny_qwen2)
    drafter = str(tmp_path / "drafter")
    save_drafter(random_drafter(cfg, num_layers=1, block_size=8, target_layer_ids=[0, cfg.num_layers - 1]), drafter)
    spec = importlib.util.spec_from_file_location("bench_tp_gpu", os.path.join(ROOT, "benchmarks", "tp_gpu.py"))
    tp_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp_gpu)
    out = tp_gpu.check_run(tiny_qwen2, drafter, [1, 2], 2, 8, "float32", device="cpu")
    assert len(out["tokens"]) == 4 and all(len(t) == 2 and all(len(x) == 8 for x in t) for t in out["tokens"].values())
    for key in ("tp1_ddtree_vs_ar", "tp2_ddtree_vs_ar", "tp2_vs_tp1_ar", "tp2_vs_tp1_ddtree"):
        assert out[key] == {"equal": 2, "of": 2, "first_difference": {}}, key
