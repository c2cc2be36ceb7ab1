"""The OpenAI-compatible wire format of the ingress (serve_app/api.py): pydantic models for the request bodies and
the responses, and the OpenAI error shape.

A request body is validated in one step, ``CompletionRequest.parse_body(raw, model_ids=..., vocab_size=...)``:
pydantic's JSON parser reads the bytes (it rejects invalid UTF-8, lone UTF-16 surrogate escapes such as ``"\\ud800"``
and nesting deeper than a couple of hundred levels) and the model checks every field.  The first problem becomes an
``APIError`` (status 400, 404 for an unknown model) whose message starts with the quoted path of the field, e.g.
``'temperature' must be <= 2.0, got 3.0`` or ``'messages[1].content' must be a string or a list of text parts``.

Field names follow the OpenAI API (plus the vLLM extras ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``repetition_penalty`` and ``return_token_ids``).  ``null`` means "not given" for every top-level field.  A field this
server does not honour is rejected by name instead of being silently ignored: an unknown top-level field (e.g.
``tools``, ``response_format``, ``min_p``) is a 400, and so are values of known fields it does not implement (best_of >
1, echo, suffix, non-zero penalties, logit_bias, several prompts).  ``n`` (up to MAX_N) asks for independent choices
(with a seed, choice i samples with seed + i); ``logprobs`` (completions: 0..MAX_LOGPROBS alternatives) and
``logprobs`` + ``top_logprobs`` (chat) return the target's log-probabilities of the emitted tokens.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, Strict,
                      StrictBool, StrictInt, StrictStr, ValidationError, ValidationInfo, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

MAX_STOP = 4
MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # alternatives per token (the engine's limit too)
SEED_RANGE = 2 ** 63  # seeds lie in [-2^63, 2^63); the engine takes them modulo 2^63


# ----------------------------------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An OpenAI-shaped error: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def wire(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.wire().model_dump(), status_code=self.status)


# pydantic error type -> what the field must be (for "'x' must be <this>, got <JSON type>")
_EXPECTED = {"int_type": "an integer", "int_from_float": "an integer", "int_parsing": "an integer",
             "float_type": "a number", "float_parsing": "a number", "bool_type": "a boolean",
             "bool_parsing": "a boolean", "string_type": "a string", "list_type": "a list", "dict_type": "an object",
             "model_type": "an object", "model_attributes_type": "an object"}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
           "less_than": ("<", "lt")}
# top-level fields of the OpenAI / vLLM APIs this server does not implement, and what they ask for
_NOT_HONOURED = {"tools": "tool calling", "tool_choice": "tool calling", "parallel_tool_calls": "tool calling",
                 "functions": "function calling", "function_call": "function calling",
                 "response_format": "structured output", "guided_json": "structured output",
                 "guided_regex": "structured output", "guided_choice": "structured output",
                 "min_p": "min-p sampling", "min_tokens": "a minimum completion length",
                 "prompt_logprobs": "prompt log-probabilities", "modalities": "only text", "audio": "only text"}
# error types raised by the validators below (PydanticCustomError): their message follows the quoted field path
_OWN = {"unsupported", "invalid_value", "invalid_type", "missing_required_parameter", "model_not_found"}


def field_path(loc: tuple) -> str:
    """('messages', 1, 'content') -> 'messages[1].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _show(v, limit: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + "..."


def _json_problem(detail: str) -> str:
    if "recursion limit" in detail:
        return f"the JSON body of the request is nested too deeply ({detail})"
    if "surrogate" in detail or "hex escape" in detail:
        return (f"could not parse the JSON body of the request: {detail} (a \\u escape must name a Unicode "
                "character; a UTF-16 surrogate \\ud800-\\udfff is only valid as a high-low pair)")
    if "unicode code point" in detail:
        return f"could not parse the JSON body of the request: {detail} (the body must be UTF-8 text)"
    return f"could not parse the JSON body of the request: {detail}"


