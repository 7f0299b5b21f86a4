"""Structured output: a request's text follows a JSON schema, a regular expression or a Lark grammar.

llguidance compiles the constraint against the tokenizer and keeps, for each constrained request, the
set of tokens that may come next (`Constraint`). Before a draw, every token outside that set loses its
logit (`masked`), so each output token is a draw from the model's distribution restricted to what the
constraint allows, by the same keyed sampler as any other token (engine/sampler.py).

Speculation keeps this exact. A tree node's row is masked by the constraint's state after the node's own
ancestors (`Constraint.fill_tree`: a walk down the tree that advances a copy of the matcher into each
branch), so a node is accepted only where AR, masked at the same position, would have drawn its token:
DDTree and DFlash commit the tokens constrained AR commits, greedy or seeded. The walk copies rather than
rolls back: with llguidance 1.9, tokens consumed after a rollback left a matcher in another state than a
fresh one fed the same tokens (a JSON schema on Qwen2.5's tokenizer, `test_default_model.py`), and the
request's own matcher must only ever take its committed tokens.
The masks need the host between the draft and the draw, so constrained requests take the eager steps
that requests asking for logprobs take.

A request ends ("stop") when its constraint is complete: the text matches and nothing may follow. Where
it matches but may go on (a regex `ab|abc` after "ab"), the model's end-of-sequence tokens are allowed.
JSON's whitespace is bounded (`JSON_GAP`).
"""
from __future__ import annotations

import json

import torch

from ddtree.sampling_params import SamplingParams

WORD = 32  # tokens per word of a bitmask row (llguidance's int32 layout)


def grammar_source(params: SamplingParams) -> str | None:
    """The llguidance grammar of a request's constraint, or None for an unconstrained request."""
    import llguidance

    if params.json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(json_layout(params.json_schema))
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(params.grammar)
    return None


# Whitespace between two JSON tokens: a space, or at most one line break and an indent. Models lay JSON out
# as they were trained to (pretty-printed, mostly), and a gap cannot grow without bound, as it could if any
# whitespace were allowed: a model can then write newlines until max_tokens.
JSON_GAP = r"[ ]?|\n[ ]{0,32}|\n\t{0,8}"


def json_layout(schema: str) -> str:
    """The schema with JSON's whitespace limited to `JSON_GAP`, unless the schema sets its own llguidance
    options (`x-guidance`)."""
    value = json.loads(schema)
    if value is True:
        value = {}
    if isinstance(value, dict) and "x-guidance" not in value:
        value = {**value, "x-guidance": {"whitespace_flexible": True, "whitespace_pattern": JSON_GAP}}
    return json.dumps(value)


def validate(source: str, ll_tokenizer=None) -> str:
    """What is wrong with an llguidance grammar ("" where nothing is), against a tokenizer if given."""
    import llguidance

    return llguidance.LLMatcher.validate_grammar(source, ll_tokenizer).strip()


