#!/usr/bin/env bash
# The GPU measurements of the default pair, in device calls of < 10 minutes each (machine set-up:
# benchmarks/README.md; `source benchmarks/gpu_setup.sh` first). Everything goes to $OUT.
#
#   bash benchmarks/h200_suite.sh tune      # few-row product block sizes; GPU sanity (fp32); no model needed
#   bash benchmarks/h200_suite.sh latency   # bench latency at C=1 with step times and peers
#   bash benchmarks/h200_suite.sh low       # DDTree/DFlash vs AR on all HumanEval prompts; sweep at C=1,2,4
#   bash benchmarks/h200_suite.sh high      # sweep at C=8..128
#   bash benchmarks/h200_suite.sh auto      # auto vs AR, DFlash and DDTree 8/16/32 (topk 4) at C=1..128;
#   bash benchmarks/h200_suite.sh auto 1,2,4,8      # ... or at the concurrencies given
#   bash benchmarks/h200_suite.sh grid      # both halves in one call: C=1-8 once (LOW_REPEATS), C=16-128
#                                           # the median of REPEATS (5), the modes interleaved run by run
#   CONTINUOUS=1 bash benchmarks/h200_suite.sh grid   # ... every prompt queued, at most C running (not
#                                           # batches run to completion); rows to sweep_auto_continuous_h200.jsonl
#                                           # (TRACE=1: and auto's plans, one JSON line each)
#                                           # (TEMPERATURE=0.7: seeded sampled requests, the same draws in every mode)
#   bash benchmarks/h200_suite.sh autocheck 1,32,64,128   # AR and auto only, continuous, one run each
#   bash benchmarks/h200_suite.sh checks    # greedy DDTree and DFlash vs AR on HumanEval in float32
set -u
cli=(python3 -m ddtree.cli)
sweep=("${cli[@]}" bench sweep --dataset mtbench --num-prompts 80 --max-tokens 128 --budget 8,16,32 --topk 4
       --with-auto --repeats 1 --out "$OUT/sweep_h200.jsonl")
trace() {  # NAME CMD...: CMD with auto's plans traced to $OUT/policy_trace_NAME.jsonl where TRACE=1
  local name=$1; shift
  if [ "${TRACE:-0}" = 1 ]; then local TRACE_ARGS=(--policy-trace "$OUT/policy_trace_$name.jsonl"); "$@"; else "$@"; fi
}
auto_sweep() {  # REPEATS CONCURRENCIES: auto vs AR, DFlash and DDTree 8/16/32 (topk 4), rows appended
  local warm=(--warmup-pass) out=sweep_auto_h200.jsonl cont=(); [ "${WARMUP:-1}" = 0 ] && warm=()
  [ "${CONTINUOUS:-0}" = 1 ] && cont=(--continuous) && out=sweep_auto_continuous_h200.jsonl
  [ "${INTERLEAVE:-1}" = 1 ] && cont+=(--interleave)  # (INTERLEAVE=0: each mode's runs back to back)
  "${cli[@]}" bench sweep --dataset mtbench --num-prompts 80 --max-tokens 128 --budget 8,16,32 --topk 4 \
    --with-auto --repeats "$1" --concurrency "$2" --num-pages 16384 "${warm[@]}" "${cont[@]}" \
    ${TEMPERATURE:+--temperature "$TEMPERATURE"} \
    ${TRACE_ARGS[@]+"${TRACE_ARGS[@]}"} --out "$OUT/$out"
}
case $1 in
  tune)
    python3 benchmarks/linear_tune.py "$OUT/linear_tune.jsonl" > "$OUT/linear_tune.log" 2>&1
    timeout 240 python3 benchmarks/gpu_sanity.py float32 > "$OUT/sanity.log" 2>&1 ;;
  latency)
    "${cli[@]}" bench latency --dataset humaneval --num-prompts 40 --concurrency 1 --budget 32,auto --topk 4 \
      --repeats 1 --step-times --peers --peer-prompts 4 --out "$OUT/latency_h200.jsonl" > "$OUT/latency.log" 2>&1 ;;
  low)
    python3 benchmarks/gpu_checks.py --draft ddtree/models/default_drafter --out "$OUT/gpu_checks_h200.jsonl" \
      > "$OUT/checks.log" 2>&1
    "${sweep[@]}" --concurrency 1,2,4 > "$OUT/sweep_low.log" 2>&1 ;;
  high)
    "${sweep[@]}" --concurrency 8,16,32,64,128 > "$OUT/sweep_high.log" 2>&1 ;;
  auto)  # WARMUP=0: without the untimed AR pass over every batch first; REPEATS=3: the median of three runs a row
    auto_sweep "${REPEATS:-1}" "${2:-1,2,4,8,16,32,64,128}" > "$OUT/sweep_auto.log" 2>&1 ;;
  grid)  # TRACE=1: auto's plans, one JSON line each, to $OUT/policy_trace_low.jsonl and _high.jsonl
    { trace low auto_sweep "${LOW_REPEATS:-1}" 1,2,4,8 && trace high auto_sweep "${REPEATS:-5}" 16,32,64,128; } \
      > "$OUT/sweep_auto.log" 2>&1 ;;
  autocheck)
    "${cli[@]}" bench sweep --dataset mtbench --num-prompts 80 --max-tokens 128 --budget '' --topk 4 --auto-topk 4 \
      --no-dflash --with-auto --repeats 1 --concurrency "${2:-1,32,64,128}" --num-pages 16384 --warmup-pass \
      --continuous --out "$OUT/sweep_check.jsonl" > "$OUT/sweep_check.log" 2>&1 ;;
  checks)  # float32: every kernel rounds alike, so a divergence is a real near-tie or a bug
    python3 benchmarks/gpu_checks.py --draft ddtree/models/default_drafter --dtype float32 \
      --skip kernels,transformers --out "$OUT/gpu_checks_fp32.jsonl" > "$OUT/checks_fp32.log" 2>&1 ;;
  *)
    echo "usage: bash benchmarks/h200_suite.sh tune|latency|low|high|auto [C,...]|grid|autocheck [C,...]|checks" >&2
    exit 2 ;;
esac
