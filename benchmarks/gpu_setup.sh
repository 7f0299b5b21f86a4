#!/usr/bin/env bash
# Sourced at the start of a GPU-machine run: wheels the image lacks, the default model from the
# chunks copied into /tmp/m (see ../shared/GPU.md), a ddtree cache in /tmp, and a random drafter.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DDTREE_CACHE=/tmp/ddcache
m=qwen2.5-coder-0.5b-instruct
size=491400064  # (the GGUF's size, as ../shared/tools/gpu-prep pins it)
if [ "$(stat -c %s $DDTREE_CACHE/$m/model.gguf 2>/dev/null)" != $size ]; then
  # Only the whole set of chunks: a fresh machine has none, or just the one the working call copies;
  # a partial model.gguf left here would stay and send pull() to PyPI.
  have=$(cat /tmp/m/$m.?? 2>/dev/null | wc -c)
  if [ "$have" != $size ]; then
    echo "the model chunks in /tmp/m hold $have of $size bytes: a fresh machine? copy them first" >&2
    set +e
    return 1
  fi
  mkdir -p $DDTREE_CACHE/$m
  cat /tmp/m/$m.?? > $DDTREE_CACHE/$m/model.gguf.tmp && mv $DDTREE_CACHE/$m/model.gguf.tmp $DDTREE_CACHE/$m/model.gguf
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
