"""Shared fixtures: one tiny random Qwen2 checkpoint (with tokenizer) per session and an `LLM` factory on it."""
import os

import torch

if not torch.cuda.is_available():  # Triton kernels run in its CPU interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tiny import make_tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def own_cost_cache(tmp_path, monkeypatch):
    """budget auto keeps measured cost tables in the ddtree cache: each test gets its own, so no test
    reuses another's table or leaves files in the developer's cache."""
    monkeypatch.setenv("DDTREE_COST_CACHE", str(tmp_path / "costs"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    """Directory of a tiny random Qwen2 model with the tiny byte-level BPE tokenizer and ChatML template."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen2")), "qwen2")


@pytest.fixture
def make_llm(tiny_qwen2):
    """`make_llm(**engine_kwargs)` -> an fp32 CPU `LLM` on `tiny_qwen2` (or on `model=` if given)."""
    from ddtree.llm import LLM

    def make(model: str | None = None, **engine_kwargs):
        kwargs = dict(device="cpu", dtype="float32", page_size=4, num_pages=64)
        kwargs.update(engine_kwargs)
        return LLM(model or tiny_qwen2, **kwargs)

    return make
