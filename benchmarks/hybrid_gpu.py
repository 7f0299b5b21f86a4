"""The GPU checks of hybrid targets: a random Qwen3.5 text model with a published config's shapes
(`ddtree.bench.random_model.hybrid_pair` builds it), since no hybrid weights can be downloaded here.

    python benchmarks/hybrid_gpu.py benchmarks/configs/qwen3.5-0.8b.json OUT.json [--prompts 32 --max-tokens 128]

1. bfloat16, greedy: AR with CUDA graphs against eager AR on 8 prompts; AR throughput at C=1 and 16.
2. bfloat16 step times with 512 cached tokens (CUDA graphs): an AR step and a verify of 17, 33 and
   65 nodes, at C=1 and 8.
3. float32 with a sharpened LM head: DDTree (budget 32, top-4) and DFlash against AR on `--prompts`
   prompts, greedy and seeded sampled (T=0.7). The drafter is an oracle planted in the eager
   speculative path: AR's recorded continuation at rank 0 with two wrong siblings under it at every
   depth ("siblings": whole blocks accepted, so the deepest nodes are verified), or the right token
   at rank 0, 1, 2 or missing ("noisy": accepts along side branches). Then the graphed DDTree path
   and budget auto (graphed AR bursts that read out the drafter's context) with the random drafter
   (acceptance near 1) against the same AR outputs.
   Before those (`hf`), float32 greedy output against transformers' on the same GPU (4 prompts).
4. flash-linear-attention's chunked delta rule, if importable, against ours (models/hybrid.py) on
   variable-length prompts with initial states: agreement and time.
5. `profile`: kernel time by name over replays of an AR step, a draft, a whole speculative step and a
   verify of 33 nodes at C=1, each step alone.
   `steps`: part 2's step times alone.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from ddtree import LLM, SamplingParams
from ddtree.bench.random_model import hybrid_pair

# (rank of the right token by position, None: not proposed; logit step between ranks)
SIBLINGS = ([0], 4.0)  # the right token always first, clearly: the tree holds the whole spine
NOISY = ([0, 0, 0, 1, 1, 2, None], 0.5)  # close calls: the tree spreads over the siblings


def plant_oracle(llm: LLM, ref: dict[tuple, list[int]], ranks: list, step: float) -> None:
    """The eager drafter proposes, for each position, the token of `ref` (prompt -> prompt + AR's
    output) at the rank `ranks` gives that position, under or among two wrong tokens, `step` logits
    apart."""
    spec = llm.engine.speculator
    assert spec.graphs is None, "the oracle replaces the eager drafter's logits"
    dr, current = spec.drafter, []
    real_prepare, real_logits = dr.prepare, dr.logits
    vocab = llm.config.vocab_size

    def prepare(seqs, *args, **kw):
        current[:] = seqs
        return real_prepare(seqs, *args, **kw)

    def logits(inp):
        out = real_logits(inp)
        where, values = [], []  # (request, position, token) and its logit, written on the device at once
        for i, seq in enumerate(current):
            full = ref[tuple(seq.prompt_ids)]
            for j in range(out.shape[1]):
                pos = len(seq) + j
                tok = full[pos] if pos < len(full) else 0
                rank = ranks[(5 * pos + 3) % len(ranks)]
                decoys = [(tok + d) % vocab for d in (1, 2, 3)]
                order = decoys[:2] if rank is None else decoys[:rank] + [tok] + decoys[rank:2]
                for r, t in enumerate(order):
                    where.append((i, j, t))
                    values.append(10.0 - step * r)
        planted = torch.full(out.shape, -30.0, dtype=out.dtype, device=out.device)
        index = torch.tensor(where, device=out.device).T
        planted[index[0], index[1], index[2]] = torch.tensor(values, dtype=out.dtype, device=out.device)
        return planted

    dr.prepare, dr.logits = prepare, logits


def mean(xs: list) -> float | None:
    return round(sum(xs) / len(xs), 3) if xs else None


def compare(got, want) -> dict:
    accepts = [n for o in got for n in o.accept_lengths]
    return {"equal": sum(a.token_ids == b.token_ids for a, b in zip(got, want)), "of": len(want),
            "mean_accept": mean(accepts), "max_accept": max(accepts, default=None), "verify_steps": len(accepts)}


def bf16_runs(target: str, drafter: str, vocab: int, out: dict) -> None:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (37, 5, 120, 64, 9, 200, 17, 80)]
    p = SamplingParams(max_tokens=48, ignore_eos=True)
    eager = LLM(target, dtype="bfloat16", cuda_graphs=False, num_pages=2048, max_num_seqs=16).generate(prompts, p)
    llm = LLM(target, dtype="bfloat16", num_pages=2048, max_num_seqs=16)
    graphed = llm.generate(prompts, p)
    out["bf16_graphed_equal_eager"] = [a.token_ids == b.token_ids for a, b in zip(eager, graphed)]
    out["bf16_first_difference"] = [next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
                                    for a, b in zip(eager, graphed)]
    del llm
    for C in (1, 16):
        llm = LLM(target, dtype="bfloat16", num_pages=8192, max_num_seqs=C)
        ps = [torch.randint(0, vocab, (64,), generator=g).tolist() for _ in range(C)]
        q = SamplingParams(max_tokens=128, ignore_eos=True)
        llm.generate(ps, q)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(ps, q)
        torch.cuda.synchronize()
        out[f"bf16_ar_C{C}_tok_s"] = round(C * 128 / (time.perf_counter() - t0), 1)
        out[f"bf16_ar_C{C}_stats"] = llm.last_stats.get("bursts")
        del llm
    from ddtree.bench.steps import step_times
    llm = LLM(target, draft=drafter, spec="ddtree", budget=32, topk=4, dtype="bfloat16", num_pages=8192, max_num_seqs=8)
    out["bf16_step_times"] = step_times(llm, [1, 8], [17, 33, 65], context=512)
    for row in out["bf16_step_times"]:
        row["verify_33_over_ar"] = round(row["verify_33_ms"] / row["ar_step_ms"], 3)
    print(json.dumps(out["bf16_step_times"]), flush=True)
    del llm
    torch.cuda.empty_cache()


def profile(target: str, drafter: str, out: dict) -> None:
    """Kernel time by name over replays of each step `step_times` measures at C=1 and 512 cached tokens
    (bfloat16, CUDA graphs), each step alone: where an AR step's and a 33-node verify's time goes."""
    from ddtree.bench.steps import step_profiles
    llm = LLM(target, draft=drafter, spec="ddtree", budget=32, topk=4, dtype="bfloat16", num_pages=2048, max_num_seqs=1)
    out["profile_C1"] = step_profiles(llm, 1, [33], context=512)
    for name, table in out["profile_C1"].items():
        print(name, table, sep="\n", flush=True)
    del llm
    torch.cuda.empty_cache()


def hf_check(target: str, vocab: int, out: dict) -> None:
    """float32 greedy output of ddtree (flash-linear-attention prompts if installed, Triton decode steps,
    CUDA graphs) against transformers' on the same GPU: 4 prompts, 32 tokens."""
    from transformers import AutoModelForCausalLM
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in (7, 64, 150, 300)]
    got = LLM(target, dtype="float32", num_pages=1024, max_num_seqs=4).generate(
        prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).cuda().eval()
    rows = []
    for p, o in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, min_new_tokens=32,
                               do_sample=False)[0, len(p):].tolist()
        rows.append(want == o.token_ids)
    out["fp32_equal_transformers"] = rows
    print("transformers", rows, flush=True)
    del hf
    torch.cuda.empty_cache()


