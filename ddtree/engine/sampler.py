"""Sampling keyed by position: every draw is a function of (request seed, position, logits), on the device.

A request's token at absolute position `pos` (its index in prompt + output) is

    argmax over kept tokens v of  logits[v] + T * g(seed, pos, v)

with g a Gumbel variate computed from a 64-bit hash of (seed, pos, v) (`gumbel`). For T > 0 this is
an exact draw from softmax(logits / T) restricted to the kept set (the Gumbel-max trick); at T = 0 it
is the argmax, so greedy and sampled rows share one computation and one CUDA graph. The kept set is
every token whose logit reaches the row's threshold (`keep_threshold`): top-k first, then top-p of the
top-k-renormalized distribution at temperature T.

Because a draw never depends on how many draws came before, a seeded request commits the same tokens
under AR, DFlash and DDTree (verification draws at each tree node's next position, speculative/verify.py),
alone or in any batch, and after preemption and recompute. Unseeded requests get a random seed at
admission (`request_seed`).

On the GPU two Triton kernels (ops/triton_sample.py) draw without ever holding a [rows, vocab] noise
tensor: the noisy argmax over all tokens, then, for rows with top-k or top-p, a check that the drawn
token is kept and a draw again above it where it is not (the same tokens as the threshold here). The
torch functions here are the reference (CPU, tests); they work through the vocabulary in column
blocks for the same reason.
"""
from __future__ import annotations

import random
import struct
from dataclasses import dataclass

import torch

from ddtree.sampling_params import SamplingParams

# splitmix64's constants: the golden-ratio increment and the finalizer's two multipliers.
GOLDEN = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
VOCAB_STEP = 0xD1B54A32D192ED03  # spreads vocabulary indices over the 64-bit key space
COLUMNS = 4  # a request's sampling settings as int64 columns: seed, temperature bits, top-p bits, top-k
BLOCK_COLUMNS = 16384  # the torch reference's vocabulary block


