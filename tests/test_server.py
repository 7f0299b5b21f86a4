"""`ddtree serve` end to end: real server processes on a tiny model pair, driven by the openai client.

Four servers start once for the module (in parallel, on free loopback ports): AR, DDTree with a
random drafter, the same DDTree split over two tensor-parallel ranks, and AR with an API key and a
one-request queue limit. Every request is bounded by a
client timeout and every wait by a deadline, so a hung server fails the tests instead of hanging them.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tiny import make_tiny_pair

STARTUP_S = 120  # per server, loading included
REQUEST_S = 60
MSG = [{"role": "user", "content": "Hello, how are you?"}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log: str
    key: str | None = None
    seen_before_healthy: set[int] = field(default_factory=set)  # statuses of /health while starting

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key or "unused", timeout=REQUEST_S,
                             max_retries=0)

    def post(self, path: str, body, headers: dict | None = None) -> httpx.Response:
        headers = ({"Authorization": f"Bearer {self.key}"} if self.key else {}) | (headers or {})
        if isinstance(body, str):
            return httpx.post(self.url + path, content=body, timeout=REQUEST_S,
                              headers={"Content-Type": "application/json", **headers})
        return httpx.post(self.url + path, json=body, headers=headers, timeout=REQUEST_S)

    def metrics(self) -> dict[str, float]:
        """Samples by name, labels folded in: {'ddtree_requests_total{finish_reason="abort"}': 1.0, ...}."""
        text = httpx.get(self.url + "/metrics", timeout=REQUEST_S).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_until(self, pred, timeout: float = 15.0) -> dict[str, float]:
        """Polls /metrics until `pred(metrics)` holds; returns the metrics that satisfied it."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if pred(m):
                return m
            assert time.monotonic() < deadline, f"{self.name}: condition not met within {timeout}s: {m}"
            time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name: str, args: list[str], tmp) -> Server:
    port, log = free_port(), str(tmp / f"{name}.log")
    cmd = [sys.executable, "-m", "ddtree.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", *args]
    env = {k: v for k, v in os.environ.items() if k != "DDTREE_API_KEY"}  # keys only where a test asks
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    return Server(name, f"http://127.0.0.1:{port}", proc, log, key)


def wait_healthy(server: Server, deadline: float) -> set[int]:
    """Polls /health until 200; returns the statuses seen before (503 while loading)."""
    seen = set()
    while True:
        if server.proc.poll() is not None:
            pytest.fail(f"{server.name} server exited with {server.proc.returncode}:\n{open(server.log).read()}")
        try:
            status = httpx.get(server.url + "/health", timeout=5).status_code
            if status == 200:
                return seen
            seen.add(status)
        except httpx.TransportError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            pytest.fail(f"{server.name} server not healthy within {STARTUP_S}s:\n{open(server.log).read()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    return make_tiny_pair(str(tmp_path_factory.mktemp("serve")))


@pytest.fixture(scope="module")
def servers(pair, tmp_path_factory):
    model, draft = pair
    tmp = tmp_path_factory.mktemp("serve_logs")
    common = ["--model", model, "--num-pages", "512"]
    procs = {
        # short context: requests without max_tokens (schemathesis sends many) stay short
        "ar": launch("ar", [*common, "--max-model-len", "128"], tmp),
        "spec": launch("spec", [*common, "--draft", draft, "--spec", "ddtree", "--budget", "8", "--topk", "2",
                                "--max-model-len", "256"], tmp),
        "tp": launch("tp", [*common, "--draft", draft, "--spec", "ddtree", "--budget", "8", "--topk", "2",
                            "--max-model-len", "256", "--tensor-parallel-size", "2", "--dist-timeout", "10"], tmp),
        "keyed": launch("keyed", ["--model", model, "--num-pages", "64", "--api-key", "sekrit",
                                  "--served-model-name", "keyed", "--max-num-seqs", "1", "--max-queue", "0"], tmp),
    }
    try:
        deadline = time.monotonic() + STARTUP_S
        for s in procs.values():
            s.seen_before_healthy = wait_healthy(s, deadline)
        yield procs
    finally:
        for s in procs.values():
            s.proc.terminate()
        for s in procs.values():
            try:
                s.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def ar(servers) -> Server:
    return servers["ar"]


@pytest.fixture(scope="module")
def spec(servers) -> Server:
    return servers["spec"]


@pytest.fixture(scope="module")
def tp(servers) -> Server:
    return servers["tp"]


@pytest.fixture(scope="module")
def keyed(servers) -> Server:
    return servers["keyed"]


@pytest.fixture(scope="module")
def tokenizer(pair):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(pair[0])


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


# ---- the API, through the openai client

def test_health_is_ok_and_models_list_the_served_name(servers, ar, keyed):
    assert all(s.seen_before_healthy <= {503} for s in servers.values())  # 503 while loading, if caught
    assert httpx.get(ar.url + "/health").json() == {"status": "ok"}
    models = ar.client().models.list().data
    assert [m.id for m in models] == ["tiny-qwen3"] and models[0].max_model_len == 128
    assert models[0].ddtree["spec"] == "none" and models[0].ddtree["prefix_caching"] is True
    assert ar.client().models.retrieve("tiny-qwen3").id == "tiny-qwen3"
    assert [m.id for m in keyed.client().models.list().data] == ["keyed"]


def test_chat_completion_reports_text_usage_finish_reason_and_no_spec_stats_for_ar(ar, tokenizer):
    r = ar.client().chat.completions.create(model="tiny-qwen3", messages=MSG, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == "tiny-qwen3"
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str) and c.finish_reason == "length"
    prompt = len(chat_ids(tokenizer, MSG))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt, 12, prompt + 12)
    assert r.model_extra["ddtree"] == {"spec": "none", "accept_lengths": [], "mean_accept_length": None}
    # without ignore_eos the model may stop early, but never past max_tokens
    r = ar.client().chat.completions.create(model="tiny-qwen3", messages=MSG, max_completion_tokens=5)
    assert r.usage.completion_tokens <= 5 and r.choices[0].finish_reason in ("stop", "length")


