"""Incremental detokenization that never emits half of a multi-byte character.

Text is produced by decoding a short window of tokens and emitting only the part past what was
already emitted; if the window ends in U+FFFD (an incomplete UTF-8 sequence split across tokens),
nothing is emitted until the next tokens complete it. A few prompt tokens seed the window so
tokenizers that drop a leading space at the start of a decode still space the first word right.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], context: int = 5):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-context:]) if tokenizer is not None else []
        self.prefix = 0  # window start
        self.read = len(self.ids)  # tokens before this were already emitted

    def add(self, new_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        if self.tokenizer is None or self.read == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = decode(self.ids[self.prefix:], skip_special_tokens=True)
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]