def logprob_records(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row of logits [n, V] and the token drawn from it: the token's log-probability under the
    model (log-softmax of the raw logits: before temperature, top-k and top-p, as vLLM reports by
    default) and the `top` most likely tokens with theirs."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if not top:
        return [(c, []) for c in chosen]
    values, ids = logp.topk(top, dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


def needs_host(seqs) -> tuple[list, list]:
    """The requests whose steps run on the device alone, and those whose rows of logits the host reads
    (logprobs) or masks (structured output, engine/grammar.py): they run eager steps."""
    host = [s for s in seqs if s.logprobs is not None or s.constraint is not None]
    return [s for s in seqs if s.logprobs is None and s.constraint is None], host


def request_seed(params: SamplingParams) -> int:
    """The request's seed as a signed 64-bit integer: its own, or a random one (unseeded requests)."""
    seed = params.seed if params.seed is not None else random.getrandbits(64)
    seed %= 2**64
    return seed - 2**64 if seed >= 2**63 else seed


def _float_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def sampling_columns(params: list[SamplingParams], seeds: list[int]) -> list[list[int]]:
    """The batch's settings as `COLUMNS` host int columns, to travel in the same host->device copy as
    the step's other per-request integers; on the device they are the [R, COLUMNS] `draw` rows that
    `sample` reads (`SamplingRows.unpack` splits them for the reference)."""
    temps = [0.0 if p.greedy else p.temperature for p in params]
    return [list(seeds), [_float_bits(t) for t in temps], [_float_bits(p.top_p) for p in params],
            [p.top_k for p in params]]


@dataclass(slots=True)
class SamplingRows:
    """Per-row sampling settings as device tensors (one row per request, or per tree node)."""
    seed: torch.Tensor  # [M] int64
    temperature: torch.Tensor  # [M] float32; 0 = greedy
    top_p: torch.Tensor  # [M] float32; 1 = off
    top_k: torch.Tensor  # [M] int64; 0 = off

    @staticmethod
    def unpack(cols: torch.Tensor) -> "SamplingRows":
        """From `sampling_columns` as an int64 tensor [M, COLUMNS] (padding rows of zeros are greedy)."""
        bits = cols[:, 1:3].to(torch.int32).contiguous().view(torch.float32)
        return SamplingRows(cols[:, 0], bits[:, 0], bits[:, 1], cols[:, 3])

    def repeat(self, n: int) -> "SamplingRows":
        """Each row n times in a row (a tree's nodes share their request's settings)."""
        return SamplingRows(*(t.repeat_interleave(n, 0) for t in (self.seed, self.temperature, self.top_p,
                                                                  self.top_k)))


def draw_tensor(params: list[SamplingParams], seeds: list[int], device) -> torch.Tensor:
    """`sampling_columns` as an int64 device tensor [R, COLUMNS] (what `sample` reads)."""
    return torch.tensor(sampling_columns(params, seeds), dtype=torch.long).T.contiguous().to(device)


def sample(logits: torch.Tensor, draw: torch.Tensor, positions: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
    """The token drawn at `positions` [M] for each row of `logits` [M, V]; device ops only. `draw`
    [R, COLUMNS] holds the settings of R requests whose rows come in M / R consecutive rows each (a
    tree's nodes)."""
    assert logits.shape[0] % draw.shape[0] == 0
    if use_triton:
        from ddtree.ops.triton_sample import triton_sample
        return triton_sample(logits, draw, positions)
    rows = SamplingRows.unpack(draw).repeat(logits.shape[0] // draw.shape[0])
    return noisy_argmax(logits, rows.temperature, keep_threshold(logits, rows), rows.seed, positions)


# ----------------------------------------------------------------------------- the hash (torch, int64)

def _signed(c: int) -> int:
    return c - 2**64 if c >= 2**63 else c


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 bit patterns (multiplication wraps mod 2^64)."""
    x = x ^ _srl(x, 30)
    x = x * _signed(MIX1)
    x = x ^ _srl(x, 27)
    x = x * _signed(MIX2)
    return x ^ _srl(x, 31)


def row_keys(seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 64-bit key per (seed, position)."""
    return _mix(seed + positions.long() * _signed(GOLDEN))


def gumbel(keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [M, n] for row keys [M] and vocabulary indices [n]: the hash's top 24 bits as a
    uniform u in (0, 1), then -log(-log u), in float32."""
    h = _mix(keys[:, None] + columns[None, :].long() * _signed(VOCAB_STEP))
    u = (_srl(h, 40).float() + 0.5) * 2.0**-24
    return -torch.log(-torch.log(u))


# ----------------------------------------------------------------------------- the reference

def keep_threshold(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """The smallest logit each row keeps [M] (float32; -inf where nothing is cut: greedy rows and
    rows without top-k or top-p). Top-k keeps the logits at least as large as the k-th largest (ties
    with it included, and in the top-k mass); top-p then keeps the smallest prefix, in descending
    order, of that distribution at temperature T whose mass reaches p. Ties at the threshold are all
    kept."""
    M, V = logits.shape
    thresh = torch.full((M,), float("-inf"), device=logits.device)
    T, k, p = rows.temperature, rows.top_k, rows.top_p
    active = (T > 0) & (((k > 0) & (k < V)) | (p < 1))
    idx = active.nonzero().flatten()
    if not idx.numel():
        return thresh
    sorted_logits = logits[idx].float().sort(dim=-1, descending=True).values
    k_cut = torch.where((k[idx] > 0) & (k[idx] < V), k[idx], V)
    kth = sorted_logits.gather(1, (k_cut - 1)[:, None])
    top = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))  # (ties with the k-th count in its mass)
    probs = ((top - top[:, :1]) / T[idx, None]).exp()
    cum = probs.cumsum(-1)
    reach = cum >= p[idx, None] * cum[:, -1:]  # (cum[-1]: the top-k mass)
    first = torch.where(reach.any(-1), reach.float().argmax(-1), k_cut - 1)  # the first rank that reaches p
    last = torch.where(p[idx] < 1, torch.minimum(first, k_cut - 1), k_cut - 1)
    thresh[idx] = sorted_logits.gather(1, last[:, None]).squeeze(1)
    return thresh


def noisy_argmax(logits: torch.Tensor, temperature: torch.Tensor, thresh: torch.Tensor, seed: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """argmax over tokens with logit >= thresh of logits + T * gumbel (the first index wins a tie, as
    torch.argmax). Greedy rows take the plain argmax; sampled ones go through the vocabulary a block
    of columns at a time."""
    M, V = logits.shape
    tokens = logits.argmax(dim=-1)
    noisy = (temperature > 0).nonzero().flatten()
    if not noisy.numel():
        return tokens
    lg_rows, T, th = logits[noisy], temperature[noisy, None], thresh[noisy, None]
    keys = row_keys(seed[noisy], positions[noisy])
    best = torch.full((len(noisy),), float("-inf"), device=logits.device)
    best_idx = torch.zeros(len(noisy), dtype=torch.long, device=logits.device)
    for c0 in range(0, V, BLOCK_COLUMNS):
        cols = torch.arange(c0, min(V, c0 + BLOCK_COLUMNS), device=logits.device)
        lg = lg_rows[:, c0:c0 + len(cols)].float()
        score = (lg + T * gumbel(keys, cols)).masked_fill(lg < th, float("-inf"))
        val, i = score.max(dim=-1)
        better = val > best
        best = torch.where(better, val, best)
        best_idx = torch.where(better, i + c0, best_idx)
    tokens[noisy] = best_idx
    return tokens


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row draws from [M, V] (one-hot at the argmax for greedy rows)."""
    rows = SamplingRows.unpack(draw_tensor(params, [0] * len(params), logits.device))
    kept = logits.float() >= keep_threshold(logits, rows)[:, None]
    T = torch.where(rows.temperature > 0, rows.temperature, 1.0)
    probs = (logits.float() / T[:, None]).masked_fill(~kept, float("-inf")).softmax(-1)
    greedy = rows.temperature == 0
    onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, probs)
