"""Request and response bodies in the OpenAI shapes (chat completions, completions, models, errors).

The request models are strict and are the OpenAPI schema: numbers and booleans must be JSON numbers and
booleans (no "5" or true for an integer), roles and content parts are enums, `null` is declared
wherever it is taken (it means the default, as in the OpenAI API), and ranges the engine cannot take
are declared, so bad input comes back as HTTP 400 before it reaches the engine. What the schema cannot
say depends on the loaded model (the context length, the vocabulary) and is checked on the engine
thread, also as a 400. Unknown request fields are ignored, as OpenAI clients send many optional ones;
fields of the OpenAI API that this server does not implement get a 400 naming them when they ask for
something (`UNSUPPORTED`), rather than a silent default. `top_k` and
`ignore_eos` are extensions (as in vLLM); responses carry a `ddtree` extension with the request's
speculative decoding stats.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import combinations
from typing import Annotated, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, WithJsonSchema, model_serializer,
                      model_validator)

from ddtree.sampling_params import SamplingParams

MAX_CHOICES = 16  # `n`: choices a request may ask for (each is a request of its own to the engine)
# A request's seed: an integer JSON carries exactly everywhere (|n| < 2^53; clients in JavaScript and
# schema-driven generators compare larger bounds as floats, whose rounding lets 2^63 + 1 pass as 2^63).
MAX_SEED = 2**53 - 1


class APIError(Exception):
    """An error answered in the OpenAI shape with HTTP `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Strict(BaseModel):
    """A request body: JSON types exactly (strict), unknown fields ignored."""
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool | None = False


def _integral(value):
    """A JSON number with no fraction (5.0) is an integer, as JSON Schema says; strings and booleans are not."""
    return int(value) if type(value) is float and value.is_integer() else value


def Integer(**bounds):
    """An integer field: strict (no "5", no true), but 5.0 is 5, so that the schema's "integer" is what is
    accepted. The bounds sit on the integer itself, where the schema shows them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


MAX_STOPS, MAX_STOP_CHARS = 64, 1024  # stop strings a request may give, and the characters of each

# OpenAI request fields without an implementation here: a request that sets one to anything but what
# the default does (`_unset`) gets a 400.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "echo", "best_of", "suffix",
               "logit_bias", "presence_penalty", "frequency_penalty")
MAX_CHAT_LOGPROBS, MAX_COMPLETION_LOGPROBS = 20, 5  # top tokens a request may see per position, as in OpenAI


def _unset(name: str, value) -> bool:
    """Whether `value` asks for nothing beyond the default (e.g. echo false, best_of 1, presence_penalty 0,
    tool_choice none)."""
    if value is None or value is False:
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return value == (1 if name == "best_of" else 0)
    return value in ([], {}, "", "none", "auto", {"type": "text"})


class JsonSchemaFormat(Strict):
    name: str | None = None
    description: str | None = None
    json_schema: dict | bool | None = Field(None, alias="schema", description="the schema the text follows; "
                                                                              "none: any JSON value")
    strict: bool | None = Field(None, description="always strict here: the text follows the schema exactly")


class TextFormat(Strict):
    type: Literal["text"]

    def target_schema(self) -> None:
        return None


class JsonObjectFormat(Strict):
    type: Literal["json_object"]

    def target_schema(self) -> dict:
        return {"type": "object"}


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat

    def target_schema(self) -> dict | bool:
        return True if self.json_schema.json_schema is None else self.json_schema.json_schema


# text, any JSON object, or JSON that follows a schema (`target_schema`: the schema, None for text)
ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


def _one_structure() -> dict:
    """JSON Schema for "at most one of regex, grammar and a JSON response_format" (a null is no value)."""
    given = {name: {"required": [name], "properties": {name: {"type": "string"}}} for name in ("regex", "grammar")}
    given["response_format"] = {"required": ["response_format"], "properties": {"response_format": {
        "type": "object", "required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}
    return {"not": {"anyOf": [{"allOf": [given[a], given[b]]} for a, b in combinations(given, 2)]}}


class SamplingRequest(Strict):
    """Fields shared by both completion endpoints."""
    model_config = ConfigDict(json_schema_extra=_one_structure())
    model: str | None = Field(None, description="must be the served model name when given")
    max_tokens: Integer(ge=1) | None = Field(None, description="default: the rest of the context")
    temperature: float | None = Field(1.0, ge=0, le=2, allow_inf_nan=False, description="0 = greedy")
    top_p: float | None = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: Integer(ge=-1) | None = Field(0, description="extension; 0 or -1 = off")
    seed: Integer(ge=-MAX_SEED, le=MAX_SEED) | None = None
    # (bounded: every stop string is searched for in each token's new text)
    stop: Annotated[str, Field(max_length=MAX_STOP_CHARS)] | \
        Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOPS)] | None = None
    n: Integer(ge=1, le=MAX_CHOICES) | None = Field(1, description="choices, each generated as a request of its own; "
                                                             "a seeded request's choice i draws with seed + i")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(False, description="extension: keep generating past end-of-sequence tokens")
    user: str | None = None
    response_format: ResponseFormat | None = Field(None, description="json_object or json_schema: the text is "
                                                                     "JSON that follows it, and ends with it")
    regex: str | None = Field(None, description="extension: the text matches this regular expression")
    grammar: str | None = Field(None, description="extension: the text follows this Lark grammar")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):  # as in the OpenAI API: clients send "temperature": null for the default
        if not isinstance(data, dict):
            return data
        for name in UNSUPPORTED:
            if not _unset(name, data.get(name)):
                raise APIError(400, f"{name} is not supported by this server", param=name)
        return {k: v for k, v in data.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def top_logprobs_count(self) -> int | None:
        """How many of the most likely tokens to report per position; None: no logprobs."""
        return None


class ContentPart(Strict):
    type: Literal["text"] = Field(description="only text parts are supported")
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="developer is the system role under its newer name")
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict:
        """The message as the chat template expects it: content as one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        msg = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        return msg


TokenIds = Annotated[list[Integer(ge=0)], Field(min_length=1)]
OnePrompt = Field(min_length=1, max_length=1)
PromptForms = Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]], OnePrompt] | \
    TokenIds | Annotated[list[TokenIds], OnePrompt]  # what the schema declares for `prompt`


class ChatCompletionRequest(SamplingRequest):
    # top_logprobs above 0 needs logprobs: true (`_top_needs_logprobs`), stated in the schema too
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}, **_one_structure()})
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer(ge=1) | None = Field(None, description="preferred over max_tokens")
    logprobs: bool | None = Field(False, description="the model's log-probability of each generated token "
                                                      "(before temperature, top-k and top-p)")
    top_logprobs: Integer(ge=0, le=MAX_CHAT_LOGPROBS) | None = Field(
        None, description="with logprobs: the most likely tokens per position, with theirs")

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    # (validated by completion_prompt, whose messages say what is wrong better than a union's errors can)
    prompt: Annotated[str | list, WithJsonSchema(TypeAdapter(PromptForms).json_schema())] = Field(
        description="a string or a list of token ids; one prompt per request (a list holds one)")
    logprobs: Integer(ge=0, le=MAX_COMPLETION_LOGPROBS) | None = Field(
        None, description="the log-probability of each generated token and of this many of the most likely "
                          "tokens per position (the model's own: before temperature, top-k and top-p)")

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose K/V the prefix cache held")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class SpecInfo(BaseModel):
    """The `ddtree` extension: tokens committed per verify step ([] without speculation)."""
    spec: str
    accept_lengths: list[int]
    mean_accept_length: float | None


class TopLogprob(BaseModel):
    token: str = Field(description="the token's text; bytes:\\x.. where it is not whole UTF-8 characters")
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int] = Field(description="where each token starts in the completion's text (characters)")


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # OpenAI sends {"content": "..."} and a final {}
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None
    ddtree: SpecInfo | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ServedSpec(BaseModel):
    """The `ddtree` extension of a model card: how the server decodes (read-only), so a benchmark
    client can label its results."""
    spec: str
    budget: int | str = Field(description="DDTree node budget (0 for AR)")
    topk: int
    max_num_seqs: int
    device: str
    prefix_caching: bool = Field(False, description="whether prompts reuse the K/V of prefixes seen before")


class Health(BaseModel):
    status: Literal["ok", "loading", "failed"]
    error: str | None = Field(None, description="why the model failed to load")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ddtree"
    max_model_len: int | None = None
    ddtree: ServedSpec | None = Field(None, description="extension; null while the model loads")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


@dataclass(slots=True)
class Prompt:
    """What the engine thread tokenizes: exactly one of chat messages (through the chat template),
    text, or token ids."""
    messages: list[dict] | None = None
    text: str | None = None
    ids: list[int] | None = None

    @property
    def param(self) -> str:
        return "messages" if self.messages is not None else "prompt"


def chat_prompt(req: ChatCompletionRequest) -> Prompt:
    try:
        return Prompt(messages=[m.to_template() for m in req.messages])
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def completion_prompt(prompt: str | list) -> Prompt:
    """The prompt in one of `PromptForms`, or a 400 that says what is wrong with it."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt, str):
        return Prompt(text=prompt)
    if all(type(_integral(t)) is int for t in prompt):
        prompt = [_integral(t) for t in prompt]
        if min(prompt) < 0:
            raise APIError(400, f"token id {min(prompt)} is negative", param="prompt")
        return Prompt(ids=list(prompt))
    if len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise APIError(400, f"got {len(prompt)} prompts; send one prompt per request", param="prompt")
    raise APIError(400, "prompt must be a string or a list of integer token ids", param="prompt")


def valid_unicode(text: str, where: str) -> None:
    """A ValueError for text that JSON can carry but Unicode cannot: an unpaired surrogate such as "\\ud800"."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} holds an unpaired surrogate (\\u{ord(text[e.start]):04x} at character {e.start}), "
                         "which is not valid Unicode") from None


def sampling_params(req: SamplingRequest, vocab_size: int) -> SamplingParams:
    """The engine's params; max_tokens is set on the engine thread once the prompt length is known.
    Values the engine would take literally but that underflow in float32 are mapped to equivalents."""
    try:
        for s in [req.stop] if isinstance(req.stop, str) else req.stop or []:
            valid_unicode(s, "stop")
    except ValueError as e:
        raise APIError(400, str(e), param="stop") from None
    schema = req.response_format.target_schema() if req.response_format else None
    structure = {k: v for k, v in (("response_format", schema), ("regex", req.regex), ("grammar", req.grammar))
                 if v is not None}
    if len(structure) > 1:
        raise APIError(400, f"give at most one of {' and '.join(structure)}", param=list(structure)[1])
    try:
        return SamplingParams(
            max_tokens=1, temperature=req.temperature if req.temperature >= 1e-5 else 0.0,  # tiny = greedy
            top_p=max(req.top_p, 1e-6),  # keeps just the top token, as any smaller top_p would
            top_k=min(req.top_k, vocab_size), seed=req.seed, stop=req.stop, ignore_eos=req.ignore_eos,
            logprobs=req.top_logprobs_count, json_schema=schema, regex=req.regex, grammar=req.grammar)
    except ValueError as e:
        raise APIError(400, str(e), param=next(iter(structure), None)) from None
