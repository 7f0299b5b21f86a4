"""Per-request generation parameters, validated at the edge so the engine never sees bad values."""
from __future__ import annotations

import json
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
    # Structured output (engine/grammar.py), at most one: a JSON schema (a dict or JSON text; {"type":
    # "object"} for any JSON object), a regular expression, or a Lark grammar. The text follows it and the
    # request ends where it is complete.
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None

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
        given = [k for k in ("json_schema", "regex", "grammar") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of json_schema, regex and grammar, got {' and '.join(given)}")
        if self.json_schema is not None:
            self.json_schema = _schema_text(self.json_schema)
        for k in ("regex", "grammar"):
            if getattr(self, k) is not None and not isinstance(getattr(self, k), str):
                raise ValueError(f"{k} must be a string, got {type(getattr(self, k)).__name__}")
        if self.constrained:
            from ddtree.engine.grammar import grammar_source, validate
            error = validate(grammar_source(self))
            if error:
                raise ValueError(f"the {self.constraint_kind} does not compile: {error}")
        if 0 < self.temperature < 1e-5:  # logits / temperature would overflow: this is greedy anyway
            self.temperature = 0.0

    @property
    def constrained(self) -> bool:
        """Whether the output follows a structure (json_schema, regex or grammar)."""
        return self.constraint_kind is not None

    @property
    def constraint_kind(self) -> str | None:
        return next((k for k in ("json_schema", "regex", "grammar") if getattr(self, k) is not None), None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _schema_text(schema) -> str:
    """A JSON schema given as a dict or as JSON text, as JSON text; ValueError where it is neither."""
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
        return schema
    if isinstance(schema, dict | bool):
        return json.dumps(schema)
    raise ValueError(f"json_schema must be a dict or JSON text, got {type(schema).__name__}")
