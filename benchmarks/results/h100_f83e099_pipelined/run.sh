# after 943c292 (one pipelined loop) and the 16-way k-th search: kernels, sampler times, greedy and seeded sampled DDTree vs AR; HumanEval T=0.7 C=1,16
source benchmarks/gpu_setup.sh || exit 1
D=ddtree/models/default_drafter
timeout 150 python3 benchmarks/gpu_checks.py --draft $D --num-prompts 16 --max-tokens 128 --skip transformers,dflash --budget 32 --out $OUT/gpu_checks.jsonl > $OUT/gpu_checks.log 2>&1; echo checks rc=$?
grep '^{' $OUT/gpu_checks.log | cut -c1-900
timeout 300 python3 -m ddtree.cli bench sweep --draft $D --dataset humaneval --num-prompts 40 --max-tokens 256 --concurrency 1,16 --budget 32 --topk 4 --no-dflash --interleave --num-pages 16384 --repeats 2 --temperature 0.7 --seed 0 --with-auto --out $OUT/sweep_humaneval_t07.jsonl > $OUT/sweep.log 2>&1; echo sweep rc=$?
tail -9 $OUT/sweep.log