def error_from_validation(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 (404 for an unknown model) naming the field."""
    e = exc.errors(include_url=False)[0]
    kind, loc, ctx = e["type"], tuple(e["loc"]), e.get("ctx") or {}
    if kind == "json_invalid":
        return APIError(400, _json_problem(str(ctx.get("error", e["msg"]))), None, "invalid_json")
    if not loc:
        if kind in ("model_type", "dict_type", "model_attributes_type"):
            return APIError(400, "the request body must be a JSON object", None, "invalid_json")
        return APIError(400, f"invalid request body: {e['msg']}", None, "invalid_request")
    param = field_path(loc)
    if kind == "missing":
        msg = f"you must provide a '{param}' parameter" if len(loc) == 1 else f"'{param}' is required"
        return APIError(400, msg, param, "missing_required_parameter")
    got = e.get("input")
    if kind in _OWN:
        return APIError(404 if kind == "model_not_found" else 400, f"'{param}' {e['msg']}", param, kind)
    if kind == "extra_forbidden":
        what = _NOT_HONOURED.get(param)
        msg = (f"'{param}' is not supported by this server ({what}): leave it out" if what else
               f"'{param}' is not a field this server takes (it would be ignored): leave it out")
        return APIError(400, msg, param, "unsupported")
    if kind in _EXPECTED:
        return APIError(400, f"'{param}' must be {_EXPECTED[kind]}, got {type(got).__name__}", param, "invalid_type")
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        msg = f"'{param}' must be {op} {ctx[key]}, got {_show(got)}"
    elif kind == "finite_number":
        msg = f"'{param}' must be a finite number, got {_show(got)}"
    elif kind == "literal_error":
        msg = f"'{param}' must be {ctx['expected']}, got {_show(got)}"
    elif kind == "too_short":
        n = ctx.get("min_length", 1)
        msg = f"'{param}' must not be empty" if n == 1 else f"'{param}' must hold at least {n} items"
    elif kind == "too_long":
        msg = f"'{param}' takes at most {ctx['max_length']} items, got {ctx.get('actual_length')}"
    else:
        msg = f"'{param}': {e['msg']}"
    return APIError(400, msg, param, "invalid_value")


# ----------------------------------------------------------------------------------------------------- field types
def _integral(v):
    """JSON has one number type: 3.0 counts as the integer 3 (bools and strings stay errors)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Integer = Annotated[int, Strict(), BeforeValidator(_integral)]
Number = Annotated[float, Strict()]  # an int or a float, never a bool or a string; finite (allow_inf_nan=False)
TokenId = Annotated[StrictInt, Field(ge=0)]


def _neutral(value, what: str | None = None):
    """An after-validator: the field is accepted, but this server implements only its neutral ``value``."""

    def check(v):
        if v != value:
            raise PydanticCustomError("unsupported", "is not supported by this server ({what}), got {got}",
                                      {"what": what or f"only {value!r}", "got": _show(v)})
        return v

    return AfterValidator(check)


def _only_if(flag: str, message: str):
    """A field validator: the field may be given only when the boolean field ``flag`` (declared before it) is true."""

    def check(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get(flag, False):
            raise PydanticCustomError("invalid_value", message)
        return v

    return check


def _stop_list(v):
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list):
        raise PydanticCustomError("invalid_type", "must be a string or a list of strings, got {got}",
                                  {"got": type(v).__name__})
    return v


def _prompt(v, info: ValidationInfo) -> str | list[int]:
    """str | [str] (one prompt) | [int, ...] token ids in [0, vocab_size)."""
    if isinstance(v, str):
        if not v:
            raise PydanticCustomError("invalid_value", "must not be empty")
        return v
    if isinstance(v, list):
        if not v:
            raise PydanticCustomError("invalid_value", "must not be empty")
        if all(isinstance(x, str) for x in v) or all(isinstance(x, list) for x in v):
            if len(v) != 1 or not isinstance(v[0], str):
                raise PydanticCustomError("unsupported", "holds several prompts; this server takes one prompt per "
                                                         "request")
            return _prompt(v[0], info)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            vocab = (info.context or {}).get("vocab_size")
            if vocab is not None and any(x < 0 or x >= vocab for x in v):
                raise PydanticCustomError("invalid_value", "token ids must lie in [0, {vocab})", {"vocab": vocab})
            return list(v)
    raise PydanticCustomError("invalid_type", "must be a string, a list with one string, or a list of token ids, "
                                              "got {got}", {"got": type(v).__name__})


Prompt = Annotated[str | list[int], PlainValidator(_prompt)]


# ----------------------------------------------------------------------------------------------------- requests
class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _GenerationRequest(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions.  Declaration order is the order in which
    problems are reported (the model first, so an unknown model is a 404 whatever else is wrong)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    model: StrictStr
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[Integer, Field(ge=-1)] = 0  # vLLM: -1 or 0 = off
    seed: Annotated[Integer, Field(ge=-SEED_RANGE, lt=SEED_RANGE)] | None = None
    n: Annotated[Integer, Field(ge=1, le=MAX_N)] = 1
    best_of: Annotated[Integer, Field(ge=1), _neutral(1, "only 1")] = 1
    presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0), _neutral(0.0, "only 0")] = 0.0
    frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0), _neutral(0.0, "only 0")] = 0.0
    repetition_penalty: Annotated[Number, Field(gt=0.0, le=10.0), _neutral(1.0, "only 1")] = 1.0
    logit_bias: Annotated[dict[str, Any], _neutral({}, "only an empty object")] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[list[StrictStr], BeforeValidator(_stop_list), Field(max_length=MAX_STOP)] = []
    stop_token_ids: list[TokenId] = []
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    user: StrictStr | None = None
    max_tokens: Annotated[Integer, Field(ge=1)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_absent(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @field_validator("model")
    @classmethod
    def _served_model(cls, v: str, info: ValidationInfo) -> str:
        ids = (info.context or {}).get("model_ids")
        if ids is not None and v not in ids:
            raise PydanticCustomError("model_not_found", "names a model that does not exist: {model}; available: "
                                                         "{ids}", {"model": _show(v), "ids": sorted(ids)})
        return v

    _only_when_streaming = field_validator("stream_options")(_only_if("stream", "is only allowed when 'stream' is true"))

    @classmethod
    def parse_body(cls, raw: bytes, *, model_ids=None, vocab_size: int | None = None):
        """Raw JSON bytes -> a validated request; raises APIError naming the first problem."""
        try:
            return cls.model_validate_json(raw, context={"model_ids": model_ids, "vocab_size": vocab_size})
        except ValidationError as e:
            raise error_from_validation(e) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> tuple[str, int] | None:
        """(field name, value) of the completion-length limit the client set, if any."""
        return ("max_tokens", self.max_tokens) if self.max_tokens is not None else None

    def logprobs_wanted(self) -> int | None:
        """How many alternatives per token the response carries log-probabilities for (None: no logprobs)."""
        return None

    def engine_sampling(self) -> dict:
        """The sampling fields of an engine request (serve_app/replica.py)."""
        return {"temperature": float(self.temperature), "top_p": float(self.top_p), "logprobs": self.logprobs_wanted(),
                "top_k": 0 if self.top_k == -1 else self.top_k,
                "seed": None if self.seed is None else self.seed % SEED_RANGE,
                "stop": [s for s in self.stop if s], "stop_token_ids": list(self.stop_token_ids),
                "ignore_eos": self.ignore_eos}


class CompletionRequest(_GenerationRequest):
    prompt: Prompt  # text, or token ids already checked against the vocabulary
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Annotated[StrictBool, _neutral(False, "no echo")] = False
    suffix: Annotated[StrictStr, _neutral("", "no suffix")] | None = None


    def logprobs_wanted(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    type: StrictStr
    text: StrictStr

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise PydanticCustomError("unsupported", "must be 'text': only text parts ({'type': 'text', 'text': "
                                                     "str}) are supported, got {got}", {"got": _show(v)})
        return v


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: list[TextPart] | None = Field(None, validate_default=True)  # a string arrives as one text part

    @field_validator("content", mode="before")
    @classmethod
    def _as_parts(cls, v, info: ValidationInfo):
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        if v is None:
            if info.data.get("role") == "assistant":
                return None
            raise PydanticCustomError("missing_required_parameter", "is required (only an assistant message may "
                                                                    "leave it out)")
        if not isinstance(v, list):
            raise PydanticCustomError("invalid_type", "must be a string or a list of text parts, got {got}",
                                      {"got": type(v).__name__})
        return v

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content or [])

    def for_template(self) -> dict:
        """{"role", "content": str} for the tokenizer's chat template ("developer" is a system message)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text}


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[Integer, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    _needs_logprobs = field_validator("top_logprobs")(_only_if("logprobs", "needs 'logprobs' set to true"))

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:  # the newer OpenAI name wins
            return "max_completion_tokens", self.max_completion_tokens
        return super().requested_max_tokens()


# ----------------------------------------------------------------------------------------------------- responses
def _omitted_if_none(default=None):
    return Field(default, exclude_if=lambda v: v is None)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per token its text, log-probability, best alternatives and text offset."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _omitted_if_none()  # return_token_ids=true
    prompt_token_ids: list[int] | None = _omitted_if_none()


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    token_ids: list[int] | None = _omitted_if_none()
    prompt_token_ids: list[int] | None = _omitted_if_none()


# ``dspark``: {"replica": id, and once a request finished: rounds, emitted/accepted/verified tokens,
# mean_verified_depth, acceptance_length, per-position acceptance, scheduler, cluster_load, load_shift, routing}
DSparkInfo = dict[str, Any]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    dspark: DSparkInfo


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    dspark: DSparkInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = _omitted_if_none()
    content: str | None = _omitted_if_none()


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _omitted_if_none()


class _Chunk(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage | None = _omitted_if_none()  # only the last chunk, with stream_options.include_usage (no choices)
    dspark: DSparkInfo | None = _omitted_if_none()  # the first chunk (replica) and the finishing one (all stats)
    prompt_token_ids: list[int] | None = _omitted_if_none()  # the finishing chunk, with return_token_ids


class CompletionChunk(_Chunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionChunk(_Chunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dspark"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "starting", "unavailable", "failed"]
    model: str
    ready_replicas: int
    wanted_replicas: int
    replica_states: dict[str, int]  # Serve's replica state -> count (RUNNING, STARTING, ...)
    detail: str


class Liveness(BaseModel):
    status: Literal["alive"] = "alive"
    model: str