def fp32_runs(target: str, drafter: str, vocab: int, n: int, max_tokens: int, out: dict,
              modes: tuple[str, ...] = ("greedy", "sampled")) -> None:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (int(k),), generator=g).tolist()
               for k in torch.randint(4, 300, (n,), generator=g)]
    kw = dict(dtype="float32", num_pages=4096, max_num_seqs=n)
    ar_llm = LLM(target, **kw)
    for mode, extra in (("greedy", {}), ("sampled", dict(temperature=0.7))):
        if mode not in modes:
            continue
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, **({**extra, "seed": i} if extra else {}))
                  for i in range(n)]
        ar = ar_llm.generate(prompts, params)
        ref = {tuple(p): list(p) + o.token_ids for p, o in zip(prompts, ar)}
        for spec, budget, topk in (("ddtree", 32, 4), ("dflash", None, None)):
            for name, (ranks, step) in (("siblings", SIBLINGS), ("noisy", NOISY)):
                llm = LLM(target, draft=drafter, spec=spec, budget=budget, topk=topk, cuda_graphs=False, **kw)
                plant_oracle(llm, ref, ranks, step)
                row = compare(llm.generate(prompts, params), ar)
                out[f"fp32_{mode}_{spec}_{name}"] = row
                print(mode, spec, name, json.dumps(row), flush=True)
                del llm
        if not torch.cuda.is_available():
            continue
        llm = LLM(target, draft=drafter, spec="ddtree", budget=32, topk=4, **kw)
        assert llm.engine.speculator.graphs is not None
        out[f"fp32_{mode}_ddtree_graphed_random_drafter"] = compare(llm.generate(prompts, params), ar)
        del llm
        llm = LLM(target, draft=drafter, spec="ddtree", budget="auto", topk=4, **kw)  # graphed AR bursts that read out
        out[f"fp32_{mode}_auto_graphed_random_drafter"] = compare(llm.generate(prompts, params), ar)
        out[f"fp32_{mode}_auto_bursts"] = llm.last_stats.get("bursts")
        print(mode, "auto", json.dumps(out[f"fp32_{mode}_auto_graphed_random_drafter"]), flush=True)
        del llm
    torch.cuda.empty_cache()


