#!/usr/bin/env bash
# Sourced at the start of a GPU-machine run: wheels the image lacks, the default model from the
# chunks copied into /tmp/m (see ../shared/GPU.md), a ddtree cache in /tmp, and a random drafter.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DDTREE_CACHE=/tmp/ddcache
m=qwen2.5-coder-0.5b-instruct
if [ ! -s $DDTREE_CACHE/$m/model.gguf ]; then
  # (A fresh machine has no chunks: an empty model.gguf made here would stay and send pull() to PyPI.)
  if ! ls /tmp/m/$m.?? > /dev/null 2>&1; then
    echo "no model chunks in /tmp/m: a fresh machine, copy them first" >&2
    set +e
    return 1
  fi
  mkdir -p $DDTREE_CACHE/$m
  cat /tmp/m/$m.?? > $DDTREE_CACHE/$m/model.gguf
fi
python3 -c "from ddtree.models.hub import pull; print(pull())"
if [ ! -d /tmp/draft-random ]; then
  python3 -c "
from ddtree.config import ModelConfig
from ddtree.models.hub import pull
from ddtree.models.dflash import random_drafter, save_drafter
import torch
save_drafter(random_drafter(ModelConfig.from_dir(pull()), num_layers=1, block_size=16), '/tmp/draft-random', torch.bfloat16)
"
fi
set +e