class Grammars:
    """The engine's constraint compiler: the tokenizer as llguidance sees it (built on first use) and the
    model's stop tokens, which the end of a complete text allows alike."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._ll_tokenizer = None
        self.unavailable = None if tokenizer is not None else "this model has no tokenizer"

    def prepare(self) -> None:
        """Builds llguidance's view of the tokenizer now (about a second for a vocabulary of 150k tokens), so
        that a server's first constrained request does not hold up the others' steps. A tokenizer llguidance
        cannot take (not byte-level BPE, or more tokens than the model's rows) leaves structured output
        unavailable, with the reason, and everything else as it was."""
        if self._ll_tokenizer is not None or self.unavailable:
            return
        import llguidance.hf

        try:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
        except Exception as e:  # noqa: BLE001 - whatever llguidance refuses, it refuses this tokenizer
            self.unavailable = f"llguidance cannot use this model's tokenizer: {e}"

    def constraint(self, params: SamplingParams) -> Constraint | None:
        """A new request's constraint; ValueError where it does not compile, or fails at its first step (a
        schema whose references never end compiles lazily)."""
        if not params.constrained:
            return None
        import llguidance

        self.prepare()
        if self.unavailable:
            raise ValueError(f"structured output is not available: {self.unavailable}")
        source = grammar_source(params)
        error = validate(source, self._ll_tokenizer)
        if error:
            raise ValueError(f"the {params.constraint_kind} does not compile: {error}")
        matcher = llguidance.LLMatcher(self._ll_tokenizer, source)
        c = Constraint(matcher, self.stop_ids)
        c.fill(new_bitmask(1, self.vocab_size), 0)
        if matcher.is_error():
            raise ValueError(f"the {params.constraint_kind} does not compile: {matcher.get_error()}")
        return c


class Constraint:
    """One request's matcher, advanced by the tokens the engine commits. The model's stop tokens end the
    request wherever they come (where the grammar names one too); the mask allows them where the text may
    end."""

    def __init__(self, matcher, stop_ids: list[int]):
        self.matcher, self.stop_ids = matcher, stop_ids

    def advance(self, token: int) -> bool:
        """Takes a committed token; True when the text is complete (the request ends with it). A token the
        matcher refuses (which its mask does not let through) ends the request too, rather than the step."""
        if token in self.stop_ids:
            return True
        return not self.matcher.consume_token(token) or self.matcher.is_stopped()

    def fill(self, bitmask: torch.Tensor, row: int, matcher=None) -> None:
        """The tokens that may come next into `bitmask[row]` (int32 words, bit t % 32 of word t // 32), after
        the committed tokens (or in `matcher`'s state): the matcher's, and every stop token where the text
        may end or where nothing else may come."""
        import llguidance.torch

        matcher = matcher or self.matcher
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)
        if self.stop_ids and (matcher.is_accepting() or not bool((bitmask[row] != 0).any())):
            words = bitmask[row].view(torch.uint8)  # (little-endian: byte t // 8 holds token t)
            for t in self.stop_ids:
                words[t // 8] |= 1 << (t % 8)

    def fill_tree(self, bitmask: torch.Tensor, first: int, tokens: list[int], parents: list[int],
                  valid: list[bool]) -> None:
        """Rows first + n of `bitmask` for the nodes n of one request's tree (node 0 the root, its last
        committed token; parents before children): the tokens that may follow each node's path. A node
        the constraint forbids is never accepted, and its row and its subtree's stay all ones. The
        request's matcher is left as it was (each branch takes a copy)."""
        children: list[list[int]] = [[] for _ in tokens]
        for n in range(1, len(tokens)):
            if valid[n]:
                children[parents[n]].append(n)
        bitmask[first:first + len(tokens)] = -1
        self.fill(bitmask, first)

        def visit(n: int, matcher) -> None:
            for c in children[n]:
                t = tokens[c]
                allowed = (int(bitmask[first + n, t // WORD]) >> (t % WORD)) & 1
                if not allowed or t in self.stop_ids:  # (the request ends at a stop token)
                    continue
                branch = matcher.deep_copy()
                branch.consume_token(t)
                self.fill(bitmask, first + c, branch)
                visit(c, branch)

        visit(0, self.matcher)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask of `rows` rows with every token allowed."""
    return torch.full((rows, -(-vocab_size // WORD)), -1, dtype=torch.int32)


def masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [M, V] with -inf wherever `bitmask` [M, W] (host, int32) has a 0 bit. The words are unpacked
    a byte at a time (little-endian: byte k of word w holds tokens 32 w + 8 k to 32 w + 8 k + 7)."""
    M, V = logits.shape
    octets = bitmask.view(torch.uint8).to(logits.device, non_blocking=True)
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    allowed = ((octets[:, :, None] >> shifts) & 1).view(M, -1)[:, :V]
    return logits.masked_fill(allowed == 0, float("-inf"))


def constrained_rows(logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
    """One row of logits per request [R, V], the constrained requests' rows masked to their next tokens."""
    if not any(constraints):
        return logits
    bitmask = new_bitmask(len(constraints), logits.shape[-1])
    for i, c in enumerate(constraints):
        if c is not None:
            c.fill(bitmask, i)
    return masked(logits, bitmask)


def constrained_tree(logits: torch.Tensor, constraints: list[Constraint | None], tokens: torch.Tensor,
                     parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each request's tree of logits [R, N, V] (`tokens`, `parents`, `valid` [R, N]: speculative/tree.py's
    `Tree`), each constrained request's nodes masked by its constraint after their paths (`fill_tree`)."""
    if not any(constraints):
        return logits
    R, N, V = logits.shape
    bitmask = new_bitmask(R * N, V)
    tok, par, ok = tokens.tolist(), parents.tolist(), valid.tolist()
    for r, c in enumerate(constraints):
        if c is not None:
            c.fill_tree(bitmask, r * N, tok[r], par[r], ok[r])
    return masked(logits.reshape(R * N, V), bitmask).view(R, N, V)

