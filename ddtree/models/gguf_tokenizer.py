"""The BPE pre-tokenizer of a converted GGUF tokenizer, chosen by the file's `tokenizer.ggml.pre`.

llama.cpp splits text before BPE with the regexes it ties to `tokenizer.ggml.pre` (src/llama-vocab.cpp). transformers
knows many of those names; for the others it keeps a plain GPT-2 byte-level split, which cuts digits, CJK and
punctuation differently from the original model. This table fills in the names ddtree's architectures carry that
transformers lacks, each as the original model's HF pre-tokenizer (which llama.cpp's regexes mirror).
"""
from __future__ import annotations

import warnings

# DeepSeek-V3 / R1 / V3.1 ("deepseek-v3"): digits in runs of up to three, then runs of Han and kana, then words,
# punctuation and spaces; the same three splits, in order, as DeepSeek-V3's tokenizer.json.
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# Kimi-K2 ("kimi-k2", architecture deepseek2): its tiktoken pattern, one regex in which Han runs come first and the
# letter classes leave Han out (Oniguruma's `&&` class intersection).
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_KIMI_K2 = (
    r"\p{Han}+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

SPLITS = {"deepseek-v3": _DEEPSEEK_V3, "kimi-k2": _KIMI_K2}
# Names whose split is GPT-2's, the one transformers keeps when it knows no other.
_GPT2_SPLIT = {"gpt-2"}


def set_pre_tokenizer(tok, pre: str | None, model: str | None) -> None:
    """Give the fast tokenizer `tok` the split llama.cpp applies for `pre`, or warn where nobody knows that split.

    Only the generic fast tokenizer class keeps its pre-tokenizer through save and load; a model's own class (Qwen's,
    for one) rebuilds its model's split on load, which is the one its GGUFs name.
    """
    from tokenizers import Regex, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if model != "gpt2" or not pre or type(tok) is not PreTrainedTokenizerFast:
        return  # not byte-level BPE (sentencepiece splits on spaces only), no name, or a model's own class
    if pre in SPLITS:
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in SPLITS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return
    try:  # (transformers' own table of names; a version without it gives no warning)
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        return
    if pre not in GGUF_PRE_TOKENIZER_SPLITS and pre not in _GPT2_SPLIT:
        warnings.warn(f"GGUF tokenizer.ggml.pre {pre!r} is unknown to ddtree and transformers: the converted "
                      "tokenizer splits text the GPT-2 way, so its token ids may differ from the original model's")
