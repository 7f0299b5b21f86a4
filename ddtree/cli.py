"""Command line: `ddtree generate "prompt"`, `ddtree serve`, `ddtree pull`, `ddtree bench latency|sweep|serve|report`
and `ddtree train-drafter`."""
from __future__ import annotations

import argparse
import os
import sys
import time


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint dir or .gguf file (default: the default model)")
    p.add_argument("--draft", default=None, help="DFlash drafter checkpoint dir (z-lab format; default model: the shipped drafter)")
    p.add_argument("--spec", choices=["none", "dflash", "ddtree"], default=None, help="speculative decoding mode")
    p.add_argument("--budget", default=None, help="DDTree node budget, or auto: chosen each step from measured costs")
    p.add_argument("--topk", type=int, default=None, help="DDTree per-depth top-k cap")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on GPU, fp32 on CPU)")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                   help="split the model over this many ranks, one process (GPU) each (default: 1)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts the ranks span (the same number on each)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this host's place: 0 runs the engine (and the server), others run their ranks only")
    p.add_argument("--dist-init-addr", default=None,
                   help="HOST:PORT where the ranks meet (several hosts: node 0's; default: a free local port)")
    p.add_argument("--dist-timeout", type=float, default=60.0,
                   help="seconds a step waits for a rank before failing (a hung or lost worker)")


def parallel_from_args(args):
    from ddtree.config import ParallelConfig
    return ParallelConfig(args.tensor_parallel_size, args.nnodes, args.node_rank, args.dist_init_addr, args.dist_timeout)


def run_other_node(args) -> int:
    """A node other than node 0 of a multi-host run: its ranks' workers, until rank 0 stops them."""
    from ddtree.config import default_device, parse_dtype
    from ddtree.models.hub import resolve_model
    from ddtree.parallel.workers import serve_node
    device = args.device or default_device()
    pcfg = parallel_from_args(args)
    print(f"[node {pcfg.node_rank}: ranks {pcfg.node_rank * pcfg.ranks_per_node} .. "
          f"{(pcfg.node_rank + 1) * pcfg.ranks_per_node - 1} of {pcfg.tensor_parallel_size}, "
          f"meeting at {pcfg.dist_init_addr}]", file=sys.stderr, flush=True)
    serve_node(pcfg, resolve_model(args.model), device.split(":")[0], parse_dtype(args.dtype, device))
    return 0


def add_prefix_cache_arg(p: argparse.ArgumentParser, default: bool = True) -> None:
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=default,
                   help="reuse the K/V (hybrids: and recurrent state) of prompt prefixes seen before, by full pages")
    p.add_argument("--prefix-state-snapshots", type=int, default=None,
                   help="hybrid targets: recurrent states the prefix cache keeps (default: --max-num-seqs)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """A benchmark's sampling settings (every request alike)."""
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0,
                   help="sampled runs: request j of a batch draws with seed SEED + j, the same tokens in every mode and "
                        "run (-1: unseeded, random)")


def check_mode_args(args) -> None:
    """One-line errors for model options that contradict each other."""
    if args.spec in ("dflash", "ddtree") and args.budget is not None and args.budget.strip() == "0":
        raise ValueError(f"--budget 0 with --spec {args.spec} is plain AR: use --spec none, or a positive budget "
                         "or auto")


def llm_from_args(args):
    from ddtree import LLM
    check_mode_args(args)
    t0 = time.perf_counter()
    print(f"[loading {args.model or 'the default model'} ...]", file=sys.stderr, flush=True)
    llm = LLM(args.model, draft=args.draft, spec=args.spec, budget=args.budget, topk=args.topk,
              device=args.device, dtype=args.dtype, parallel=parallel_from_args(args),
              enable_prefix_caching=args.enable_prefix_caching, prefix_state_snapshots=args.prefix_state_snapshots)
    mode = llm.spec if llm.spec == "none" else f"{llm.spec} budget {llm.budget} topk {llm.topk}"
    print(f"[loaded in {time.perf_counter() - t0:.1f} s: {llm.device.type}, spec {mode}]", file=sys.stderr, flush=True)
    return llm


