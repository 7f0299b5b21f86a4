"""Logprobs in the OpenAI shapes: the engine's records of generated tokens (token id, log-probability,
the most likely tokens with theirs) as chat `logprobs.content` entries or completion `logprobs`
columns, each token with its text and UTF-8 bytes.

The values are the model's own log-probabilities (before temperature, top-k and top-p), as vLLM
reports by default. A token whose bytes are not whole UTF-8 characters (a byte-level BPE token that
splits one) is shown as `bytes:\\xe2\\x80`, as OpenAI shows it; its `bytes` are exact.
"""
from __future__ import annotations

import codecs
import json

from ddtree.server import protocol as P

LOWEST = -9999.0  # what a zero probability (log -inf) is reported as: JSON has no infinity

Record = tuple[int, float, list[tuple[int, float]]]  # (token id, log-probability, [(id, log-probability)])


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte in a token's string.
    Printable Latin-1 bytes stand for themselves; the others, in order, for code points from 256 on."""
    own = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {chr(b): b for b in own}
    chars.update({chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in own)})
    return chars


class TokenText:
    """The bytes and display text of token ids, for one tokenizer (None: a model without one)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.alphabet = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and (json.loads(backend.to_str()).get("decoder") or {}).get("type") == "ByteLevel":
            self.alphabet = _byte_level_alphabet()
        # every token the text leaves out (skip_special_tokens): the special-tokens map's, and any added
        # token marked special (Llama 3's reserved and header tokens are not in the map)
        self.special = set(getattr(tokenizer, "all_special_ids", None) or [])
        self.special |= {i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items() if t.special}
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token: int) -> bytes:
        if token not in self._bytes:
            self._bytes[token] = self._read(token)
        return self._bytes[token]

    def _read(self, token: int) -> bytes:
        if self.tokenizer is None:
            return b""
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if piece is None:
            return self.tokenizer.decode([token]).encode()
        if self.alphabet is not None and all(c in self.alphabet for c in piece):
            return bytes(self.alphabet[c] for c in piece)
        # SentencePiece pieces: "▁" stands for a space, and <0xNN> for a byte the vocabulary lacks
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def text(self, token: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token}"
        raw = self.bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _value(logprob: float) -> float:
    return max(logprob, LOWEST)


def chat_logprobs(text: TokenText, records: list[Record]) -> P.ChatLogprobs:
    def top(token: int, logprob: float) -> P.TopLogprob:
        return P.TopLogprob(token=text.text(token), logprob=_value(logprob), bytes=list(text.bytes(token)))

    return P.ChatLogprobs(content=[P.ChatTokenLogprob(**top(tok, lp).model_dump(),
                                                      top_logprobs=[top(t, v) for t, v in alts])
                                   for tok, lp, alts in records])


class CompletionOffsets:
    """Where each token starts in the completion's text (characters), across a stream's chunks."""

    def __init__(self):
        self.chars = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, raw: bytes) -> int:
        start = self.chars
        self.chars += len(self.decoder.decode(raw))
        return start


def completion_logprobs(text: TokenText, records: list[Record], offsets: CompletionOffsets) -> P.CompletionLogprobs:
    return P.CompletionLogprobs(
        tokens=[text.text(tok) for tok, _, _ in records],
        token_logprobs=[_value(lp) for _, lp, _ in records],
        top_logprobs=[{text.text(t): _value(v) for t, v in alts} for _, _, alts in records],
        # (special tokens take no room: the text leaves them out)
        text_offset=[offsets.next(b"" if tok in text.special else text.bytes(tok)) for tok, _, _ in records])
