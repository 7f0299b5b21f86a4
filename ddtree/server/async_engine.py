"""The engine on one background thread, bridged to asyncio.

The engine is not thread-safe, so everything that touches it (loading, add, abort, step) runs on the
engine thread. Prompts are tokenized (chat template included) on one worker thread of their own, so a
large prompt never stalls the running streams. The event loop talks to the engine thread through an
inbox of commands; the engine thread answers through each request's asyncio queue (via
`call_soon_threadsafe`):

    submit() -> tokenize (worker) -> ("add", stream) -> add_request -> stream.added resolves (prompt tokens or error)
    loop: drain inbox -> engine.step() -> for each request with new tokens: Delta(text, ...) -> stream.queue
    stream.abort() (client gone) -> ("abort", stream) -> engine.abort(seq): its KV pages are freed

Text is released as `seq.text` grows, except that a running request with stop strings holds back
its last (longest stop string - 1) characters, so a stop string is never partly streamed.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ddtree.parallel.workers import WorkerError
from ddtree.sampling_params import SamplingParams
from ddtree.server.metrics import Metrics
from ddtree.server.protocol import APIError, Prompt, valid_unicode

log = logging.getLogger("ddtree.server")


@dataclass(slots=True)
class Delta:
    text: str  # new text since the previous delta
    num_tokens: int  # generated tokens so far
    finish_reason: str | None = None  # set on the last delta
    accept_lengths: list[int] | None = None  # on the last delta: tokens committed per verify step
    cached_tokens: int = 0  # on the last delta: prompt tokens whose K/V came from the prefix cache
    error: str | None = None  # the engine failed; also the last delta
    # A request with logprobs: a record per token generated since the previous delta (token id,
    # log-probability, the most likely tokens with theirs), server/logprobs.py `Record`
    logprobs: list | None = None


class RequestStream:
    """One request: an async iterator of Deltas. The fields after `queue` belong to the engine thread."""

    def __init__(self, owner: AsyncEngine, prompt: Prompt, params: SamplingParams, max_tokens: int | None):
        self.owner, self.prompt, self.params, self.max_tokens = owner, prompt, params, max_tokens
        self.arrival = time.perf_counter()
        self.added: asyncio.Future[int] = owner.loop.create_future()  # -> number of prompt tokens
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.done = False
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.seq = None
        self.ids: list[int] = []  # the prompt's tokens, from the tokenizing thread
        self.sent = self.seen_tokens = self.seen_accepts = self.sent_logprobs = 0
        self.last = self.arrival
        self.holdback = max(map(len, params.stop), default=1) - 1

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self.done:
            raise StopAsyncIteration
        delta = await self.queue.get()
        self.completion_tokens = delta.num_tokens
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        if delta.finish_reason is not None or delta.error is not None:
            self._release()
        return delta

    def abort(self) -> None:
        """Stop generating (the client went away); a no-op once the request has finished."""
        if not self.done:
            self._release()
            self.owner.post(("abort", self))

    def _release(self) -> None:
        if not self.done:
            self.done = True
            self.owner.num_active -= 1


class AsyncEngine:
    def __init__(self, load: Callable[[], object], metrics: Metrics, max_queue: int | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self._load, self.metrics, self.max_queue, self._on_fatal = load, metrics, max_queue, on_fatal
        self.llm = None  # set by the engine thread once loaded; read-only elsewhere
        self.ready = False
        self.error: str | None = None
        self.num_active = 0  # event loop only: submitted and not finished or aborted
        self.loop: asyncio.AbstractEventLoop | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # One thread: tokenizers are not safe to call from several threads at once.
        self._tokenizer = ThreadPoolExecutor(1, thread_name_prefix="ddtree-tokenize")
        self._active: list[RequestStream] = []  # engine thread only
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- event loop side
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread = threading.Thread(target=self._run, name="ddtree-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._tokenizer.shutdown(wait=False, cancel_futures=True)
        self.post(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def post(self, cmd) -> None:
        self._inbox.put(cmd)

    def check_ready(self) -> None:
        if not self.ready:
            raise APIError(503, self.error or "the model is still loading", "service_unavailable")

    async def submit(self, prompt: Prompt, params: SamplingParams, max_tokens: int | None) -> RequestStream:
        """Queues a request; raises APIError (400 bad prompt, 429 queue full, 503 not ready)."""
        self.check_ready()
        limit = None if self.max_queue is None else self.llm.engine.scheduler.max_num_seqs + self.max_queue
        if limit is not None and self.num_active >= limit:
            raise APIError(429, f"server busy: {self.num_active} requests in flight (limit {limit}); retry later",
                           "rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"})
        stream = RequestStream(self, prompt, params, max_tokens)
        self.num_active += 1
        try:
            stream.ids = await self.loop.run_in_executor(self._tokenizer, self._encode, prompt)
        except BaseException as e:  # (a client gone while its prompt is tokenized, too: released)
            stream._release()
            if isinstance(e, Exception):  # anything the input provokes here is the input's fault
                raise APIError(400, str(e) or type(e).__name__, param=prompt.param) from None
            raise
        self.post(("add", stream))
        try:
            stream.prompt_tokens = await stream.added
        except BaseException:
            stream.abort()  # cancelled while queued: withdraw it; a rejected prompt is already released
            raise
        return stream

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # ---- engine thread
    def _run(self) -> None:
        try:
            log.info("loading the model ...")
            self.llm = self._load()
        except BaseException as e:  # noqa: BLE001 - reported to the server, which exits
            log.exception("loading the model failed")
            self.error = f"loading the model failed: {e}"
            if self._on_fatal is not None:
                self._call(self._on_fatal, e)
            return
        engine = self.llm.engine
        engine.grammars.prepare()  # (structured output's view of the tokenizer, before the first request)
        self.ready = True
        log.info(f"model loaded: {self.llm.model_path} (spec {self.llm.spec}); ready")
        self.metrics.engine_state(engine)
        while not self._stopping:
            self._drain(engine, block=not engine.has_work())
            if engine.has_work() and not self._stopping:
                try:
                    engine.step()
                except WorkerError as e:  # a tensor-parallel rank is gone: nothing more can run; the server exits
                    log.error(str(e))
                    self._fail_all(engine, f"engine error: {e}")
                    self.ready, self.error = False, str(e)
                    if self._on_fatal is not None:
                        self._call(self._on_fatal, e)
                    self.llm.close()
                    return
                except Exception as e:  # noqa: BLE001 - a bug must not take the server down
                    log.exception("engine step failed")
                    self._fail_all(engine, f"engine error: {e}")
                self._publish()
            self.metrics.engine_state(engine, self._inbox.qsize())
        for st in self._active:
            engine.abort(st.seq)
            self._push(st, Delta("", st.seen_tokens, "abort", list(st.seq.accept_lengths)))
        self._active.clear()
        self.llm.close()  # (tensor parallelism: the workers stop)

    def _drain(self, engine, block: bool) -> None:
        while True:
            try:
                cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd is None:
                return
            block = False
            op, st = cmd
            if op == "add":
                self._add(engine, st)
            elif st in self._active:  # abort
                engine.abort(st.seq)
                self._active.remove(st)
                self.metrics.requests.labels("abort").inc()
            self.metrics.engine_state(engine, self._inbox.qsize())

    def _add(self, engine, st: RequestStream) -> None:
        try:
            ids = st.ids
            limit = engine.max_model_len
            if st.max_tokens is not None and len(ids) < limit and len(ids) + st.max_tokens > limit:
                raise APIError(400, f"max_tokens={st.max_tokens} plus the prompt's {len(ids)} tokens exceed the "
                                    f"context limit of {limit} tokens", param="max_tokens")
            st.params.max_tokens = st.max_tokens or max(1, limit - len(ids))  # default: the rest of the context
            st.seq = engine.add_request(ids, st.params)
        except Exception as e:  # noqa: BLE001 - anything the input provokes here is the input's fault
            err = e if isinstance(e, APIError) else APIError(400, str(e) or type(e).__name__, param=st.prompt.param)
            self._call(_settle, st, None, err)
            return
        self._active.append(st)
        self.metrics.prompt_tokens.inc(len(ids))
        self._call(_settle, st, len(ids), None)

    def _encode(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            for i, m in enumerate(prompt.messages):
                valid_unicode(m["content"], f"messages[{i}].content")
            return self.llm.encode_chat(prompt.messages)
        if prompt.text is not None:
            valid_unicode(prompt.text, "prompt")
            if self.llm.tokenizer is None:
                raise ValueError("this model has no tokenizer: send the prompt as token ids")
            return self.llm.tokenizer.encode(prompt.text)
        return list(prompt.ids)

    def _publish(self) -> None:
        now = time.perf_counter()
        for st in list(self._active):
            seq = st.seq
            n, finished = len(seq.output_ids), seq.is_finished
            if n == st.seen_tokens and not finished:
                continue
            if n > st.seen_tokens:
                self.metrics.tokens(n - st.seen_tokens, st.seen_tokens == 0, now - st.last)
                st.seen_tokens, st.last = n, now
            for a in seq.accept_lengths[st.seen_accepts:]:
                self.metrics.accept_length.observe(a)
            st.seen_accepts = len(seq.accept_lengths)
            end = len(seq.text) if finished else len(seq.text) - st.holdback
            text = seq.text[st.sent:end] if end > st.sent else ""
            st.sent = max(st.sent, end)
            records = None
            if seq.logprobs is not None and (finished or text):  # (each token's record goes with a delta)
                records = [(seq.output_ids[j], *seq.logprobs[j]) for j in range(st.sent_logprobs, n)]
                st.sent_logprobs = n
            if finished:
                self._active.remove(st)
                self.metrics.requests.labels(seq.finish_reason).inc()
                self._push(st, Delta(text, n, seq.finish_reason, list(seq.accept_lengths),
                                     seq.num_cached_prompt or 0, logprobs=records))
            elif text:
                self._push(st, Delta(text, n, logprobs=records))

    def _fail_all(self, engine, message: str) -> None:
        for st in self._active:
            try:
                engine.abort(st.seq)
            except Exception:  # noqa: BLE001 - best effort: the engine is already in trouble
                log.exception("abort after a failed step")
            self.metrics.requests.labels("error").inc()
            self._push(st, Delta("", st.seen_tokens, error=message))
        self._active.clear()
        engine.allocator.clear_cache()  # (the failed step may have left entries half written)

    def _push(self, st: RequestStream, delta: Delta) -> None:
        self._call(st.queue.put_nowait, delta)


def _settle(st: RequestStream, prompt_tokens: int | None, error: Exception | None) -> None:
    """Resolves `st.added` on the event loop; a rejected request no longer counts as in flight."""
    if error is not None:
        st._release()
    if st.added.done():  # the submitter was cancelled
        return
    if error is not None:
        st.added.set_exception(error)
    else:
        st.added.set_result(prompt_tokens)
