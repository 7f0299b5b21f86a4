# A random hybrid (Qwen3.5 text, 0.65B-like shapes: hidden 1024, 20 layers at 3 linear : 1 full, 8 heads of 256,
# linear 16 x 128 key and value heads) on the GPU: AR with CUDA graphs vs eager (fp32, greedy), then bf16 AR speed.
import json, os, time, torch
from transformers import Qwen3_5TextConfig, AutoModelForCausalLM
from ddtree import LLM, SamplingParams
out = {}
cfg = Qwen3_5TextConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=20,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=True, eos_token_id=None)
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
with torch.no_grad():
    for n, p in m.named_parameters():
        if p.dim() == 2: p.normal_(0, 0.05)
m.save_pretrained("/tmp/hy", safe_serialization=True); del m
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 32000, (n,), generator=g).tolist() for n in (37, 5, 120, 64, 9, 200, 17, 80)]
p = SamplingParams(max_tokens=48, ignore_eos=True)
eager = LLM("/tmp/hy", dtype="bfloat16", cuda_graphs=False, num_pages=2048, max_num_seqs=16).generate(prompts, p)
llm = LLM("/tmp/hy", dtype="bfloat16", num_pages=2048, max_num_seqs=16)
graphed = llm.generate(prompts, p)
out["bf16_graphs_equal_eager"] = [a.token_ids == b.token_ids for a, b in zip(eager, graphed)]
out["bf16_bursts"] = llm.last_stats.get("bursts")
del llm; torch.cuda.empty_cache()
for C in (1, 16):
    llm = LLM("/tmp/hy", dtype="bfloat16", num_pages=8192, max_num_seqs=max(C, 1))
    ps = [torch.randint(0, 32000, (64,), generator=g).tolist() for _ in range(C)]
    q = SamplingParams(max_tokens=128, ignore_eos=True)
    llm.generate(ps, q)
    torch.cuda.synchronize(); t0 = time.perf_counter(); llm.generate(ps, q); torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out[f"bf16_C{C}_tok_s"] = round(C * 128 / dt, 1)
    out[f"bf16_C{C}_bursts"] = llm.last_stats.get("bursts")
    del llm; torch.cuda.empty_cache()
print(json.dumps(out, indent=1))
json.dump(out, open(os.environ["OUT"] + "/hybrid_gpu.json", "w"), indent=1)
