"""Triton kernels against the torch reference, run by Triton's CPU interpreter on small shapes."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from ddtree.ops.attention import make_batch, paged_attention  # noqa: E402
from ddtree.speculative.tree import build_tree  # noqa: E402

tri = pytest.importorskip("ddtree.ops.triton_attention")
triton = pytest.importorskip("triton")


def make_case(q_lens, prefix_lens, mode, H=4, Hkv=2, D=16, page=4, seed=0, splits=None):
    g = torch.Generator().manual_seed(seed)
    R = len(q_lens)
    pages_per = [-(-(p + q) // page) for p, q in zip(prefix_lens, q_lens)]
    perm = torch.randperm(sum(pages_per) + 3, generator=g).tolist()  # scattered, unsorted pages
    tables, o = [], 0
    for n in pages_per:
        tables.append(perm[o:o + n])
        o += n
    slots = (sum(pages_per) + 3) * page
    k_cache = torch.randn(slots, Hkv, D, generator=g)
    v_cache = torch.randn(slots, Hkv, D, generator=g)
    T = sum(q_lens)
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, Hkv, D, generator=g)
    v = torch.randn(T, Hkv, D, generator=g)
    masks = None
    if mode == "tree":
        masks = []
        for n in q_lens:
            lp = torch.randn(1, max(n - 1, 1), 20, generator=g).log_softmax(-1)
            t = build_tree(lp, torch.tensor([0]), n - 1, 3) if n > 1 else None
            masks.append(t.mask[0] if t is not None else torch.ones(1, 1, dtype=torch.bool))
    elif mode == "full":
        masks = [torch.ones(n, n, dtype=torch.bool) for n in q_lens]
    R = len(q_lens)
    qmax = max(q_lens)
    mask_t = None
    if masks is not None:
        mask_t = torch.zeros(R, qmax, qmax, dtype=torch.bool)
        for i, m in enumerate(masks):
            mask_t[i, :m.shape[0], :m.shape[1]] = m
    ref = make_batch(tables, list(prefix_lens), list(q_lens), mask_t, page, torch.device("cpu"))
    kern = make_batch(tables, list(prefix_lens), list(q_lens), mask_t, page, torch.device("cpu"),
                      use_triton=True, num_heads_per_kv=H // Hkv, num_kv_heads=Hkv)
    if splits is not None:
        kern.splits = splits
    return q, k, v, k_cache, v_cache, ref, kern


# The tiny deepseek_v3 target's cache (tests/tiny.py): 4 query heads over one KV head of kv_lora_rank 32 +
# qk_rope_head_dim 8 channels, a width the kernels pad to 64.
MLA_HEADS = dict(H=4, Hkv=1, D=32 + 8)


@pytest.mark.parametrize("heads", [dict(H=4, Hkv=2, D=16), MLA_HEADS], ids=["d16", "mla_d40"])
@pytest.mark.parametrize("splits", [1, 4])  # 4: keys split across programs, partials combined
@pytest.mark.parametrize("mode,q_lens,prefix_lens", [
    ("causal", [1, 1, 1], [0, 5, 130]),  # decode
    ("causal", [7, 1, 12], [0, 9, 3]),  # prefill chunks mixed with a decode
    ("tree", [8, 5], [6, 150]),  # verify
    ("full", [8, 8], [3, 100]),  # drafter block
])
def test_paged_attention_kernel_matches_reference(mode, q_lens, prefix_lens, splits, heads):
    q, k, v, kc, vc, ref, kern = make_case(q_lens, prefix_lens, mode, splits=splits, **heads)
    kc2, vc2 = kc.clone(), vc.clone()
    want = paged_attention(q, k, v, kc, vc, ref, scale=0.25)
    got = paged_attention(q, k, v, kc2, vc2, kern, scale=0.25)  # Triton store + attention
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_wide_heads_take_narrower_key_tiles_and_still_match_the_reference():
    # head_dim 256 in float32 (hybrid Qwen3.5 models) does not fit 64-key tiles in a program's shared
    # memory on the H100; the kernel takes 32 keys a tile there, and 64 wherever it always did.
    from ddtree.ops.triton_attention import choose_block_n
    assert choose_block_n(128, 256, 4) == 32 and choose_block_n(128, 256, 2) == 64
    assert choose_block_n(128, 128, 4) == choose_block_n(64, 64, 2) == 64
    q, k, v, kc, vc, ref, kern = make_case([90, 1], [20, 70], "causal", H=2, Hkv=1, D=256)  # (128-row tiles)
    assert choose_block_n(kern.block_m * 2, 256, 4) == 32
    want = paged_attention(q, k, v, kc.clone(), vc.clone(), ref, scale=0.0625)
    got = paged_attention(q, k, v, kc, vc, kern, scale=0.0625)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_padded_channels_are_neither_read_nor_written():
    # Head width 24 (32 in the kernels' tiles): q, the caches and the output are views into rows 8
    # channels wider, the extra channels NaN. A load past a head's channels would make the scores NaN; a
    # store past them would overwrite the NaN. Tree rows, their keys split (the combine kernel writes).
    q, k, v, kc, vc, ref, kern = make_case([8, 5, 1], [6, 150, 20], "tree", D=24, splits=4)
    want = paged_attention(q, k, v, kc, vc, ref, scale=0.25)  # (stores the new tokens' K/V in kc, vc)

    def nan_padded(x):
        wide = torch.full((*x.shape[:-1], x.shape[-1] + 8), float("nan"))
        wide[..., :x.shape[-1]] = x
        return wide[..., :x.shape[-1]]

    out = nan_padded(torch.zeros_like(q))
    got = tri.triton_paged_attention(nan_padded(q), nan_padded(kc), nan_padded(vc), kern, 0.25, out=out)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert out.storage_offset() == 0 and torch.isnan(out.as_strided((*out.shape[:-1], 8), out.stride(), 24)).all()


def test_wide_heads_split_a_blocks_rows_across_programs(monkeypatch):
    # MLA at DeepSeek-V3's sizes: 576 channels, 1024 in the tiles. A 128-row block (a prefill tile, or one
    # decode token of a 128-head group) in bfloat16 does not fit in shared memory beside even 16-key tiles;
    # two programs take 64 rows each. Widths up to 256 keep whole blocks, as they always did.
    assert tri.choose_rows(128, 1024, 2) == 64 and tri.choose_block_n(64, 1024, 2) == 16
    assert tri.choose_rows(64, 1024, 2) == 64 and tri.choose_rows(128, 1024, 4) == 16
    assert tri.choose_rows(128, 256, 4) == tri.choose_rows(128, 128, 2) == 128
    # The slices in the interpreter: a shared-memory budget that holds 16 rows of the tiny MLA width (64 in
    # the tiles, float32), so a block of 8 tree nodes x 4 heads is taken by two programs, one of 16 prompt
    # tokens x 4 heads by four.
    monkeypatch.setattr(tri, "SHARED_BYTES", 14000)
    for mode, q_lens, prefix_lens, splits, block_rows in [("tree", [8, 5], [6, 150], 4, 32),
                                                          ("causal", [7, 1, 12], [0, 9, 3], 1, 64)]:
        q, k, v, kc, vc, ref, kern = make_case(q_lens, prefix_lens, mode, splits=splits, **MLA_HEADS)
        assert kern.block_m * 4 == block_rows and tri.choose_rows(block_rows, 64, 4) == 16
        want = paged_attention(q, k, v, kc.clone(), vc.clone(), ref, scale=0.25)
        got = paged_attention(q, k, v, kc, vc, kern, scale=0.25)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_programs_of_a_warp_group_of_rows_whose_tiles_pass_the_register_budget_take_eight_warps():
    # A program's tiles over 4 warps' threads: the default target's one-token steps (16 rows of 64
    # channels) and its 64-row verify and drafter tiles keep 4 warps, its 128-row prefill tiles take 8;
    # Qwen3.5's 256-channel heads take 8 at 64 rows, and 4 at one-token steps' 16 (fewer than a warp
    # group's rows); MLA's 1024 padded channels the same.
    assert tri.choose_warps(16, 64, 64, 2) == tri.choose_warps(64, 64, 64, 2) == 4
    assert tri.choose_warps(128, 64, 64, 2) == 8
    assert tri.choose_warps(16, 64, 256, 2) == 4 and tri.choose_warps(64, 64, 256, 2) == 8
    assert tri.choose_warps(16, 32, 1024, 2) == 4 and tri.choose_warps(64, 16, 1024, 2) == 8


def test_move_kv_kernel_copies_slots_in_order_across_layers():
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 3, 40, 2, 8, generator=g)
    src = torch.tensor([5, 9, 12], dtype=torch.int32)
    dst = torch.tensor([1, 2, 3], dtype=torch.int32)
    want = cache.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        want[:, :, d] = want[:, :, s]
    tri.triton_move_kv(cache, src, dst)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("D", [16, 24])  # 24: padded to 32 in the kernel
@pytest.mark.parametrize("qk_norm", [False, True])  # Qwen2 / Llama, Qwen3
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_qkv_rope_store_matches_split_ops(qk_norm, dtype, D):
    from ddtree.ops.attention import store_kv
    from ddtree.ops.fused import qkv_rope
    from ddtree.ops.triton_qkv import qkv_rope_store
    g = torch.Generator().manual_seed(1)
    T, H, Hkv, slots = 5, 4, 2, 40
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    positions = torch.tensor([0, 3, 17, 18, 255])
    freqs = torch.outer(torch.arange(300).float(), 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    slot_mapping = torch.tensor([7, 0, 39, 12, 13])
    qn = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype) if qk_norm else None
    kn = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype) if qk_norm else None
    kc, vc = torch.zeros(slots, Hkv, D, dtype=dtype), torch.zeros(slots, Hkv, D, dtype=dtype)
    q, k, v = qkv_rope(qkv, positions, cos_sin, H * D, Hkv * D, D, qn, kn, 1e-6)
    store_kv(k, v, kc, vc, slot_mapping)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    q2 = qkv_rope_store(qkv, positions, cos_sin, slot_mapping, kc2, vc2, H, Hkv, D, qn, kn, 1e-6)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(q2, q, **tol)
    torch.testing.assert_close(kc2, kc, **tol)
    assert torch.equal(vc2, vc)  # V is copied, not computed
    # Rows of k|v only (the drafter's context rows need no query): the same cache writes, both paths.
    kv = qkv[:, H * D:].contiguous()
    for fused in (True, False):
        kc3, vc3 = torch.zeros_like(kc), torch.zeros_like(vc)
        if fused:
            q3 = qkv_rope_store(kv, positions, cos_sin, slot_mapping, kc3, vc3, 0, Hkv, D, qn, kn, 1e-6)
        else:
            q3, k3, v3 = qkv_rope(kv, positions, cos_sin, 0, Hkv * D, D, qn, kn, 1e-6)
            store_kv(k3, v3, kc3, vc3, slot_mapping)
        assert q3.shape == (T, 0, D)
        torch.testing.assert_close(kc3, kc, **tol)
        assert torch.equal(vc3, vc)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_model_with_triton_kernels_generates_like_the_torch_path(family, tmp_path):
    # The whole layer on the GPU path (fused q/k/v kernel, K/V stored by it, Triton attention), run by
    # the interpreter: the same greedy tokens as the torch reference path.
    from tiny import make_tiny_model

    from ddtree import LLM, SamplingParams
    model = make_tiny_model(str(tmp_path), family)
    prompts = [[5, 9, 11, 40, 2, 7], [100, 3]]
    P = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in LLM(model, device="cpu", dtype="float32", spec="none", num_pages=64).generate(prompts, P)]
    llm = LLM(model, device="cpu", dtype="float32", spec="none", num_pages=64, kernels="triton")
    got = [o.token_ids for o in llm.generate(prompts, P)]
    assert got == want


@pytest.mark.parametrize("m", [1, 3, 16, 40])
@pytest.mark.parametrize("n,k,bias", [(24, 40, False), (37, 300, True)])
def test_few_rows_linear_matches_a_linear_layer(m, n, k, bias):
    # One row: the matrix-vector loop; more: tensor-core tiles (fp32 in IEEE precision here).
    from ddtree.ops.triton_linear import Config, linear
    g = torch.Generator().manual_seed(n + m)
    layer = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(m, k, generator=g)
    want = layer(x).detach()
    w, b = layer.weight.detach(), layer.bias.detach() if bias else None
    torch.testing.assert_close(linear(x, w, b), want, atol=1e-4, rtol=1e-4)
    other = Config(4, 64, 2) if m == 1 else Config(32, 32, 2)  # block sizes that do not divide the shapes
    torch.testing.assert_close(linear(x, w, b, other), want, atol=1e-4, rtol=1e-4)
    split = other._replace(split_k=3)  # depth slices summed by the epilogue kernel
    torch.testing.assert_close(linear(x, w, b, split), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("m,split", [(1, 1), (5, 1), (1, 4), (5, 4)])
def test_norm_linear_is_residual_add_rms_norm_then_linear(dtype, with_residual, m, split):
    from ddtree.ops.fused import add_rms_norm, rms_norm
    from ddtree.ops.triton_linear import linear_config, norm_linear
    g = torch.Generator().manual_seed(3)
    n, k = 40, 300
    x, res = torch.randn(m, k, generator=g).to(dtype), torch.randn(m, k, generator=g).to(dtype)
    gamma = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    if with_residual:
        normed, want_res = add_rms_norm(x, res, gamma, 1e-6)
    else:
        normed, want_res = rms_norm(x, gamma, 1e-6), x
    want = (normed.float() @ w.float().T + b.float()).to(dtype)
    cfg = linear_config(m, n, k)._replace(block_k=64, split_k=split)  # 300 deep: slices of 128, 128 and 44
    got, got_res = norm_linear(x, res if with_residual else None, gamma, 1e-6, w, b, config=cfg)
    # The norm's scale is applied after the product (and the interpreter truncates fp32 -> bf16 where
    # the GPU rounds to nearest): a few bf16 steps apart.
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.3, rtol=0.03)
    torch.testing.assert_close(got_res, want_res, **(tol if dtype == torch.float32 else dict(atol=0, rtol=2**-7)))
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,split", [(1, 1), (7, 1), (7, 2)])
def test_glu_norm_linear_is_the_mlp_activation(dtype, m, split):
    # gate|up stacked: the product's epilogue gives silu(gate) * up, what the down projection reads.
    from ddtree.ops.fused import add_rms_norm, silu_mul
    from ddtree.ops.triton_linear import linear_config, norm_linear
    g = torch.Generator().manual_seed(4)
    n, k = 24, 200
    x, res = torch.randn(m, k, generator=g).to(dtype), torch.randn(m, k, generator=g).to(dtype)
    gamma = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    w = (torch.randn(2 * n, k, generator=g) / 8).to(dtype)
    normed, _ = add_rms_norm(x, res, gamma, 1e-6)
    want = silu_mul((normed.float() @ w.float().T).to(dtype))
    got, _ = norm_linear(x, res, gamma, 1e-6, w, glu=True, config=linear_config(m, n, k)._replace(split_k=split))
    assert got.shape == (m, n)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.06, rtol=0.03)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("fused_rows", [1, 64])
def test_few_token_steps_take_the_fused_layer(tmp_path, monkeypatch, fused_rows):
    # With the Triton path on, steps of at most FUSED_ROWS tokens run DecoderLayer.few_rows (three fused
    # products): by default one-token decode steps; with 64, also these prefills and decode steps of two
    # requests. The tokens equal the torch path's.
    from tiny import make_tiny_model

    from ddtree import LLM, SamplingParams
    from ddtree.models import transformer
    calls = []
    real = transformer.DecoderLayer.few_rows
    monkeypatch.setattr(transformer.DecoderLayer, "few_rows", lambda self, h, *a: calls.append(h.shape[0]) or
                        real(self, h, *a))
    monkeypatch.setattr(transformer, "FUSED_ROWS", fused_rows)
    model = make_tiny_model(str(tmp_path), "qwen2")
    P = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = [[5, 9, 11, 40, 2, 7], [100, 3, 8]][:1 if fused_rows == 1 else 2]
    want = [o.token_ids for o in LLM(model, device="cpu", dtype="float32", spec="none", num_pages=64)
            .generate(prompts, P)]
    assert not calls
    llm = LLM(model, device="cpu", dtype="float32", spec="none", num_pages=64, kernels="triton")
    assert [o.token_ids for o in llm.generate(prompts, P)] == want
    if fused_rows == 1:  # every decode step after the prefill
        assert calls == [1] * 4 * llm.config.num_layers
    else:
        assert 2 in calls and 6 + 3 in calls  # decode steps of both requests, and the two prompts in one step


def test_training_features_on_the_triton_path_equal_the_torch_path(tmp_path):
    # train-drafter's target pass on the GPU uses the engine's Triton prefill over 16-token pages.
    from tiny import make_tiny_model

    from ddtree import LLM
    from ddtree.train.features import target_features
    llm = LLM(make_tiny_model(str(tmp_path), "qwen3"), device="cpu", dtype="float32", spec="none", num_pages=8)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, llm.config.vocab_size, (n,), generator=g) for n in (5, 37, 16, 1)]
    want, _ = target_features(llm.net, seqs, [0, 1], use_triton=False)
    got, _ = target_features(llm.net, seqs, [0, 1], use_triton=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec,budget,topk", [("ddtree", 6, 2), ("dflash", None, None)])
def test_speculative_steps_on_the_triton_path_equal_ar(spec, budget, topk, tmp_path, monkeypatch):
    # Verification and the drafter's block on the Triton path (few-row products, tree attention), by
    # the interpreter: the same greedy tokens as plain AR on the torch path.
    from tiny import make_tiny_model

    from ddtree import LLM, SamplingParams
    from ddtree.config import ModelConfig
    from ddtree.models import transformer
    from ddtree.models.dflash import random_drafter, save_drafter
    from ddtree.ops import triton_linear
    target, d = make_tiny_model(str(tmp_path / "t"), "qwen3"), str(tmp_path / "d")
    save_drafter(random_drafter(ModelConfig.from_dir(target), num_layers=1, block_size=4, target_layer_ids=[0, 1]), d)
    prompts = [[5, 9, 11, 40, 2, 7], [100, 3, 8]]
    P = SamplingParams(max_tokens=5, ignore_eos=True)
    want = [o.token_ids for o in LLM(target, device="cpu", dtype="float32", spec="none", num_pages=64)
            .generate(prompts, P)]
    llm = LLM(target, draft=d, device="cpu", dtype="float32", spec=spec, budget=budget, topk=topk, num_pages=64,
              kernels="triton")
    monkeypatch.setattr(transformer, "FUSED_ROWS", 64)  # (the default: one row; here verification's too)
    rows, target_rows, real, real_layer = [], [], triton_linear.norm_linear, transformer.DecoderLayer.few_rows
    monkeypatch.setattr(triton_linear, "norm_linear", lambda x, *a, **k: rows.append(x.shape[0]) or real(x, *a, **k))
    monkeypatch.setattr(transformer.DecoderLayer, "few_rows", lambda self, h, *a: target_rows.append(h.shape[0]) or
                        real_layer(self, h, *a))
    assert [o.token_ids for o in llm.generate(prompts, P)] == want
    tree = budget + 1 if budget else 4  # DFlash: the drafter's block of 4 is the chain verified
    assert 2 * tree in target_rows  # both requests' trees verified in one step, through the fused products
    # ... and the drafter's blocks (2 x 4 rows): norm_linear calls beyond the target layers' two per step
    assert rows.count(2 * 4) > 2 * target_rows.count(2 * 4)


@pytest.mark.parametrize("group, kv_heads, max_tokens", [(7, 2, 2048), (7, 2, 512), (4, 8, 2048), (1, 8, 2048),
                                                         (2, 4, 256), (16, 1, 2048)])
def test_the_variant_warm_up_covers_every_eager_batch(group, kv_heads, max_tokens):
    """Every eager batch (a prefill's, a refeed's, of any number of rows) of up to max_tokens tokens picks
    a kernel variant (tile height, key splits) that `variant_shapes`' batches compiled ahead of serving
    (7 query heads a KV head, 2 KV heads: the default target's)."""
    def variant(lengths):
        bm = tri.choose_block_m(max(lengths), group)
        return bm, tri.choose_splits(sum(-(-n // bm) for n in lengths), kv_heads, max(lengths))

    shapes = tri.variant_shapes(max_tokens, group, kv_heads)
    assert all(sum(s) <= max_tokens for s in shapes)
    warmed = {variant(s) for s in shapes}
    g = torch.Generator().manual_seed(group * max_tokens)
    for _ in range(3000):
        longest = int(torch.randint(1, [2, 4, 8, 16, 33, 65, 300][int(torch.randint(0, 7, (1,), generator=g))] + 1,
                                    (1,), generator=g))
        rows = int(torch.randint(1, max(2, max_tokens // max(1, longest // 2)), (1,), generator=g))
        lengths = torch.randint(1, longest + 1, (rows,), generator=g).tolist()
        lengths[0] = longest
        if sum(lengths) <= max_tokens:
            assert variant(lengths) in warmed, lengths


def test_a_budget_64_tree_is_verified_at_decode_widths():
    # 65 rows (64 nodes and the root) take the decode tiles and split the keys like a budget-32 tree; at
    # the H200 a 65-row verify treated as prefill (128-row tiles, one program per tile walking every key)
    # took 2.70 ms against 1.25 with the splits. One row more is prefill.
    group, kv_heads = 7, 2  # the default target's
    for width in (33, 65):
        bm = tri.choose_block_m(width, group)
        assert bm * triton.next_power_of_2(group) == 64
        assert tri.choose_splits(-(-width // bm), kv_heads, width) == 16
    assert tri.choose_block_m(66, group) * 8 == 128 and tri.choose_splits(5, kv_heads, 66) == 1


def test_the_attention_kernel_is_not_specialized_on_the_page_table_width():
    # (Triton ignores a name that is not a parameter: a renamed stride would compile per width again)
    kernel = tri._paged_attention_kernel  # (the interpreter's wrapper keeps the names it was given)
    unspecialized = kernel.kwargs["do_not_specialize"] if hasattr(kernel, "kwargs") else \
        [kernel.arg_names[i] for i in kernel.do_not_specialize]
    assert set(unspecialized) == {"stride_bt", "stride_mr", "stride_mi"} <= set(kernel.arg_names)


def test_the_kernels_setting_is_checked(tmp_path, monkeypatch):
    # kernels="triton" off a GPU needs Triton's interpreter, set before start; an unknown value is refused.
    from tiny import make_tiny_model

    from ddtree import LLM
    from ddtree.config import EngineConfig
    with pytest.raises(ValueError, match="kernels must be"):
        EngineConfig(kernels="cuda")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(make_tiny_model(str(tmp_path), "qwen2"), device="cpu", dtype="float32", spec="none", num_pages=16,
            kernels="triton")


def test_fused_qkv_rope_store_with_gated_queries_and_partial_rotary():
    # Qwen3.5's full-attention layers: each query head followed by its gate, q/k norms, and only the
    # first quarter of a head rotated; the kernel equals the torch ops models/hybrid.py runs.
    from ddtree.ops.attention import store_kv
    from ddtree.ops.fused import _rms_norm, rope
    from ddtree.ops.triton_qkv import qkv_rope_store
    g = torch.Generator().manual_seed(2)
    T, H, Hkv, D, rd, slots = 5, 4, 2, 32, 8, 40
    qkv = torch.randn(T, (2 * H + 2 * Hkv) * D, generator=g)
    positions = torch.tensor([0, 3, 17, 18, 255])
    freqs = torch.outer(torch.arange(300).float(), 1.0 / 10000 ** (torch.arange(0, rd, 2).float() / rd))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    slot_mapping = torch.tensor([7, 0, 39, 12, 13])
    qn, kn = 1 + 0.1 * torch.randn(D, generator=g), 1 + 0.1 * torch.randn(D, generator=g)
    qg, k, v = qkv.split([2 * H * D, Hkv * D, Hkv * D], dim=-1)
    q = _rms_norm(qg.view(T, H, 2 * D)[..., :D], qn, 1e-6)
    k = _rms_norm(k.reshape(T, Hkv, D), kn, 1e-6)
    q = torch.cat([rope(q[..., :rd].contiguous(), positions, cos_sin), q[..., rd:]], dim=-1)
    k = torch.cat([rope(k[..., :rd].contiguous(), positions, cos_sin), k[..., rd:]], dim=-1)
    kc, vc = torch.zeros(slots, Hkv, D), torch.zeros(slots, Hkv, D)
    store_kv(k, v.reshape(T, Hkv, D).contiguous(), kc, vc, slot_mapping)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    q2 = qkv_rope_store(qkv, positions, cos_sin, slot_mapping, kc2, vc2, H, Hkv, D, qn, kn, 1e-6, rotary_dim=rd,
                        gated=True)
    torch.testing.assert_close(q2, q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kc2, kc, atol=1e-5, rtol=1e-5)
    assert torch.equal(vc2, vc)
