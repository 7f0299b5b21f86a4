"""Per-request generation parameters, validated at the edge so the engine never sees bad values."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # the most likely tokens a request may ask to see at each position


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = no top-k
    seed: int | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    # The log-probability of each generated token under the model (its own distribution: before
    # temperature, top-k and top-p), with this many of the most likely tokens; None = none.
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 or -1 disables it), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (the top tokens reported), "
                             f"got {self.logprobs!r}")
        if 0 < self.temperature < 1e-5:  # logits / temperature would overflow: this is greedy anyway
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