def cmd_generate(args) -> int:
    from ddtree import SamplingParams
    if parallel_from_args(args).node_rank > 0:
        return run_other_node(args)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = llm_from_args(args)
    prompts = args.prompt or ["Write a Python function that checks whether a number is prime."]
    convs = prompts if args.raw else [[{"role": "user", "content": p}] for p in prompts]
    if len(prompts) == 1:  # streamed as it is generated
        for piece in llm.stream(convs[0], params):
            print(piece, end="", flush=True)
        print("\n")
    else:  # one batch, printed at the end
        outs = llm.generate(prompts, params) if args.raw else llm.chat(convs, params)
        for prompt, out in zip(prompts, outs):
            print(f"### {prompt}")
            print(out.text)
            print()
    s = llm.last_stats
    mode = llm.spec if llm.spec == "none" else f"{llm.spec} budget {llm.budget} topk {llm.topk}"
    print(f"[{s['generated_tokens']} tokens in {s['elapsed_s']:.2f} s: {s['tokens_per_s']:.1f} tok/s, "
          f"batch {len(prompts)}, {llm.device.type}, spec {mode}, "
          f"finish: {', '.join(map(str, s['finish_reasons']))}]", file=sys.stderr)
    if s["mean_accept_length"] is not None:
        st = llm.engine.speculator.stats
        rates = ", ".join(f"{n / st.steps:.2f}" for n in st.depth_accepted[:16])
        print(f"[mean acceptance length {s['mean_accept_length']:.2f} tokens per verify step; "
              f"acceptance rate by depth: {rates}]", file=sys.stderr)
    return 0


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def cmd_bench_latency(args) -> int:
    from ddtree.bench.latency import main as latency
    return latency(args)


def cmd_bench_acceptance(args) -> int:
    from ddtree.bench.acceptance import main as acceptance
    return acceptance(args)


def cmd_bench_sweep(args) -> int:
    from ddtree.bench.sweep import main as sweep
    return sweep(args)


def cmd_bench_serve(args) -> int:
    from ddtree.bench.serve import main as serve_bench
    return serve_bench(args)


def cmd_bench_report(args) -> int:
    from ddtree.bench.report import main as report
    return report(args)


def check_serve_args(args) -> None:
    """One-line errors for serve options that cannot work, before anything loads."""
    from ddtree.models.hub import is_default_model
    check_mode_args(args)
    parallel_from_args(args)
    if args.spec not in (None, "none") and args.draft is None and not is_default_model(args.model):
        raise ValueError(f"--spec {args.spec} needs --draft (a DFlash drafter checkpoint dir; the default model "
                         "has its own)")
    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")


def cmd_serve(args) -> int:
    check_serve_args(args)
    if parallel_from_args(args).node_rank > 0:
        return run_other_node(args)
    from ddtree.server.app import serve
    return serve(args)


def cmd_train_drafter(args) -> int:
    from ddtree.train.drafter import main as train_drafter
    return train_drafter(args)