def test_completion_takes_text_or_token_ids(ar, tokenizer):
    text = "def add(a, b):"
    a = ar.client().completions.create(model="tiny-qwen3", prompt=text, **GREEDY)
    b = ar.client().completions.create(model="tiny-qwen3", prompt=tokenizer.encode(text), **GREEDY)
    assert a.object == "text_completion" and a.choices[0].finish_reason == "length"
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == len(tokenizer.encode(text))


def test_streamed_chunks_concatenate_to_the_non_streamed_text_and_end_with_usage(spec):
    c = spec.client()
    full = c.chat.completions.create(model="tiny-qwen3", messages=MSG, **GREEDY)
    chunks = list(c.chat.completions.create(model="tiny-qwen3", messages=MSG, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full.choices[0].message.content
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["ddtree"] == full.model_extra["ddtree"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens)
    # (the repeat finds the prompt's pages, all but the one holding its last token, in the prefix cache)
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16
    text = c.completions.create(model="tiny-qwen3", prompt="for i in", **GREEDY).choices[0].text
    parts = list(c.completions.create(model="tiny-qwen3", prompt="for i in", stream=True, **GREEDY))
    assert "".join(p.choices[0].text for p in parts) == text and parts[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_the_text_and_is_never_streamed(ar):
    c = ar.client()

    def stream(**kw) -> list[str]:
        return [p.choices[0].text for p in c.completions.create(model="tiny-qwen3", prompt="Hello", stream=True,
                                                                 **GREEDY, **kw)]
    parts = [p for p in stream() if p]
    text = "".join(parts)
    # A stop string that straddles two deltas: without the hold-back its first character would go out.
    i = len(parts) // 2
    stop = parts[i - 1][-1] + parts[i][0]
    expected = text[:text.find(stop)]
    r = c.completions.create(model="tiny-qwen3", prompt="Hello", stop=stop, **GREEDY)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    for stops in ([stop], ["never-in-the-output-\x00", stop]):
        streamed = stream(stop=stops)
        assert "".join(streamed) == expected and all(stop not in p for p in streamed)


@pytest.mark.parametrize("which", ["ar", "spec"])
def test_same_seed_gives_the_same_sampled_text(which, servers):
    c = servers[which].client()

    def sample(seed):
        return c.chat.completions.create(model="tiny-qwen3", messages=MSG, temperature=1.0, top_p=0.95, seed=seed,
                                         max_tokens=16, extra_body={"ignore_eos": True}).choices[0].message.content
    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1  # and it does sample


def test_speculative_greedy_output_equals_ar_output(ar, spec):
    convos = [MSG, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "for i in range(10):"}],
              [{"role": "user", "content": "The quick brown fox"}]]
    for messages in convos:
        a = ar.client().chat.completions.create(model="tiny-qwen3", messages=messages, **GREEDY)
        s = spec.client().chat.completions.create(model="tiny-qwen3", messages=messages, **GREEDY)
        assert s.choices[0].message.content == a.choices[0].message.content
        assert (s.usage.prompt_tokens, s.usage.completion_tokens) == (a.usage.prompt_tokens, a.usage.completion_tokens)
        info = s.model_extra["ddtree"]
        assert info["spec"] == "ddtree" and sum(info["accept_lengths"]) == s.usage.completion_tokens - 1
        assert info["mean_accept_length"] >= 1
    a = ar.client().completions.create(model="tiny-qwen3", prompt="import numpy", **GREEDY)
    s = spec.client().completions.create(model="tiny-qwen3", prompt="import numpy", **GREEDY)
    assert s.choices[0].text == a.choices[0].text


def test_a_tensor_parallel_server_answers_as_one_rank_does(spec, tp):
    convos = [MSG, [{"role": "user", "content": "for i in range(10):"}]]
    for messages in convos:
        want = spec.client().chat.completions.create(model="tiny-qwen3", messages=messages, **GREEDY)
        got = tp.client().chat.completions.create(model="tiny-qwen3", messages=messages, **GREEDY)
        assert got.choices[0].message.content == want.choices[0].message.content \
            and got.usage.completion_tokens == want.usage.completion_tokens
    sampled = dict(messages=MSG, temperature=0.8, seed=3, max_tokens=16, extra_body={"ignore_eos": True})
    want = spec.client().chat.completions.create(model="tiny-qwen3", **sampled).choices[0].message.content
    parts = tp.client().chat.completions.create(model="tiny-qwen3", stream=True, **sampled)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == want


# ---- bad input: a 400 in the OpenAI error shape, and the server goes on serving

LONG = "hello world, how are you today? " * 200
BAD = {
    "negative temperature": (CHAT, {"messages": MSG, "temperature": -0.5}, "temperature"),
    "temperature not a number": (CHAT, {"messages": MSG, "temperature": "hot"}, "temperature"),
    "top_p zero": (CHAT, {"messages": MSG, "top_p": 0}, "top_p"),
    "top_p above one": (COMP, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    "max_tokens zero": (COMP, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "max_tokens negative": (CHAT, {"messages": MSG, "max_tokens": -3}, "max_tokens"),
    "max_completion_tokens zero": (CHAT, {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    "max_tokens beyond the context": (CHAT, {"messages": MSG, "max_tokens": 100_000}, "max_tokens"),
    "malformed JSON": (CHAT, '{"messages": [', None),
    "body not an object": (COMP, "[1, 2]", None),
    "empty messages": (CHAT, {"messages": []}, "messages"),
    "no messages": (CHAT, {"max_tokens": 4}, "messages"),
    "image content": (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    "chat longer than the context": (CHAT, {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    "prompt longer than the context": (COMP, {"prompt": LONG}, "prompt"),
    "empty prompt": (COMP, {"prompt": ""}, "prompt"),
    "several prompts": (COMP, {"prompt": ["a", "b"]}, "prompt"),
    "token id out of range": (COMP, {"prompt": [1, 10**9]}, "prompt"),
    "n above the limit": (CHAT, {"messages": MSG, "n": 17}, "n"),
    "n zero": (COMP, {"prompt": "hi", "n": 0}, "n"),
    "bad params on a stream": (CHAT, {"messages": MSG, "stream": True, "top_p": 0}, "top_p"),
    # strict types: JSON numbers and booleans only, roles and content parts from their enums
    "max_tokens true": (COMP, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    "max_tokens a string": (COMP, {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    "max_tokens a fraction": (CHAT, {"messages": MSG, "max_tokens": 5.5}, "max_tokens"),
    "stream a string": (CHAT, {"messages": MSG, "stream": "yes"}, "stream"),
    "seed a string": (CHAT, {"messages": MSG, "seed": "7"}, "seed"),
    "unknown role": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    "empty role": (CHAT, {"messages": [{"role": "", "content": "hi"}]}, "messages"),
    "content part without a type": (CHAT, {"messages": [{"role": "user", "content": [{"type": ""}]}]}, "messages"),
    "text part without text": (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    "an empty token list": (COMP, {"prompt": [[]]}, "prompt"),
    "a boolean token": (COMP, {"prompt": [1, True]}, "prompt"),
    "a negative token": (COMP, {"prompt": [5, -1]}, "prompt"),
    "presence_penalty": (CHAT, {"messages": MSG, "presence_penalty": 0.5}, "presence_penalty"),
    "top_logprobs without logprobs": (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    "top_logprobs above 20": (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "completion logprobs above 5": (COMP, {"prompt": "hi", "logprobs": 6}, "logprobs"),
    "logprobs a string": (CHAT, {"messages": MSG, "logprobs": "true"}, "logprobs"),
    "lone surrogate in a prompt": (COMP, '{"prompt": "x\\ud800y", "max_tokens": 2}', "prompt"),
    "lone surrogate in a message": (CHAT, '{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages"),
    "lone surrogate in a stop string": (COMP, '{"prompt": "hi", "stop": ["a\\ud801"]}', "stop"),
    "response_format of an unknown type": (CHAT, {"messages": MSG, "response_format": {"type": "xml"}},
                                           "response_format"),
    "json_schema format without its schema": (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}},
                                              "response_format"),
    "a schema that does not compile": (CHAT, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    "a regex that does not compile": (COMP, {"prompt": "hi", "regex": "a("}, "regex"),
    "two structures": (COMP, {"prompt": "hi", "regex": "a", "grammar": 'start: "a"'}, "grammar"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_a_400_in_the_openai_error_shape(case, ar):
    path, body, param = BAD[case]
    r = ar.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    assert err["type"] == "invalid_request_error"
    ok = ar.post(COMP, {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


def test_an_unknown_model_is_a_404_and_integral_numbers_are_integers(ar):
    # (as OpenAI answers a model it does not serve; and 5.0 is an integer, as JSON Schema has it)
    for path, body in ((CHAT, {"model": "gpt-17", "messages": MSG}), (COMP, {"model": "gpt-17", "prompt": "hi"})):
        r = ar.post(path, body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = ar.post(COMP, {"prompt": [1.0, 2], "max_tokens": 3.0, "seed": 7.0, "temperature": 1})
    assert r.status_code == 200 and r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                                                     "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_body_that_is_not_sent_as_json_gets_a_400_that_says_so(ar):
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded"):
        r = httpx.post(ar.url + COMP, content=b'{"prompt": "hi", "max_tokens": 2}', timeout=REQUEST_S,
                       headers={"Content-Type": ctype} if ctype else {})
        assert r.status_code == 400 and "expected Content-Type application/json" in r.json()["error"]["message"]
    r = ar.post(COMP, {"prompt": "hi", "max_tokens": 2}, headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200
    r = ar.post(COMP, {"prompt": "hi", "max_tokens": "2"}, headers={"Content-Type": "application/vnd.api+json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # (a JSON type: the field's error)


def test_messages_in_every_role_and_text_parts_are_accepted(ar):
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "system", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again?", "name": "ann"}]
    r = ar.post(CHAT, {"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_null_fields_mean_the_defaults(ar):
    body = {"messages": MSG, "max_tokens": 3, "temperature": None, "top_p": None, "n": None, "stop": None,
            "seed": None, "stream": None, "stream_options": None, "model": None, "top_k": None, "ignore_eos": None,
            "user": None, "max_completion_tokens": None}
    r = ar.post(CHAT, body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_openai_client_sees_bad_request_errors(ar):
    with pytest.raises(openai.BadRequestError, match="less than or equal to 16"):
        ar.client().chat.completions.create(model="tiny-qwen3", messages=MSG, n=17)


@pytest.mark.parametrize("which", ["ar", "spec"])
def test_n_choices_are_the_requests_of_seeds_seed_plus_i_streamed_or_not(which, servers):
    server = servers[which]
    c = server.client()
    sampled = dict(temperature=0.9, seed=5, max_tokens=12, extra_body={"ignore_eos": True})
    r = c.chat.completions.create(model="tiny-qwen3", messages=MSG, n=3, **sampled)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    alone = [c.chat.completions.create(model="tiny-qwen3", messages=MSG, **{**sampled, "seed": 5 + i})
             for i in range(3)]
    assert [ch.message.content for ch in r.choices] == [a.choices[0].message.content for a in alone]
    assert len({ch.message.content for ch in r.choices}) > 1  # (three seeds: different draws)
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens and r.usage.completion_tokens == 3 * 12
    chunks = list(c.chat.completions.create(model="tiny-qwen3", messages=MSG, n=3, stream=True,
                                            stream_options={"include_usage": True}, **sampled))
    texts, finishes, roles = ["", "", ""], [], []
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
            roles += [choice.index] if choice.delta.role else []
            finishes += [choice.index] if choice.finish_reason else []
    assert texts == [ch.message.content for ch in r.choices]
    assert sorted(roles) == sorted(finishes) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 3 * 12
    comp = c.completions.create(model="tiny-qwen3", prompt="import numpy", n=2, logprobs=2, **sampled)
    for ch in comp.choices:  # each choice's own logprobs, its offsets from its own text's start
        assert len(ch.logprobs.tokens) == 12 and ch.logprobs.text_offset[0] == 0
    server.wait_until(lambda m: m["ddtree_kv_pages_used"] == 0)


# ---- concurrency, disconnects and KV pages

def test_32_concurrent_streams_complete_and_then_every_kv_page_is_free(spec):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": f"Request {i}: count to {i}."}],
            max_tokens=8 + i % 9, temperature=0 if i % 2 else 0.8, seed=i, stream=True)
        text, finish = "", None
        async for ch in stream:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
        return text, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{spec.url}/v1", api_key="unused", timeout=REQUEST_S,
                                      max_retries=0) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), 120)

    before = spec.metrics()
    results = asyncio.run(main())
    assert all(finish in ("stop", "length") for _, finish in results), results
    m = spec.wait_until(lambda m: m["ddtree_kv_pages_used"] == 0 and m["ddtree_requests_running"] == 0)
    done = sum(v for k, v in m.items() if k.startswith("ddtree_requests_total"))
    assert done - sum(v for k, v in before.items() if k.startswith("ddtree_requests_total")) == 32
    assert m["ddtree_requests_waiting"] == 0 and m["ddtree_kv_pages_total"] == 512


def test_client_disconnect_mid_stream_aborts_the_request_and_frees_its_pages(spec):
    aborts = 'ddtree_requests_total{finish_reason="abort"}'
    before = spec.metrics().get(aborts, 0)
    body = {"messages": MSG, "stream": True, "max_tokens": 230, "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=REQUEST_S) as c, c.stream("POST", spec.url + CHAT, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped line iterator would close the connection early
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "chat.completion.chunk"
        spec.wait_until(lambda m: m["ddtree_kv_pages_used"] > 0, timeout=5)  # it is running
        assert spec.metrics().get(aborts, 0) == before
    m = spec.wait_until(lambda m: m.get(aborts, 0) == before + 1 and m["ddtree_kv_pages_used"] == 0)
    assert m["ddtree_requests_running"] == 0


# ---- API key and queue limit

def test_api_key_is_required_on_v1_but_not_on_health(keyed):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {keyed.key}"},
                    {"Authorization": keyed.key}):
        r = httpx.post(keyed.url + CHAT, json={"messages": MSG}, headers=headers, timeout=REQUEST_S)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(keyed.url + CHAT, json={"messages": MSG, "max_tokens": 2}, timeout=REQUEST_S,
                   headers={"Authorization": f"bearer {keyed.key}"})  # (the scheme is case-insensitive)
    assert r.status_code == 200
    assert httpx.get(keyed.url + "/v1/models", timeout=REQUEST_S).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(keyed.url + "/health", timeout=REQUEST_S).status_code == 200
    r = keyed.client().chat.completions.create(model="keyed", messages=MSG, max_tokens=3)
    assert r.usage.completion_tokens <= 3


def test_requests_beyond_the_queue_limit_get_429(keyed):
    # keyed: --max-num-seqs 1 --max-queue 0, so one request in flight is the limit
    body = {"messages": MSG, "stream": True, "max_tokens": 200, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {keyed.key}"}
    with httpx.Client(timeout=REQUEST_S, headers=headers) as c, c.stream("POST", keyed.url + CHAT, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped line iterator would close the connection early
        next(line for line in lines if line.startswith("data: "))
        busy = keyed.post(CHAT, {"messages": MSG, "max_tokens": 2})
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "queue_full"
        assert busy.headers["retry-after"] == "1"
        with pytest.raises(openai.RateLimitError):
            keyed.client().chat.completions.create(model="keyed", messages=MSG, max_tokens=2)
    keyed.wait_until(lambda m: m["ddtree_kv_pages_used"] == 0)
    deadline = time.monotonic() + 15
    while (r := keyed.post(CHAT, {"messages": MSG, "max_tokens": 2})).status_code == 429:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert r.status_code == 200


@pytest.mark.parametrize("path, field, value", [
    (CHAT, "tools", [{"type": "function"}]), (COMP, "echo", True),
    (COMP, "best_of", 2), (CHAT, "logit_bias", {"5": 10}), (CHAT, "frequency_penalty", -0.5)])
def test_unsupported_openai_fields_are_refused_naming_them(ar, path, field, value):
    body = {"messages": MSG} if path == CHAT else {"prompt": "Hello"}
    r = ar.post(path, {**body, "max_tokens": 2, field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_a_body_over_the_size_limit_gets_413_and_long_stop_lists_get_400(ar):
    # (the default limit, 8 MiB: refused from its Content-Length, before the body is read or tokenized)
    big = ar.post(COMP, {"prompt": "hello world " * 800_000, "max_tokens": 2})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    for stop in (["x"] * 65, "y" * 1025, ["z" * 1025]):
        r = ar.post(COMP, {"prompt": "Hello", "max_tokens": 2, "stop": stop})
        assert r.status_code == 400 and "stop" in r.json()["error"]["message"], r.text
    assert ar.post(COMP, {"prompt": "Hello", "max_tokens": 2, "stop": ["x"] * 64}).status_code == 200


def test_huge_prompts_are_refused_while_running_streams_keep_flowing(ar):
    # A 10 MB body is refused from its Content-Length; a 6 MB prompt (under the body limit) is tokenized
    # off the engine thread and refused as too long for the context. Meanwhile streams run one after
    # another: the gaps between a stream's chunks stay short (no stall while the big requests are handled).
    streams, refused = [], {}
    body = {"prompt": "Hello", "max_tokens": 120, "ignore_eos": True, "temperature": 0, "stream": True}

    def stream():
        deadline = time.monotonic() + REQUEST_S
        while len(refused) < 2 and time.monotonic() < deadline:
            arrivals = []
            with httpx.stream("POST", ar.url + COMP, json=body, timeout=REQUEST_S) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())
            streams.append(arrivals)

    def big(name, words):
        time.sleep(0.3)  # (a stream is running by then)
        t0 = time.monotonic()
        r = ar.post(COMP, {"prompt": "hello world " * words, "max_tokens": 2})
        refused[name] = (r.status_code, t0, time.monotonic())

    threads = [threading.Thread(target=stream), threading.Thread(target=big, args=("10MB", 873_813)),
               threading.Thread(target=big, args=("6MB", 500_000))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_S)
    (code10, start10, end10), (code6, start6, end6) = refused["10MB"], refused["6MB"]
    assert code10 == 413 and end10 - start10 < 0.5 and code6 == 400, refused
    assert streams[0][0] < min(start10, start6) and streams[-1][-1] > max(start10, start6)  # streams ran throughout
    gaps = [b - a for arrivals in streams for a, b in zip(arrivals, arrivals[1:])]
    assert max(gaps) < 0.5, max(gaps)


def test_docs_pages_are_off_unless_asked_for_and_the_schema_is_always_served(ar):
    # (the docs pages load their scripts from a CDN: offline they would not work)
    from fastapi.testclient import TestClient

    from ddtree.server.app import ServerConfig, create_app
    assert httpx.get(ar.url + "/docs", timeout=REQUEST_S).status_code == 404
    assert httpx.get(ar.url + "/openapi.json", timeout=REQUEST_S).status_code == 200

    def never():
        raise FileNotFoundError("no model")

    with TestClient(create_app(never, ServerConfig("m", docs=True), on_fatal=lambda e: None)) as c:
        assert c.get("/docs").status_code == 200 and c.get("/redoc").status_code == 200


def test_unsupported_fields_at_their_defaults_are_accepted(ar):
    r = ar.post(CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": False, "tool_choice": "none", "tools": [],
                       "response_format": {"type": "text"}, "logit_bias": {}, "presence_penalty": 0.0,
                       "frequency_penalty": 0})
    assert r.status_code == 200, r.text
    assert ar.post(COMP, {"prompt": "Hello", "max_tokens": 2, "best_of": 1, "echo": False, "logprobs": 0}).status_code == 200


# ---- logprobs

def test_chat_logprobs_are_the_models_and_speculation_reports_ars(ar, spec):
    # Greedy, so both servers generate the same tokens: the speculative server reads the values off the
    # verified tree, the AR server off its steps. One entry per generated token, each with its top 3.
    body = {"messages": MSG, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 3}
    a, s = ar.post(CHAT, body).json(), spec.post(CHAT, body).json()
    la, ls = a["choices"][0]["logprobs"]["content"], s["choices"][0]["logprobs"]["content"]
    assert len(la) == a["usage"]["completion_tokens"] == 12 and [e["token"] for e in la] == [e["token"] for e in ls]
    for ea, es in zip(la, ls):
        assert ea["logprob"] == pytest.approx(es["logprob"], abs=1e-4) and ea["logprob"] <= 0
        assert len(ea["top_logprobs"]) == 3 and ea["top_logprobs"][0]["logprob"] >= ea["logprob"] - 1e-6
        assert [t["token"] for t in ea["top_logprobs"]] == [t["token"] for t in es["top_logprobs"]]
        assert bytes(ea["bytes"]).decode("utf-8", "replace") == ea["token"] or ea["token"].startswith("bytes:")
    streamed = []
    with httpx.stream("POST", spec.url + CHAT, json={**body, "stream": True}, timeout=REQUEST_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0].get("logprobs")
                streamed += lp["content"] if lp else []
    assert streamed == ls
    plain = ar.post(CHAT, {**body, "logprobs": False, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_completion_logprobs_columns_line_up_with_the_text(ar):
    body = {"prompt": "def add(a, b):", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    r = ar.post(COMP, body).json()
    lp = r["choices"][0]["logprobs"]
    n = r["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert all(len(top) <= 2 and max(top.values()) >= v - 1e-6 for top, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert ar.post(COMP, {**body, "logprobs": 0}).json()["choices"][0]["logprobs"]["top_logprobs"] == [{}] * n


# ---- metrics

def test_metrics_count_requests_tokens_latency_and_speculation(spec):
    spec.client().chat.completions.create(model="tiny-qwen3", messages=MSG, **GREEDY)
    m = spec.wait_until(lambda m: m["ddtree_kv_pages_used"] == 0)
    assert m['ddtree_requests_total{finish_reason="length"}'] >= 1
    assert m["ddtree_prompt_tokens_total"] > 0 and m["ddtree_generation_tokens_total"] >= 24
    assert m["ddtree_time_to_first_token_seconds_count"] >= 1 and m["ddtree_inter_token_latency_seconds_count"] >= 23
    steps = m["ddtree_spec_verify_steps_total"]
    assert steps > 0 and m["ddtree_spec_drafted_tokens_total"] == 8 * steps  # budget 8
    assert 0 <= m["ddtree_spec_accepted_tokens_total"] <= m["ddtree_spec_drafted_tokens_total"]
    # committed per step = accepted drafts + 1 bonus token, less any cut by max_tokens or a stop
    assert m["ddtree_spec_acceptance_length_count"] == steps
    assert steps <= m["ddtree_spec_acceptance_length_sum"] <= steps + m["ddtree_spec_accepted_tokens_total"]


@pytest.mark.parametrize("which", ["ar", "spec"])
def test_a_repeated_prefix_comes_from_the_prefix_cache_with_the_same_answer(which, servers, tokenizer):
    server = servers[which]
    system = {"role": "system", "content": "You answer in one short line. " * 2}
    first = [system, {"role": "user", "content": "Name a colour."}]
    second = [system, {"role": "user", "content": "Name a fruit."}]
    before = server.metrics()
    hits_before = before.get("ddtree_prefix_cache_hit_tokens_total", 0)
    a = server.client().chat.completions.create(model="tiny-qwen3", messages=first, **GREEDY)
    b = server.client().chat.completions.create(model="tiny-qwen3", messages=second, **GREEDY)
    again = server.client().chat.completions.create(model="tiny-qwen3", messages=first, **GREEDY)
    ids_a, ids_b = chat_ids(tokenizer, first), chat_ids(tokenizer, second)
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)  # the common prefix, in tokens
    assert shared >= 32 and a.usage.prompt_tokens == len(ids_a)
    # whole 16-token pages of the common prefix; the repeat, every page before its last token
    assert b.usage.prompt_tokens_details.cached_tokens == shared // 16 * 16
    assert again.usage.prompt_tokens_details.cached_tokens == (len(ids_a) - 1) // 16 * 16
    assert again.choices[0].message.content == a.choices[0].message.content
    m = server.wait_until(lambda m: m["ddtree_kv_pages_used"] == 0)
    assert m["ddtree_prefix_cache_hit_tokens_total"] - hits_before >= shared // 16 * 16 + (len(ids_a) - 1) // 16 * 16
    assert m["ddtree_prefix_cache_pages"] > 0


# ---- schemathesis: generated valid and invalid requests for every operation conform to the schema

def test_schemathesis_generated_requests_get_what_the_schema_says(ar):
    # Every check: no 5xx, status codes, content types, headers, response bodies and SSE events as
    # documented, invalid input refused, and valid input accepted, except where the loaded model sets
    # the limit (its context length and its vocabulary, which no schema can state in tokens) and where a
    # structure (regex, grammar, JSON schema) does not compile, which no schema of strings can state: a
    # valid request over them gets a 400 that says so.
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(ar.url + "/openapi.json")
    calls = []
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            def check(case):
                response = case.call_and_validate(timeout=REQUEST_S,
                                                  excluded_checks=[schemathesis.checks.positive_data_acceptance])
                calls.append(response.status_code)
                if mode is GenerationMode.POSITIVE and response.status_code in (400, 422):
                    message = response.json()["error"]["message"]
                    assert any(m in message for m in ("context limit", "out of range", "does not compile")), \
                        (case.body, message)
            try:
                check()
            except Unsatisfiable:  # nothing invalid to generate (an operation without parameters)
                assert mode is GenerationMode.NEGATIVE
    assert len(calls) > 100 and 200 in calls and 400 in calls
    assert ar.post(COMP, {"prompt": "hi", "max_tokens": 2}).status_code == 200


# ---- the last test of the tensor-parallel server: it loses a worker

def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                if d.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return out


def test_a_tensor_parallel_server_that_loses_a_worker_fails_its_requests_and_exits(tp):
    (worker,) = [p for p in children(tp.proc.pid) if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
    assert tp.post(COMP, {"prompt": "hi", "max_tokens": 2}).status_code == 200
    os.kill(worker, signal.SIGKILL)
    r = tp.post(COMP, {"prompt": "hi", "max_tokens": 2})
    assert r.status_code >= 500 and "rank 1 exited" in r.json()["error"]["message"], r.text
    assert tp.proc.wait(timeout=30) == 1


# ---- in-process: loading states without a subprocess

def test_app_answers_503_until_loaded_and_reports_a_failed_load(tiny_qwen2):
    from fastapi.testclient import TestClient

    from ddtree.llm import LLM
    from ddtree.server.app import ServerConfig, create_app

    gate = threading.Event()

    def load():
        assert gate.wait(30)
        return LLM(tiny_qwen2, device="cpu", dtype="float32", num_pages=32)

    with TestClient(create_app(load, ServerConfig("m"))) as c:
        assert c.get("/health").status_code == 503 and c.get("/health").json()["status"] == "loading"
        r = c.post(CHAT, json={"messages": MSG})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        gate.set()
        deadline = time.monotonic() + 30
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = c.post(COMP, json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3

    fatal = []

    def broken():
        raise FileNotFoundError("no model at /nowhere")

    with TestClient(create_app(broken, ServerConfig("m"), on_fatal=fatal.append)) as c:
        deadline = time.monotonic() + 10
        while not fatal:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "failed" and "/nowhere" in h.json()["error"]
        assert isinstance(fatal[0], FileNotFoundError)


def test_serve_rejects_a_speculative_mode_without_a_drafter_for_other_models_than_the_default(tiny_qwen2):
    # (the default model has its own drafter: `--spec ddtree` alone serves it)
    r = subprocess.run([sys.executable, "-m", "ddtree.cli", "serve", "--model", tiny_qwen2, "--spec", "ddtree"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--draft" in r.stderr


def test_graphed_ar_bursts_behind_the_server_stream_the_same_text(tiny_qwen2, monkeypatch):
    # The GPU's pipelined AR bursts (CUDA graphs emulated on the CPU) behind the OpenAI API: streamed and
    # non-streamed requests, running together, with a stop string, give what the eager engine gives;
    # afterwards every KV page is free.
    from fastapi.testclient import TestClient

    from ddtree.llm import LLM
    from ddtree.server.app import ServerConfig, create_app
    from emulated import fake_gpu_graphs

    def llm():
        return LLM(tiny_qwen2, device="cpu", dtype="float32", num_pages=64, page_size=4, max_num_seqs=3)

    bodies = [{"prompt": f"for i in range({n}):", "max_tokens": n, "temperature": 0, "ignore_eos": True}
              for n in (5, 19, 33)] + [{"prompt": "Hello", "max_tokens": 30, "temperature": 0, "stop": ["e"]}]
    def ready(c):
        deadline = time.monotonic() + 30
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        return c

    with TestClient(create_app(llm, ServerConfig("m"))) as c:
        want = [ready(c).post(COMP, json=b).json()["choices"][0] for b in bodies]
    fake_gpu_graphs(monkeypatch)
    loaded = []
    with TestClient(create_app(lambda: loaded.append(llm()) or loaded[0], ServerConfig("m"))) as c:
        ready(c)

        def stream(body):
            text, finish = "", None
            with c.stream("POST", COMP, json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        text += choice["text"]
                        finish = choice["finish_reason"] or finish
            return {"text": text, "finish_reason": finish}

        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(len(bodies)) as pool:  # all at once: they share bursts
            got = list(pool.map(stream, bodies))
        engine = loaded[0].engine
        assert engine.ar.decode_graphs is not None and engine.ar.burst_steps > 1
        deadline = time.monotonic() + 10
        while engine.allocator.num_free != engine.allocator.num_pages:
            assert time.monotonic() < deadline, "KV pages still held"
            time.sleep(0.02)
    assert [(g["text"], g["finish_reason"]) for g in got] == [(w["text"], w["finish_reason"]) for w in want]


def test_logprob_offsets_skip_every_special_token_the_text_leaves_out(tiny_qwen2):
    # Tokens marked special but not in the special-tokens map (as Llama 3's reserved ones) are left out
    # of the text too: zero-width in text_offset, named in the token list.
    from tokenizers import AddedToken

    from ddtree.llm import load_tokenizer
    from ddtree.server.logprobs import CompletionOffsets, TokenText, completion_logprobs
    tok = load_tokenizer(tiny_qwen2)
    tok.add_tokens([AddedToken("<|reserved_0|>", special=True)])
    reserved = tok.convert_tokens_to_ids("<|reserved_0|>")
    assert reserved not in tok.all_special_ids
    ids = tok.encode("Hello") + [reserved] + tok.encode(" world")
    lp = completion_logprobs(TokenText(tok), [(i, -1.0, []) for i in ids], CompletionOffsets())
    text = tok.decode(ids, skip_special_tokens=True)
    assert lp.tokens[len(tok.encode("Hello"))] == "<|reserved_0|>"
    assert [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens) if t != "<|reserved_0|>"] == \
        [t for t in lp.tokens if t != "<|reserved_0|>"]


ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer", "n"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # (a random model would fill every gap's allowed whitespace)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema_gives_that_json_and_speculation_gives_ars(stream, ar, spec):
    # A random tiny model writes JSON only because every token is masked to the schema; the speculative
    # server's greedy text equals the AR server's, streamed or not.
    def ask(server) -> tuple[str, str]:
        kw = dict(model="tiny-qwen3", messages=MSG, max_tokens=60, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": ANSWER}})
        if not stream:
            choice = server.client().chat.completions.create(**kw).choices[0]
            return choice.message.content, choice.finish_reason
        parts, finish = [], None
        for chunk in server.client().chat.completions.create(stream=True, **kw):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    text, finish = ask(ar)
    assert finish == "stop", text
    value = json.loads(text)
    assert value["answer"] in ("yes", "no") and isinstance(value["n"], int) and set(value) == {"answer", "n"}
    assert ask(spec) == (text, finish)


def test_json_object_and_regex_requests_follow_their_structure(ar):
    r = ar.post(COMP, {"prompt": "hi", "max_tokens": 30, "regex": "(yes|no), [a-z]{1,5}\\.", "seed": 3})
    assert r.status_code == 200 and re.fullmatch("(yes|no), [a-z]{1,5}\\.", r.json()["choices"][0]["text"]), r.text
    r = ar.post(CHAT, {"messages": MSG, "max_tokens": 40, "response_format": {"type": "json_object"}})
    text = r.json()["choices"][0]["message"]["content"]
    assert r.status_code == 200 and text.lstrip().startswith("{")
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
