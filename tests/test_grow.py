"""Growing a drafter (ddtree/train/grow.py): more layers and a wider MLP, the same function."""
import json
import os

import pytest
import torch

from ddtree.config import ModelConfig
from ddtree.models.dflash import load_drafter, random_drafter, save_drafter
from ddtree.models.loader import load_model
from ddtree.train.blocks import draft_logits
from ddtree.train.grow import grow_drafter, layer_places
from tiny import make_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("target")), "qwen3", with_tokenizer=False,
                           num_hidden_layers=4)


def test_old_layers_spread_evenly_among_the_new():
    assert layer_places(2, 4) == [0, 2]
    assert layer_places(2, 3) == [0, 1]
    assert layer_places(3, 3) == [0, 1, 2]


def test_a_grown_drafter_drafts_exactly_what_it_grew_from(target):
    net, cfg = load_model(target, "cpu", torch.float32)
    small = random_drafter(cfg, num_layers=2, block_size=4, target_layer_ids=[0, 2], intermediate_size=24, std=0.2)
    big = grow_drafter(small, 4, 40)
    assert len(big.layers) == 4 and big.dcfg.model.intermediate_size == 40
    assert big.dcfg.raw["num_hidden_layers"] == 4 and big.dcfg.raw["intermediate_size"] == 40
    assert sum(p.numel() for p in big.parameters()) > 1.8 * sum(p.numel() for p in small.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=g)
    feats = torch.randn(2, 20, 2 * cfg.hidden_size, generator=g)
    anchors, ctx_len = torch.tensor([[3, 7, 15], [5, 9, -1]]), torch.tensor([20, 12])
    with torch.no_grad():
        want = draft_logits(small, net, ids, feats, ctx_len, anchors)
        got = draft_logits(big, net, ids, feats, ctx_len, anchors)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # ... and its new weights are not all zero: the added layers can learn
    assert big.layers[1].self_attn.qkv_proj.weight.abs().sum() > 0
    assert big.layers[1].self_attn.o_proj.weight.abs().sum() == 0


def test_a_drafter_only_grows(target):
    _, cfg = load_model(target, "cpu", torch.float32)
    d = random_drafter(cfg, num_layers=2, block_size=4, target_layer_ids=[0, 2], intermediate_size=24)
    with pytest.raises(ValueError, match="grows only"):
        grow_drafter(d, 1, 24)
    with pytest.raises(ValueError, match="grows only"):
        grow_drafter(d, 2, 16)


def test_cli_grow_trains_the_grown_shape_from_the_init(tmp_path):
    from ddtree.cli import main
    target = make_tiny_model(str(tmp_path / "t"), "qwen3", num_hidden_layers=4)
    cfg = ModelConfig.from_dir(target)
    init = str(tmp_path / "init")
    save_drafter(random_drafter(cfg, num_layers=1, block_size=4, target_layer_ids=[0, 2], intermediate_size=24), init)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nWrite a loop\n")
    common = ["train-drafter", "--target", target, "--prompt-file", str(prompts), "--max-new-tokens", "8",
              "--batch-size", "2", "--steps", "2", "--device", "cpu", "--dtype", "float32", "--init", init]
    out = str(tmp_path / "out")
    assert main([*common, "--out", out, "--grow", "--num-layers", "3", "--intermediate-size", "32"]) == 0
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    assert raw["num_hidden_layers"] == 3 and raw["intermediate_size"] == 32 and raw["block_size"] == 4
    assert len(load_drafter(out, cfg, "cpu", torch.float32).layers) == 3
    assert main([*common[:-2], "--out", str(tmp_path / "x"), "--grow", "--num-layers", "3"]) == 2  # no --init