def fla_probe(out: dict) -> None:
    """fla's chunk_gated_delta_rule against ours, 16 variable-length prompts (16 heads, K = V = 128),
    each from a random initial state: outputs and final states in float32, and time per call."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 (reported, not raised: the probe is optional)
        out["fla"] = f"not importable: {e!r}"
        return
    from ddtree.models.delta_rule import chunked_delta_rule, l2_normalize
    dev, H, K = "cuda", 16, 128
    g = torch.Generator(device=dev).manual_seed(3)
    lens = [64, 500, 17, 200, 1, 333, 64, 128, 90, 256, 7, 400, 65, 31, 150, 99]
    T = sum(lens)
    q, k = (torch.randn(T, H, K, device=dev, generator=g) for _ in range(2))
    v = torch.randn(T, H, K, device=dev, generator=g)
    decay = -torch.rand(T, H, device=dev, generator=g) * 0.5
    beta = torch.rand(T, H, device=dev, generator=g)
    s0 = torch.randn(len(lens), H, K, K, device=dev, generator=g) * 0.1
    cu = torch.tensor([0] + lens, device=dev).cumsum(0)

    def ours():
        outs, states = [], []
        for i, n in enumerate(lens):
            s = slice(int(cu[i]), int(cu[i + 1]))
            o, st = chunked_delta_rule(q[s], k[s], v[s], decay[s], beta[s], s0[i])
            outs.append(o)
            states.append(st)
        return torch.cat(outs), torch.stack(states)

    def theirs(dtype):
        qn = (l2_normalize(q) / K ** 0.5).to(dtype)[None]
        o, st = chunk_gated_delta_rule(qn, l2_normalize(k).to(dtype)[None], v.to(dtype)[None], decay[None],
                                       beta.to(dtype)[None], scale=1.0, initial_state=s0.clone(),
                                       output_final_state=True, cu_seqlens=cu)
        return o[0].float(), st.float()

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return round((time.perf_counter() - t0) / 5 * 1e3, 3)

    o_ref, s_ref = ours()
    res = {"tokens": T, "ours_ms": timed(ours)}
    for dtype in (torch.float32, torch.bfloat16):
        try:
            o, st = theirs(dtype)
            res[str(dtype)] = {"out_max_err": float((o - o_ref).abs().max()), "state_max_err": float((st - s_ref).abs().max()),
                               "out_scale": float(o_ref.abs().max()), "ms": timed(lambda: theirs(dtype))}
        except Exception as e:  # noqa: BLE001
            res[str(dtype)] = f"failed: {e!r}"
    out["fla"] = res
    print("fla", json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--sharpen", type=float, default=8.0)
    ap.add_argument("--parts", default="fla,bf16,hf,fp32")
    ap.add_argument("--concurrency", default="1,8", help="steps: the batch sizes")
    ap.add_argument("--widths", default="17,33,65", help="steps: the verify widths (33 gives verify_33_over_ar)")
    ap.add_argument("--modes", default="greedy,sampled", help="fp32: the oracle runs' modes (greedy, sampled)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    out = {"config": args.config, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    work = tempfile.mkdtemp()

    def save():  # after each part: a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    def part(name, fn):  # a part that fails is reported, and the others still run
        if name not in parts:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            out[f"{name}_error"] = repr(e)
        save()

    def steps():  # the step times alone
        built = hybrid_pair(args.config, os.path.join(work, "bf16"), "bfloat16")
        sizes = [int(c) for c in args.concurrency.split(",")]
        llm = LLM(built["target"], draft=built["drafter"], spec="ddtree", budget=32, topk=4, dtype="bfloat16",
                  num_pages=8192, max_num_seqs=max(sizes))  # (slots and graphs up to the largest size)
        from ddtree.bench.steps import step_times
        out["bf16_step_times"] = step_times(llm, sizes,
                                            [int(w) for w in args.widths.split(",")], context=512)
        for row in out["bf16_step_times"]:
            if "verify_33_ms" in row:
                row["verify_33_over_ar"] = round(row["verify_33_ms"] / row["ar_step_ms"], 3)
        from ddtree.ops import triton_gdn  # the tree kernel's split chosen per (N, batch key)
        out["tree_splits"] = {str(k): str(v) for k, v in getattr(triton_gdn._tree_delta, "cache", {}).items()}
        print(json.dumps(out["bf16_step_times"]), flush=True)

    def bf16():
        built = hybrid_pair(args.config, os.path.join(work, "bf16"), "bfloat16")
        out["model"] = {k: built[k] for k in ("layers", "linear_layers", "params")}
        vocab = json.load(open(os.path.join(built["target"], "config.json")))["vocab_size"]
        bf16_runs(built["target"], built["drafter"], vocab, out)

    def profiled():
        built = hybrid_pair(args.config, os.path.join(work, "bf16"), "bfloat16")
        profile(built["target"], built["drafter"], out)

    def fp32():
        built = hybrid_pair(args.config, os.path.join(work, "fp32"), "float32", sharpen=args.sharpen)
        vocab = json.load(open(os.path.join(built["target"], "config.json")))["vocab_size"]
        if "hf" in parts:
            hf_check(built["target"], vocab, out)
            save()
        fp32_runs(built["target"], built["drafter"], vocab, args.prompts, args.max_tokens, out,
                  tuple(args.modes.split(",")))

    part("fla", lambda: fla_probe(out))
    part("steps", steps)
    part("profile", profiled)
    part("bf16", bf16)
    part("fp32", fp32)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
