"""The FastAPI app (OpenAI routes over an AsyncEngine) and `serve(args)`, which runs it with uvicorn.

The HTTP server starts at once and loads the model in the background: `/health` answers 503 until
the engine can generate. Every error, bad input included, is answered in the OpenAI shape
`{"error": {"message", "type", "param", "code"}}`; invalid input is a 400, never a 5xx. With an API
key, `/v1/*` needs `Authorization: Bearer KEY`; `/health`, `/metrics` and `/openapi.json` stay open. The
interactive docs pages load their scripts from a CDN, which an offline deployment cannot reach: they
are served only with `--docs`.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ddtree.sampling_params import SamplingParams
from ddtree.server import protocol as P
from ddtree.server.async_engine import AsyncEngine, Delta, RequestStream
from ddtree.server.logprobs import CompletionOffsets, TokenText, chat_logprobs, completion_logprobs
from ddtree.server.metrics import Metrics
from ddtree.server.protocol import APIError

ERRORS = {s: {"model": P.ErrorResponse} for s in (400, 401, 413, 429, 503)}


def answers(model: type, chunk: str) -> dict:
    """The OpenAPI responses of a completion route: `model` as JSON, or with `stream` server-sent events
    (the schema describes one event, as OpenAPI 3.1 has it): `chunk`s as JSON, then `[DONE]`."""
    data = {"type": "string", "contentMediaType": "application/json",
            "description": f"a {chunk} as JSON (an error object if the engine fails mid-stream), then [DONE]"}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {**ERRORS, 404: {"model": P.ErrorResponse},  # (a model this server does not serve)
            200: {"model": model, "content": {"text/event-stream": {"schema": event}}}}


@dataclass(slots=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_queue: int | None = None  # requests waiting beyond max_num_seqs; more get 429
    max_request_bytes: int = 8 * 2**20  # larger request bodies get 413 before they are read
    docs: bool = False  # serve /docs and /redoc (their scripts come from a CDN)


@dataclass(slots=True)
class Result:
    text: str
    finish_reason: str | None
    accept_lengths: list[int]
    logprobs: list | None  # the tokens' records, with logprobs (server/logprobs.py `Record`)


class BearerAuth:
    """ASGI middleware: 401 on /v1/* without the key (before the body is read, so even bad JSON gets 401)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            # (the scheme is case-insensitive, RFC 9110; the key is compared in constant time)
            if not (secrets.compare_digest(given.strip(), self.key) and scheme.lower() == b"bearer"):
                err = APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                               code="invalid_api_key")
                return await JSONResponse(err.body(), 401)(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: 413 for a request body over `limit` bytes, from its Content-Length before it is read,
    or as soon as a body without one has sent that much (no large prompt reaches the tokenizer)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await JSONResponse(self._error(int(length)).body(), 413)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise self._error(seen)
            return message

        await self.app(scope, counted, send)

    def _error(self, size: int) -> APIError:
        return APIError(413, f"request body of {size} bytes is over the limit of {self.limit} "
                             "(ddtree serve --max-request-bytes)", code="request_too_large")


class SSEResponse(StreamingResponse):
    """Closes its generator however the response ends, so a client gone mid-stream aborts its request."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def create_app(load: Callable[[], object], cfg: ServerConfig,
               on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    """`load()` builds the LLM; it runs on the engine thread after the server has started."""
    metrics = Metrics()
    engine = AsyncEngine(load, metrics, cfg.max_queue, on_fatal)
    started = time.time()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    docs = {} if cfg.docs else {"docs_url": None, "redoc_url": None}
    app = FastAPI(title="ddtree", summary="OpenAI-compatible server with DFlash/DDTree speculative decoding",
                  version="0.1.0", lifespan=lifespan, **docs)
    app.state.engine = engine
    app.add_middleware(BodyLimit, limit=cfg.max_request_bytes)
    if cfg.api_key:
        app.add_middleware(BearerAuth, key=cfg.api_key)
    _install_error_handlers(app)

    @app.get("/health", response_model=P.Health, responses={503: {"model": P.Health}})
    async def health() -> JSONResponse:
        if engine.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "failed" if engine.error else "loading", "error": engine.error}, 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {"description": "Prometheus text format"}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    def card() -> P.ModelCard:
        llm = engine.llm
        if llm is None:
            return P.ModelCard(id=cfg.model_name, created=int(started))
        dev = llm.device
        spec = P.ServedSpec(spec=llm.spec, budget=llm.budget, topk=llm.topk,
                            max_num_seqs=llm.engine.scheduler.max_num_seqs,
                            prefix_caching=llm.engine.allocator.prefix_caching,
                            device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type)
        return P.ModelCard(id=cfg.model_name, created=int(started), max_model_len=llm.engine.max_model_len,
                           ddtree=spec)

    @app.get("/v1/models", responses=ERRORS)
    async def models() -> P.ModelList:
        return P.ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", responses={**ERRORS, 404: {"model": P.ErrorResponse}})
    async def model(model_id: str) -> P.ModelCard:
        if model_id != cfg.model_name:
            raise APIError(404, f"model {model_id!r} not found; this server serves {cfg.model_name!r}",
                           param="model", code="model_not_found")
        return card()

    @app.post("/v1/chat/completions", response_model=None,
              responses=answers(P.ChatCompletionResponse, "ChatCompletionChunk"))
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await respond(req, P.chat_prompt(req), max_tokens, request, chat=True)

    @app.post("/v1/completions", response_model=None, responses=answers(P.CompletionResponse, "CompletionResponse"))
    async def completions(req: P.CompletionRequest, request: Request):
        return await respond(req, P.completion_prompt(req.prompt), req.max_tokens, request, chat=False)

    async def respond(req: P.SamplingRequest, prompt: P.Prompt, max_tokens: int | None, request: Request, chat: bool):
        engine.check_ready()
        if req.model is not None and req.model != cfg.model_name:
            raise APIError(404, f"model {req.model!r} not found; this server serves {cfg.model_name!r}",
                           param="model", code="model_not_found")
        params = P.sampling_params(req, engine.llm.config.vocab_size)
        streams: list[RequestStream] = []  # one request a choice
        try:
            for i in range(req.n or 1):
                streams.append(await engine.submit(prompt, choice_params(params, i), max_tokens))
        except BaseException:
            for st in streams:
                st.abort()
            raise
        head = dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()),
                    model=cfg.model_name)
        offsets = [CompletionOffsets() for _ in streams]

        def logprobs(i: int, records: list | None):  # choice i's records in the endpoint's shape
            if records is None:
                return None
            text = token_text()
            return chat_logprobs(text, records) if chat else completion_logprobs(text, records, offsets[i])

        if not req.stream:
            try:
                results = await asyncio.gather(*(collect(st, request) for st in streams))
            finally:
                for st in streams:
                    st.abort()  # (a no-op once finished: the others of a choice that failed)
            tail = dict(usage=usage(streams), ddtree=spec_info([a for r in results for a in r.accept_lengths]))
            if chat:
                choices = [P.ChatChoice(index=i, message=P.ChatMessageOut(content=r.text), finish_reason=r.finish_reason,
                                        logprobs=logprobs(i, r.logprobs)) for i, r in enumerate(results)]
                return P.ChatCompletionResponse(**head, **tail, choices=choices)
            choices = [P.CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason,
                                          logprobs=logprobs(i, r.logprobs)) for i, r in enumerate(results)]
            return P.CompletionResponse(**head, **tail, choices=choices)
        Chunk = P.ChatCompletionChunk if chat else P.CompletionResponse

        def chunk(i: int, text: str | None, finish: str | None = None, accepts: list[int] | None = None,
                  records: list | None = None):
            choice = P.ChatChunkChoice(index=i, delta=P.ChatDelta(content=text), finish_reason=finish,
                                       logprobs=logprobs(i, records)) if chat else \
                P.CompletionChoice(index=i, text=text or "", finish_reason=finish, logprobs=logprobs(i, records))
            return Chunk(**head, choices=[choice], ddtree=spec_info(accepts))

        async def events():
            if chat:
                for i in range(len(streams)):
                    yield Chunk(**head, choices=[P.ChatChunkChoice(index=i, delta=P.ChatDelta(role="assistant",
                                                                                               content=""))])
            async for i, d in merged(streams):
                if d.error is not None:
                    yield P.ErrorResponse(error=P.ErrorInfo(message=d.error, type="server_error"))
                    return
                if d.text or (d.logprobs and d.finish_reason is None):
                    yield chunk(i, d.text, records=d.logprobs)
                if d.finish_reason is not None:
                    yield chunk(i, None, d.finish_reason, d.accept_lengths, None if d.text else d.logprobs)
            if req.include_usage:
                yield Chunk(**head, choices=[], usage=usage(streams))
        return SSEResponse(sse(streams, events()), media_type="text/event-stream")

    texts: list[TokenText] = []

    def token_text() -> TokenText:  # (built once the model has loaded: it needs the tokenizer)
        if not texts:
            texts.append(TokenText(engine.llm.tokenizer))
        return texts[0]

    def spec_info(accepts: list[int] | None) -> P.SpecInfo | None:
        if accepts is None:
            return None
        mean = sum(accepts) / len(accepts) if accepts else None
        return P.SpecInfo(spec=engine.llm.spec, accept_lengths=accepts, mean_accept_length=mean)

    return app


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i's params: a seeded request's choice i draws with seed + i (so choice 0 is the request's own)."""
    return params if i == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + i)


def usage(streams: list[RequestStream]) -> P.Usage:
    """The prompt's tokens once (and those the first choice found in the prefix cache), every choice's output."""
    first, n = streams[0], sum(st.completion_tokens for st in streams)
    return P.Usage(prompt_tokens=first.prompt_tokens, completion_tokens=n, total_tokens=first.prompt_tokens + n,
                   prompt_tokens_details=P.PromptTokensDetails(cached_tokens=first.cached_tokens))


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Delta]]:
    """The choices' deltas as they come, each with its choice's index."""
    if len(streams) == 1:  # (no tasks for the common case)
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, st: RequestStream):
        try:
            async for d in st:
                queue.put_nowait((i, d))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, d = await queue.get()
            if d is None:
                left -= 1
            else:
                yield i, d
    finally:
        for t in tasks:
            t.cancel()


async def collect(stream: RequestStream, request: Request) -> Result:
    """All of a request's deltas; aborts it if the client disconnects (or the server stops) first."""
    parts: list[str] = []
    records: list | None = None
    nxt = asyncio.ensure_future(stream.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=1.0)
            if not done:
                if await request.is_disconnected():
                    raise APIError(499, "client disconnected")
                continue
            d: Delta = nxt.result()
            if d.error is not None:
                raise APIError(500, d.error, "server_error")
            parts.append(d.text)
            if d.logprobs is not None:
                records = records or []
                records.extend(d.logprobs)
            if d.finish_reason is not None:
                return Result("".join(parts), d.finish_reason, d.accept_lengths or [], records)
            nxt = asyncio.ensure_future(stream.__anext__())
    finally:
        nxt.cancel()
        stream.abort()  # a no-op once finished


async def sse(streams: list[RequestStream], events: AsyncIterator) -> AsyncIterator[str]:
    try:
        async for event in events:
            drop = {"ddtree"} if getattr(event, "ddtree", 0) is None else None
            yield f"data: {event.model_dump_json(exclude=drop)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for st in streams:
            st.abort()  # a no-op once finished; frees the pages of a request whose client left


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        ctype = request.headers.get("content-type", "")
        media = ctype.split(";")[0].strip().lower()
        if not (media == "application/json" or (media.startswith("application/") and media.endswith("+json"))):
            msg = f"expected Content-Type application/json, got {ctype or 'none'}: the body must be a JSON object"
            return JSONResponse(APIError(400, msg).body(), 400)
        errs = e.errors()
        # (the deepest error: of a union's members, the one that matched furthest says what is wrong)
        first = max(errs, key=lambda err: len(err.get("loc", ())), default={})
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg, param = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
        else:  # param: the top-level field; the message names the exact place (union members included)
            param = loc[0] if loc else None
            msg = f"{'.'.join(loc)}: {first.get('msg')}" if loc else str(first.get("msg", "invalid request"))
            if len(errs) > 1:
                msg += f" (and {len(errs) - 1} more)"
        return JSONResponse(APIError(400, msg, param=param).body(), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), kind).body(), e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, f"internal server error: {type(e).__name__}", "server_error").body(), 500)


def default_model_name(model: str | None) -> str:
    from ddtree.models.hub import DEFAULT_MODEL
    if model is None:
        return DEFAULT_MODEL
    name = os.path.basename(os.path.normpath(model))
    return name[:-5] if name.endswith(".gguf") else name


def serve(args) -> int:
    """Runs the server until interrupted; returns 1 if the model failed to load."""
    import uvicorn

    from ddtree.cli import parallel_from_args
    from ddtree.llm import LLM

    def load():
        llm = LLM(args.model, draft=args.draft, spec=args.spec, budget=args.budget, topk=args.topk,
                  device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs, num_pages=args.num_pages,
                  max_model_len=args.max_model_len, parallel=parallel_from_args(args),
                  enable_prefix_caching=args.enable_prefix_caching,
                  prefix_state_snapshots=args.prefix_state_snapshots)
        # The server keeps this one engine for its life: what exists now is never garbage, and frozen it
        # is not walked by every full collection (hundreds of thousands of objects with the default pair),
        # which would stall the engine loop mid-stream.
        gc.collect()
        gc.freeze()
        return llm

    failed: list[BaseException] = []

    def on_fatal(e: BaseException) -> None:
        failed.append(e)
        server.should_exit = True

    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)  # our log lines formatted like uvicorn's
    log_config["loggers"]["ddtree.server"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    cfg = ServerConfig(args.served_model_name or default_model_name(args.model), args.api_key, args.max_queue,
                       args.max_request_bytes, args.docs)
    server = uvicorn.Server(uvicorn.Config(create_app(load, cfg, on_fatal), host=args.host, port=args.port,
                                           log_config=log_config, timeout_graceful_shutdown=5))
    server.run()
    return 1 if failed else 0