def cmd_pull(args) -> int:
    from ddtree.models.hub import pull
    print(pull())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree", description="LLM inference with DFlash and DDTree speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompt", nargs="*", help="prompt(s); each is sent as a user chat message unless --raw")
    add_model_args(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--raw", action="store_true", help="no chat template: feed the prompt text as is")
    add_prefix_cache_arg(g)
    add_parallel_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and text completions, streaming)")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    s.add_argument("--api-key", default=os.environ.get("DDTREE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $DDTREE_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None,
                   help="model name in the API (default: the model dir's name, or the default model's)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait beyond --max-num-seqs before new ones get HTTP 429")
    s.add_argument("--max-request-bytes", type=int, default=8 * 2**20,
                   help="request bodies over this many bytes get HTTP 413 before they are read (default 8 MiB)")
    s.add_argument("--docs", action="store_true",
                   help="serve the interactive /docs and /redoc pages (their scripts load from a CDN)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together")
    s.add_argument("--num-pages", type=int, default=None, help="KV cache pages (default: sized from memory)")
    s.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    add_prefix_cache_arg(s)
    add_parallel_args(s)
    s.set_defaults(func=cmd_serve)

    p = sub.add_parser("pull", help="download, verify and convert the default model")
    p.set_defaults(func=cmd_pull)

    t = sub.add_parser("train-drafter", help="train a DFlash drafter for a target (data generated by the target)")
    t.add_argument("--target", default=None, help="target HF checkpoint dir or .gguf (default: the default model)")
    t.add_argument("--out", required=True, help="output dir: drafter (z-lab format), trainer state, log, data")
    t.add_argument("--data", default=None, help="token data file (default: OUT/data.pt; generated if missing)")
    t.add_argument("--prompts", type=int, default=None,
                   help="answer only N prompts (the first N after --skip-prompts; default: all; ShareGPT: index "
                        "< 15000 either way)")
    t.add_argument("--skip-prompts", type=int, default=0,
                   help="leave out the first N prompts (answered before: pass those answers as --extra-data)")
    t.add_argument("--extra-data", action="append", default=[],
                   help="token data made earlier (.pt or packed .npz), trained on with the rest (repeatable)")
    t.add_argument("--every-turn", action="store_true",
                   help="ShareGPT: every human turn of a conversation is a prompt (default: the first)")
    t.add_argument("--prompt-file", default=None,
                   help="prompts instead of ShareGPT: JSON lines (.jsonl, .jsonl.gz) or one per line")
    t.add_argument("--gen-time-limit", type=float, default=None,
                   help="data: start no new batch of prompts after this many minutes")
    t.add_argument("--max-new-tokens", type=int, default=512, help="answer length")
    t.add_argument("--gen-temperature", type=float, default=0.0,
                   help="data: 0 answers greedily (the default); above, sampled answers (other answers to the "
                        "same prompts), each prompt i with the seed --seed * 2^32 + i")
    t.add_argument("--prompt-repeats", type=int, default=1,
                   help="data: ask each prompt this many times (sampled answers only: each a different one)")
    t.add_argument("--data-only", action="store_true", help="make the data file, then stop (no training)")
    t.add_argument("--gen-batch-size", type=int, default=256, help="prompts handed to the engine at once")
    t.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer (chat-formatted) prompts")
    t.add_argument("--max-num-seqs", type=int, default=64, help="engine: requests decoded together")
    t.add_argument("--kv-cache-gb", type=float, default=4.0, help="engine: KV cache size for data generation")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    t.add_argument("--blocks-per-seq", type=int, default=16, help="random anchors per sequence")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=float, default=0.04, help="warm-up: fraction of steps, or steps if >= 1")
    t.add_argument("--gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) at block index k")
    t.add_argument("--max-len", type=int, default=2048, help="truncate sequences to this many tokens")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--num-layers", type=int, default=1, help="drafter layers")
    t.add_argument("--num-features", type=int, default=5, help="target layers tapped (ids by the z-lab rule)")
    t.add_argument("--target-layer-ids", type=int_list, default=None, help="explicit target layer ids, e.g. 1,9,17")
    t.add_argument("--intermediate-size", type=int, default=None, help="drafter MLP width (default: the target's)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-every", type=int, default=500)
    t.add_argument("--save-dtype", default="bfloat16",
                   choices=["bfloat16", "float16", "float32", "float8_e4m3fn"],
                   help="dtype of the saved drafter weights (float8_e4m3fn: its matrices, trained with that "
                        "rounding; half the file of bfloat16)")
    t.add_argument("--grow", action="store_true",
                   help="with --init: first grow that drafter to --num-layers x --intermediate-size, computing "
                        "the same function (new layers start as identities; train/grow.py)")
    t.add_argument("--val-data", default=None,
                   help="held-out greedy answers (a data file, .pt or .npz, as --data), or prompts (a prompt file) "
                        "answered greedily at the start: their DFlash and DDTree acceptance lengths are replayed "
                        "and logged every --val-every steps")
    t.add_argument("--val-prompts", type=int, default=128, help="how many of the held-out answers or prompts")
    t.add_argument("--val-every", type=int, default=1000, help="steps between held-out replays (0: none)")
    t.add_argument("--val-max-tokens", type=int, default=256, help="held-out answer length")
    t.add_argument("--attention", choices=["sdpa", "flex"], default="sdpa",
                   help="training attention: SDPA with a dense boolean mask, or flex_attention (GPU)")
    t.add_argument("--init", default=None,
                   help="start from this drafter checkpoint's weights (z-lab format; new optimizer and schedule)")
    t.add_argument("--resume", action="store_true", help="continue from OUT/trainer_state.pt if there is one (else start fresh)")
    t.add_argument("--stop-at", type=int, default=None, help="checkpoint and stop after this step (resume later)")
    t.add_argument("--time-limit", type=float, default=None, help="checkpoint and stop after this many minutes")
    t.add_argument("--deadline", type=float, default=None, help="checkpoint and stop at this Unix time (seconds)")
    t.add_argument("--time-budget", type=float, default=None,
                   help="train for this many minutes in all (summed over --resume runs); the cosine "
                        "schedule spans this time instead of --steps")
    t.add_argument("--feature-cache-gb", type=float, default=None,
                   help="precomputed target features kept on the device, GB (the rest per batch; default: "
                        "on CUDA the free memory less 64 GB)")
    t.add_argument("--labels", choices=["target", "data"], default="target",
                   help="training labels: the target's argmax after each context (what greedy verification "
                        "accepts), or the answers' own next tokens (the same for greedy answers)")
    t.add_argument("--soft-topk", type=int, default=0,
                   help="with --labels target: also train toward the target's distribution over its K likeliest "
                        "next tokens (0: off)")
    t.add_argument("--soft-weight", type=float, default=0.5,
                   help="with --soft-topk: the soft term's share of each position's loss")
    t.add_argument("--feature-host-gb", type=float, default=0.0,
                   help="past the device cache, features kept in pinned host memory, GB (default: 0, none)")
    t.add_argument("--device", default=None)
    t.add_argument("--dtype", default=None, help="target dtype (the drafter trains in fp32)")
    t.set_defaults(func=cmd_train_drafter)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    lat = bench.add_parser("latency", help="offline decoding speed: AR vs DFlash vs DDTree (and peers)")
    lat.add_argument("--model", default=None)
    lat.add_argument("--draft", default=None, help="drafter dir (default model: the shipped drafter; other models without it: AR only)")
    lat.add_argument("--device", default=None)
    lat.add_argument("--dtype", default=None)
    lat.add_argument("--dataset", choices=["humaneval", "mtbench", "sharegpt"], default="humaneval")
    lat.add_argument("--num-prompts", type=int, default=8)
    lat.add_argument("--max-tokens", type=int, default=256)
    lat.add_argument("--concurrency", type=int_list, default=[1])
    lat.add_argument("--budget", default="16", help="DDTree budgets, e.g. 8,16,32,auto (auto: adaptive)")
    lat.add_argument("--topk", type=int_list, default=[4], help="DDTree top-k caps, e.g. 2,4")
    add_sampling_args(lat)
    lat.add_argument("--repeats", type=int, default=3)
    lat.add_argument("--num-pages", type=int, default=None)
    add_prefix_cache_arg(lat, default=False)  # (off: repeats would skip the prompts' prefill)
    lat.add_argument("--step-times", action="store_true", help="also time AR / draft / verify steps")
    lat.add_argument("--peers", action="store_true", help="also run transformers and the reference dflash")
    lat.add_argument("--peer-prompts", type=int, default=4)
    lat.add_argument("--policy-trace", default=None, help="budget auto: append one JSON line per plan to this file")
    lat.add_argument("--out", default="benchmarks/results/latency.jsonl")
    lat.set_defaults(func=cmd_bench_latency)

    acc = bench.add_parser("acceptance", help="greedy DFlash / DDTree acceptance lengths, replayed (no timing)")
    acc.add_argument("--model", default=None)
    acc.add_argument("--draft", default=None, help="drafter dir (default model: the shipped drafter)")
    acc.add_argument("--device", default=None)
    acc.add_argument("--dtype", default=None)
    acc.add_argument("--dataset", choices=["humaneval", "mtbench", "sharegpt"], default="humaneval")
    acc.add_argument("--num-prompts", type=int, default=40, help="(MT-Bench: categories taken in turn)")
    acc.add_argument("--max-tokens", type=int, default=256)
    acc.add_argument("--budget", default="16,32,64", help="DDTree budgets, e.g. 8,16,32")
    acc.add_argument("--topk", type=int_list, default=[4], help="DDTree top-k caps, e.g. 2,4")
    acc.add_argument("--out", default="benchmarks/results/acceptance.jsonl")
    acc.set_defaults(func=cmd_bench_acceptance)

    sw = bench.add_parser("sweep", help="in-process grid: DDTree budget x topk, plus DFlash and AR")
    sw.add_argument("--model", default=None)
    sw.add_argument("--draft", default=None, help="drafter dir (default model: the shipped drafter)")
    sw.add_argument("--device", default=None)
    sw.add_argument("--dtype", default=None)
    sw.add_argument("--dataset", choices=["humaneval", "mtbench", "sharegpt"], default="humaneval")
    sw.add_argument("--num-prompts", type=int, default=8, help="(MT-Bench: categories taken in turn)")
    sw.add_argument("--max-tokens", type=int, default=256)
    sw.add_argument("--ignore-eos", action="store_true", help="fixed output lengths: always max-tokens")
    sw.add_argument("--concurrency", type=int_list, default=[1])
    sw.add_argument("--budget", type=int_list, default=[4, 8, 16, 32, 64], help="DDTree budgets")
    sw.add_argument("--topk", type=int_list, default=[1, 2, 4, 8], help="DDTree top-k caps")
    add_sampling_args(sw)
    sw.add_argument("--no-ar", action="store_true", help="skip the AR rows")
    sw.add_argument("--no-dflash", action="store_true", help="skip the DFlash (linear) rows")
    sw.add_argument("--no-ddtree", action="store_true", help="skip the fixed-budget DDTree rows")
    sw.add_argument("--with-auto", action="store_true", help="add adaptive speculation rows (budget auto)")
    sw.add_argument("--auto-topk", type=int, default=None, help="top-k cap of the auto rows (default: the engine's)")
    sw.add_argument("--repeats", type=int, default=3)
    sw.add_argument("--warmup-pass", action="store_true",
                    help="before the grid, every batch of every concurrency once in AR, untimed (one-time costs "
                         "of the eager prefill's shapes then land in no mode's row, whichever runs first)")
    sw.add_argument("--continuous", action="store_true",
                    help="queue every prompt at once with at most C running (continuous batching), instead of "
                         "batches of C prompts each run to completion")
    sw.add_argument("--interleave", action="store_true",
                    help="keep every mode's engine and run the modes in turn, run by run, at each concurrency (a "
                         "drift of the machine's speed then falls on every mode alike; a KV cache per mode)")
    sw.add_argument("--num-pages", type=int, default=None)
    add_prefix_cache_arg(sw, default=False)  # (off: repeats would skip the prompts' prefill)
    sw.add_argument("--policy-trace", default=None, help="budget auto: append one JSON line per plan to this file")
    sw.add_argument("--out", default="benchmarks/results/sweep.jsonl")
    sw.set_defaults(func=cmd_bench_sweep)

    sb = bench.add_parser("serve", help="load generator against a running ddtree server: concurrency sweep")
    sb.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    sb.add_argument("--api-key", default=os.environ.get("DDTREE_API_KEY"), help="(default: $DDTREE_API_KEY)")
    sb.add_argument("--served-model", default=None, help="model name to request (default: the server's first)")
    sb.add_argument("--dataset", choices=["humaneval", "mtbench", "sharegpt"], default="humaneval")
    sb.add_argument("--num-prompts", type=int, default=64,
                    help="requests per level: max(this, concurrency), prompts repeating")
    sb.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16, 32, 64, 128])
    sb.add_argument("--max-tokens", type=int, default=256)
    sb.add_argument("--output-len", choices=["natural", "fixed"], default="natural",
                    help="fixed: always max-tokens (ignore_eos); natural: stop at end of sequence")
    sb.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    sb.add_argument("--top-p", type=float, default=1.0)
    sb.add_argument("--warmup", type=int, default=None,
                    help="unmeasured requests before each level (default: the level's concurrency)")
    sb.add_argument("--multi-turn", action="store_true",
                    help="mtbench: send each conversation's turns in order, each after the answer to the one before")
    sb.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    sb.add_argument("--out", default="benchmarks/results/serve.jsonl")
    sb.set_defaults(func=cmd_bench_serve)

    rp = bench.add_parser("report", help="plots and a Markdown report from result JSON-lines files")
    rp.add_argument("results", nargs="+", help="JSON-lines files from bench sweep / serve / latency")
    rp.add_argument("--out", default=None,
                    help="output dir for report.md and the PNGs (default: report/ beside the first results file)")
    rp.set_defaults(func=cmd_bench_report)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
