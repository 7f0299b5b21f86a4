"""ddtree: LLM inference with lossless DFlash and DDTree speculative decoding."""
from ddtree.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name):  # import the engine lazily so `import ddtree` stays fast for the CLI
    if name in ("LLM", "RequestOutput"):
        from ddtree import llm
        return getattr(llm, name)
    raise AttributeError(name)
