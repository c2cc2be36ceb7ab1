"""OpenAI-compatible HTTP ingress (a Serve FastAPI ingress, served by the Serve proxy on 127.0.0.1).

Endpoints
  POST /v1/completions        prompt: str | [str] | [int, ...] (one prompt); stream=true -> SSE
  POST /v1/chat/completions   messages (system/user/assistant, str or [{"type": "text", "text": ...}] content) through
                              the target tokenizer's chat template; stream=true -> SSE
  GET  /v1/models, GET /health, GET /metrics (Prometheus text)

Sampling fields: max_tokens (chat also max_completion_tokens), temperature [0, 2], top_p (0, 1], top_k (vLLM; -1 or
0 = off), seed, stop (str or up to 4 str), n = 1, stream, stream_options.include_usage, plus the vLLM extras
ignore_eos, stop_token_ids and return_token_ids.  Unsupported features (n > 1, best_of > 1, logprobs, echo,
non-zero penalties, logit_bias, several prompts) are rejected with 400 instead of being silently ignored; unknown
fields are ignored.

Every response carries ``usage`` and an extra ``dspark`` object: the replica that served it, rounds, accepted tokens,
mean verified depth, acceptance length τ, per-position acceptance, the scheduler, the cluster load the replica saw
and its load shift.  Streams end with ``data: [DONE]``; the first chunk already names the replica (``dspark``), the
last content chunk carries the finish reason and the full ``dspark`` stats.

Errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for client mistakes
(malformed JSON, wrong types, out-of-range values, unknown model, over-long prompt, unknown route) and 5xx for
engine failures; the server keeps serving.  A client that disconnects mid-stream cancels the engine request.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import json
import math
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

MAX_BODY_BYTES = 1 << 20
MAX_STOP = 4


@dataclass
class IngressOptions:
    target: str
    model_name: str
    max_model_len: int = 2048
    default_max_tokens: int = 256  # chat without max_tokens: min(this, room left in the context)
    engine_deployment: str = "DSparkEngine"
    extra_model_ids: list = field(default_factory=list)  # aliases accepted in "model"


# ----------------------------------------------------------------------------------------------------- errors
class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _bad(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> APIError:
    return APIError(status, message, param, code)


# ----------------------------------------------------------------------------------------------------- validation
_MISSING = object()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _opt_number(body: dict, name: str, lo: float, hi: float, default, lo_open: bool = False):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not _is_num(v):
        raise _bad(f"'{name}' must be a number, got {type(v).__name__}", name, "invalid_type")
    if v > hi or v < lo or (lo_open and v <= lo):
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise _bad(f"'{name}' must be in {rng}, got {v}", name, "invalid_value")
    return float(v)


def _opt_int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise _bad(f"'{name}' must be an integer, got {type(v).__name__}", name, "invalid_type")
    if lo is not None and v < lo:
        raise _bad(f"'{name}' must be >= {lo}, got {v}", name, "invalid_value")
    if hi is not None and v > hi:
        raise _bad(f"'{name}' must be <= {hi}, got {v}", name, "invalid_value")
    return v


def _opt_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{name}' must be a boolean, got {type(v).__name__}", name, "invalid_type")
    return v


def parse_sampling(body: dict, chat: bool) -> dict:
    """Common sampling fields -> engine request fields (max_tokens resolved later against the prompt)."""
    out = {
        "temperature": _opt_number(body, "temperature", 0.0, 2.0, 1.0),
        "top_p": _opt_number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
        "stream": _opt_bool(body, "stream", False),
        "ignore_eos": _opt_bool(body, "ignore_eos", False),
        "return_token_ids": _opt_bool(body, "return_token_ids", False),
    }
    top_k = _opt_int(body, "top_k", 0, lo=-1)
    out["top_k"] = 0 if top_k == -1 else top_k
    out["seed"] = _opt_int(body, "seed", None, lo=-(2 ** 63), hi=2 ** 63 - 1)
    if out["seed"] is not None:
        out["seed"] = out["seed"] % (2 ** 63)
    for name in ("n", "best_of"):
        n = _opt_int(body, name, 1, lo=1)
        if n != 1:
            raise _bad(f"'{name}' > 1 is not supported by this server", name, "unsupported")
    for name in ("presence_penalty", "frequency_penalty"):
        p = _opt_number(body, name, -2.0, 2.0, 0.0)
        if p != 0.0:
            raise _bad(f"'{name}' is not supported by this server (only 0)", name, "unsupported")
    rp = _opt_number(body, "repetition_penalty", 0.0, 10.0, 1.0, lo_open=True)
    if rp != 1.0:
        raise _bad("'repetition_penalty' is not supported by this server (only 1)", "repetition_penalty",
                   "unsupported")
    lb = body.get("logit_bias")
    if lb is not None and not isinstance(lb, dict):
        raise _bad("'logit_bias' must be an object", "logit_bias", "invalid_type")
    if lb:
        raise _bad("'logit_bias' is not supported by this server", "logit_bias", "unsupported")
    lp = body.get("logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise _bad("'logprobs' must be a boolean", "logprobs", "invalid_type")
        if lp or body.get("top_logprobs"):
            raise _bad("'logprobs' is not supported by this server", "logprobs", "unsupported")
    else:
        if lp is not None and not _is_int(lp):
            raise _bad("'logprobs' must be an integer", "logprobs", "invalid_type")
        if lp:
            raise _bad("'logprobs' is not supported by this server", "logprobs", "unsupported")
        if _opt_bool(body, "echo", False):
            raise _bad("'echo' is not supported by this server", "echo", "unsupported")
        suffix = body.get("suffix")
        if suffix not in (None, ""):
            raise _bad("'suffix' is not supported by this server", "suffix", "unsupported")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = list(stop)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stop) > MAX_STOP:
        raise _bad(f"'stop' takes at most {MAX_STOP} sequences", "stop", "invalid_value")
    out["stop"] = [s for s in stop if s]
    sti = body.get("stop_token_ids")
    if sti is not None and not (isinstance(sti, list) and all(_is_int(t) and t >= 0 for t in sti)):
        raise _bad("'stop_token_ids' must be a list of non-negative integers", "stop_token_ids", "invalid_type")
    out["stop_token_ids"] = list(sti or [])
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
        if not out["stream"]:
            raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options", "invalid_value")
        iu = so.get("include_usage", False)
        if not isinstance(iu, bool):
            raise _bad("'stream_options.include_usage' must be a boolean", "stream_options", "invalid_type")
        out["include_usage"] = iu
    else:
        out["include_usage"] = False
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user", "invalid_type")
    return out


def _message_text(m, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, list):
        parts = []
        for p in c:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise _bad(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': str}}) are supported",
                           f"messages[{i}].content", "invalid_type")
            parts.append(p["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content",
               "invalid_type")


def parse_messages(body: dict) -> list:
    msgs = body.get("messages", _MISSING)
    if msgs is _MISSING or msgs is None:
        raise _bad("you must provide a 'messages' parameter", "messages", "missing_required_parameter")
    if not isinstance(msgs, list):
        raise _bad("'messages' must be a list of message objects", "messages", "invalid_type")
    if not msgs:
        raise _bad("'messages' must contain at least one message", "messages", "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "developer"):
            raise _bad(f"messages[{i}].role must be one of system, user, assistant (got {role!r})",
                       f"messages[{i}].role", "invalid_value")
        out.append({"role": "system" if role == "developer" else role, "content": _message_text(m, i)})
    return out


def parse_prompt(body: dict, vocab_size: int):
    """-> ('text', str) or ('ids', [int])."""
    p = body.get("prompt", _MISSING)
    if p is _MISSING or p is None:
        raise _bad("you must provide a 'prompt' parameter", "prompt", "missing_required_parameter")
    if isinstance(p, str):
        return "text", p
    if isinstance(p, list):
        if not p:
            raise _bad("'prompt' must not be empty", "prompt", "invalid_value")
        if all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise _bad("several prompts in one request are not supported; send one prompt per request",
                           "prompt", "unsupported")
            return "text", p[0]
        if all(_is_int(x) for x in p):
            if any(x < 0 or x >= vocab_size for x in p):
                raise _bad(f"token ids in 'prompt' must lie in [0, {vocab_size})", "prompt", "invalid_value")
            return "ids", list(p)
        if all(isinstance(x, list) for x in p):
            raise _bad("several prompts in one request are not supported; send one prompt per request",
                       "prompt", "unsupported")
    raise _bad("'prompt' must be a string, a list with one string, or a list of token ids", "prompt", "invalid_type")


# ----------------------------------------------------------------------------------------------------- metrics
class _Hist:
    def __init__(self, buckets):
        self.buckets = list(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.n += 1

    def lines(self, name: str) -> list:
        out, c = [], 0
        for b, k in zip(self.buckets, self.counts):
            c += k
            out.append(f'{name}_bucket{{le="{b:g}"}} {c}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out += [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.n}"]
        return out


class Metrics:
    def __init__(self):
        self.requests = collections.Counter()  # (endpoint, status) -> n
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.rounds = 0
        self.emitted = 0
        self.accepted = 0
        self.verified = 0
        self.disconnects = 0
        self.ttft = _Hist([0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30])
        self.latency = _Hist([0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120])
        self.recent = collections.deque(maxlen=4096)  # (t, output tokens)
        self.in_flight = 0

    def tokens(self, n: int) -> None:
        if n:
            self.output_tokens += n
            self.recent.append((time.monotonic(), n))

    def tokens_per_s(self, window: float = 10.0) -> float:
        now = time.monotonic()
        return sum(n for t, n in self.recent if now - t <= window) / window

    def finish(self, stats: dict | None) -> None:
        if stats:
            self.rounds += stats.get("rounds", 0)
            self.emitted += stats.get("emitted_tokens", 0)
            self.accepted += stats.get("accepted_tokens", 0)
            self.verified += stats.get("verified_tokens", 0)


def prometheus_text(m: Metrics, view: dict, model: str) -> str:
    L = []

    def metric(name, kind, help_, samples):
        L.append(f"# HELP {name} {help_}")
        L.append(f"# TYPE {name} {kind}")
        L.extend(samples)

    metric("dspark_requests_total", "counter", "HTTP requests by endpoint and status",
           [f'dspark_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(m.requests.items())]
           or ["dspark_requests_total 0"])
    metric("dspark_requests_in_flight", "gauge", "requests being served by this ingress",
           [f"dspark_requests_in_flight {m.in_flight}"])
    metric("dspark_client_disconnects_total", "counter", "streams cancelled by the client",
           [f"dspark_client_disconnects_total {m.disconnects}"])
    metric("dspark_prompt_tokens_total", "counter", "prompt tokens", [f"dspark_prompt_tokens_total {m.prompt_tokens}"])
    metric("dspark_output_tokens_total", "counter", "generated tokens",
           [f"dspark_output_tokens_total {m.output_tokens}"])
    metric("dspark_output_tokens_per_second", "gauge", "generated tokens/s over the last 10 s (this ingress)",
           [f"dspark_output_tokens_per_second {m.tokens_per_s():.3f}"])
    tau = m.emitted / m.rounds if m.rounds else 0.0
    metric("dspark_acceptance_length", "gauge", "tokens per verification round (tau) over completed requests",
           [f'dspark_acceptance_length{{model="{model}"}} {tau:.4f}'])
    metric("dspark_mean_verified_depth", "gauge", "drafts verified per round over completed requests",
           [f'dspark_mean_verified_depth{{model="{model}"}} {(m.verified / m.rounds if m.rounds else 0.0):.4f}'])
    metric("dspark_accepted_tokens_total", "counter", "accepted draft tokens (completed requests)",
           [f"dspark_accepted_tokens_total {m.accepted}"])
    L.append("# HELP dspark_ttft_seconds time to first token (ingress)")
    L.append("# TYPE dspark_ttft_seconds histogram")
    L.extend(m.ttft.lines("dspark_ttft_seconds"))
    L.append("# HELP dspark_request_latency_seconds request latency (ingress)")
    L.append("# TYPE dspark_request_latency_seconds histogram")
    L.extend(m.latency.lines("dspark_request_latency_seconds"))

    # per replica (routing stats, <= one stats period old)
    def per(name, kind, help_, key, fmt="{:g}"):
        rows = []
        for rid, st in sorted(view.items()):
            v = st.get(key)
            if v is not None:
                rows.append(f'{name}{{replica="{rid}"}} ' + fmt.format(v))
        if rows:
            metric(name, kind, help_, rows)

    per("dspark_replica_active_requests", "gauge", "requests in the engine batch", "active")
    per("dspark_replica_queue_depth", "gauge", "requests waiting for a batch slot", "queued")
    per("dspark_replica_router_inflight", "gauge", "requests this router has in flight on the replica",
        "router_inflight")
    per("dspark_replica_tokens_last_round", "gauge", "target tokens in the replica's last forward",
        "tokens_last_round")
    per("dspark_replica_step_seconds", "gauge", "recent engine step time (EMA)", "step_s", "{:.6f}")
    per("dspark_replica_steps_per_second", "gauge", "engine steps/s over the last 5 s", "steps_per_s", "{:.3f}")
    per("dspark_replica_tokens_per_second", "gauge", "tokens/s over the last 5 s", "tokens_per_s", "{:.3f}")
    per("dspark_replica_load_shift", "gauge", "other replicas' tokens added to B in SPS(B)", "load_shift")
    per("dspark_replica_cluster_load", "gauge", "cluster load factor the replica last saw", "cluster_load",
        "{:.4f}")
    rows = []
    for rid, st in sorted(view.items()):
        for k in ("requests", "finished", "aborted", "rejected", "output_tokens", "steps", "rounds",
                  "accepted_tokens", "verified_tokens", "emitted_tokens"):
            rows.append(f'dspark_replica_total{{replica="{rid}",counter="{k}"}} {st.get("totals", {}).get(k, 0)}')
    if rows:
        metric("dspark_replica_total", "counter", "replica counters", rows)
    rows = []
    for rid, st in sorted(view.items()):
        hist = st.get("depth_hist") or []
        c = 0
        for d, k in enumerate(hist):
            c += k
            rows.append(f'dspark_verified_depth_bucket{{replica="{rid}",le="{d}"}} {c}')
        if hist:
            rows.append(f'dspark_verified_depth_bucket{{replica="{rid}",le="+Inf"}} {c}')
            rows.append(f'dspark_verified_depth_sum{{replica="{rid}"}} {sum(d * k for d, k in enumerate(hist))}')
            rows.append(f'dspark_verified_depth_count{{replica="{rid}"}} {c}')
    if rows:
        metric("dspark_verified_depth", "histogram", "drafts verified per round (replica)", rows)
    rows = []
    for rid, st in sorted(view.items()):
        for b, s in sorted((st.get("sps") or {}).items(), key=lambda kv: int(kv[0])):
            rows.append(f'dspark_sps{{replica="{rid}",batch_tokens="{b}"}} {s}')
    if rows:
        metric("dspark_sps", "gauge", "profiled target steps/s for B tokens per forward", rows)
    rows = []
    for rid, st in sorted(view.items()):
        live = st.get("live_cost") or {}
        for r, sec in sorted((live.get("draft_s") or {}).items(), key=lambda kv: int(kv[0])):
            rows.append(f'dspark_draft_round_seconds{{replica="{rid}",requests="{r}"}} {sec}')
    if rows:
        metric("dspark_draft_round_seconds", "gauge", "measured drafting round time for R requests (EMA)", rows)
    per("dspark_replica_cost_scale", "gauge", "measured / profiled target step time (EMA)", "cost_scale", "{:.4f}")
    per("dspark_replica_skipped_drafts", "counter", "rounds in which drafting was skipped", "skipped_drafts")
    return "\n".join(L) + "\n"


# ----------------------------------------------------------------------------------------------------- the app
fastapi_app = FastAPI(title="DSpark OpenAI-compatible server", docs_url=None, redoc_url=None, openapi_url=None)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404:
        msg = f"unknown route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        msg = f"method {request.method} not allowed on {request.url.path}"
    return APIError(exc.status_code, msg, None, code).response()


@fastapi_app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    return APIError(400, str(exc), None, "invalid_request").response()


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(fastapi_app)
class OpenAIIngress:
    def __init__(self, engine, options: dict):
        from pipeline.runtime import apply_env

        apply_env()
        from transformers import AutoTokenizer

        self.opts = IngressOptions(**options)
        self.engine = engine.options(stream=True, method_name="generate")
        self.engine_plain = engine
        self.tok = AutoTokenizer.from_pretrained(self.opts.target)
        self.vocab_size = len(self.tok)
        self.model_ids = {self.opts.model_name, *self.opts.extra_model_ids}
        self.metrics = Metrics()
        self.created = int(time.time())

    # ------------------------------------------------------------------------------------------ helpers
    async def _body(self, request: Request) -> dict:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes", None, "payload_too_large")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(f"could not parse the JSON body of the request: {e}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", None, "invalid_json")
        model = body.get("model", _MISSING)
        if model is _MISSING or model is None:
            raise _bad("you must provide a 'model' parameter", "model", "missing_required_parameter")
        if not isinstance(model, str):
            raise _bad("'model' must be a string", "model", "invalid_type")
        if model not in self.model_ids:
            raise APIError(404, f"the model '{model}' does not exist; available: {sorted(self.model_ids)}", "model",
                           "model_not_found")
        return body

    def _max_tokens(self, body: dict, n_prompt: int, chat: bool) -> int:
        room = self.opts.max_model_len - n_prompt
        if room <= 0:
            raise _bad(f"this model's maximum context length is {self.opts.max_model_len} tokens; the prompt has "
                       f"{n_prompt} tokens", "messages" if chat else "prompt", "context_length_exceeded")
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        mt = None
        for name in names:
            v = _opt_int(body, name, None, lo=1)
            if v is not None:
                mt = v
                if v > room:
                    raise _bad(f"this model's maximum context length is {self.opts.max_model_len} tokens; you "
                               f"requested {n_prompt} prompt + {v} completion tokens", name,
                               "context_length_exceeded")
                break
        if mt is None:
            mt = min(room, self.opts.default_max_tokens) if chat else min(room, 16)
        return mt

    def _engine_request(self, rid: str, prompt_ids: list, samp: dict, max_tokens: int) -> dict:
        return {"request_id": rid, "prompt_ids": prompt_ids, "max_tokens": max_tokens,
                "temperature": samp["temperature"], "top_p": samp["top_p"], "top_k": samp["top_k"],
                "seed": samp["seed"], "stop": samp["stop"], "stop_token_ids": samp["stop_token_ids"],
                "ignore_eos": samp["ignore_eos"]}

    def _dspark(self, ev: dict | None, replica: str | None) -> dict:
        d = {"replica": replica}
        if ev is not None and ev.get("stats"):
            d.update(ev["stats"])
            d.update(scheduler=ev.get("scheduler"), cluster_load=ev.get("cluster_load"),
                     load_shift=ev.get("load_shift"), routing=ev.get("routing"))
        return d

    async def _handle(self, request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            body = await self._body(request)
            samp = parse_sampling(body, chat)
            if chat:
                msgs = parse_messages(body)
                prompt_ids = self._chat_ids(msgs)
            else:
                kind, p = parse_prompt(body, self.vocab_size)
                prompt_ids = self.tok.encode(p) if kind == "text" else p
                if not prompt_ids:
                    raise _bad("'prompt' must not be empty", "prompt", "invalid_value")
            mt = self._max_tokens(body, len(prompt_ids), chat)
        except APIError as e:
            self.metrics.requests[(endpoint, e.status)] += 1
            return e.response()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        req = self._engine_request(rid, prompt_ids, samp, mt)
        model = body["model"]
        if samp["stream"]:
            self.metrics.requests[(endpoint, 200)] += 1
            return StreamingResponse(self._stream(rid, req, samp, model, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        return await self._complete(rid, req, samp, model, chat, endpoint)

    def _chat_ids(self, msgs: list) -> list:
        from pipeline.prompts import chat_prompt_ids

        try:
            if len(msgs) == 1 and msgs[0]["role"] == "user":
                return chat_prompt_ids(self.tok, msgs[0]["content"])
            ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise _bad(f"the chat template rejected the messages: {e}", "messages", "invalid_value") from None

    async def _events(self, req: dict):
        """Engine events for one request; cancels the engine stream if the consumer goes away."""
        gen = self.engine.remote(req)
        done = False
        try:
            async for ev in gen:
                if ev.get("finished"):
                    done = True
                yield ev
                if done:
                    break
        finally:
            if not done:
                gen.cancel()

    async def _complete(self, rid, req, samp, model, chat, endpoint):
        m = self.metrics
        m.in_flight += 1
        t0 = time.monotonic()
        text, ids, last, replica, first = [], [], None, None, True
        try:
            async with contextlib.aclosing(self._events(req)) as events:
                async for ev in events:
                    replica = ev.get("replica", replica)
                    if ev.get("error"):
                        raise APIError(int(ev.get("status", 500)), ev["error"], None,
                                       "engine_error" if ev.get("status", 500) >= 500 else "invalid_value")
                    if first and ev.get("token_ids"):
                        m.ttft.observe(time.monotonic() - t0)
                        first = False
                    text.append(ev.get("text", ""))
                    ids.extend(ev.get("token_ids", []))
                    m.tokens(len(ev.get("token_ids", [])))
                    last = ev
        except APIError as e:
            m.requests[(endpoint, e.status)] += 1
            return e.response()
        except Exception as e:
            m.requests[(endpoint, 500)] += 1
            return APIError(500, f"engine failure: {type(e).__name__}: {e}", None, "engine_error").response()
        finally:
            m.in_flight -= 1
        m.requests[(endpoint, 200)] += 1
        m.latency.observe(time.monotonic() - t0)
        m.prompt_tokens += len(req["prompt_ids"])
        m.finish(last.get("stats") if last else None)
        n_out = last.get("completion_tokens", len(ids)) if last else len(ids)
        usage = {"prompt_tokens": len(req["prompt_ids"]), "completion_tokens": n_out,
                 "total_tokens": len(req["prompt_ids"]) + n_out}
        finish = (last or {}).get("finish_reason") or "stop"
        out_text = "".join(text)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out_text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": out_text, "logprobs": None, "finish_reason": finish}
        if samp["return_token_ids"]:
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = list(req["prompt_ids"])
        resp = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model, "choices": [choice], "usage": usage, "dspark": self._dspark(last, replica)}
        return JSONResponse(resp, headers={"X-DSpark-Replica": str(replica), "X-Request-Id": rid})

    async def _stream(self, rid, req, samp, model, chat):
        m = self.metrics
        m.in_flight += 1
        t0 = time.monotonic()
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        first, last, n_ids, finished = True, None, 0, False

        def chunk(delta_text=None, finish=None, extra=None, role=False, token_ids=None):
            if chat:
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                ch = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                ch = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            if token_ids is not None:
                ch["token_ids"] = token_ids
            c = {"id": rid, "object": obj, "created": created, "model": model, "choices": [ch]}
            if extra:
                c.update(extra)
            return _sse(c)

        try:
            async with contextlib.aclosing(self._events(req)) as events:
                async for ev in events:
                    if ev.get("error"):
                        yield _sse(APIError(int(ev.get("status", 500)), ev["error"], None, "engine_error").body())
                        finished = True
                        break
                    ids = ev.get("token_ids", [])
                    n_ids += len(ids)
                    m.tokens(len(ids))
                    tids = list(ids) if samp["return_token_ids"] else None
                    head = None
                    if first:  # the first chunk names the replica
                        m.ttft.observe(time.monotonic() - t0)
                        first = False
                        head = {"dspark": {"replica": ev.get("replica")}}
                        if chat:
                            yield chunk("", None, head, role=True)
                            head = None
                    if ev.get("finished"):
                        last, finished = ev, True
                        extra = {"dspark": self._dspark(ev, ev.get("replica"))}
                        if samp["return_token_ids"]:
                            extra["prompt_token_ids"] = list(req["prompt_ids"])
                        yield chunk(ev.get("text", ""), ev.get("finish_reason") or "stop", extra, token_ids=tids)
                        break
                    if ev.get("text") or tids or head:
                        yield chunk(ev.get("text", ""), None, head, token_ids=tids)
            if last is not None:
                n_out = last.get("completion_tokens", n_ids)
                m.latency.observe(time.monotonic() - t0)
                m.prompt_tokens += len(req["prompt_ids"])
                m.finish(last.get("stats"))
                if samp["include_usage"]:
                    yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                "usage": {"prompt_tokens": len(req["prompt_ids"]), "completion_tokens": n_out,
                                          "total_tokens": len(req["prompt_ids"]) + n_out}})
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                m.disconnects += 1
            raise
        except Exception as e:
            yield _sse(APIError(500, f"engine failure: {type(e).__name__}: {e}", None, "engine_error").body())
            yield b"data: [DONE]\n\n"
        finally:
            m.in_flight -= 1

    # ------------------------------------------------------------------------------------------ routes
    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._handle(request, chat=False)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._handle(request, chat=True)

    @fastapi_app.get("/v1/models")
    async def models(self):
        data = [{"id": mid, "object": "model", "created": self.created, "owned_by": "dspark",
                 "root": self.opts.target, "max_model_len": self.opts.max_model_len}
                for mid in sorted(self.model_ids)]
        return {"object": "list", "data": data}

    @fastapi_app.get("/health")
    async def health(self):
        return {"status": "ok", "model": self.opts.model_name, "replicas_seen": len(self._view())}

    @fastapi_app.get("/metrics")
    async def metrics_endpoint(self):
        view = self._view()
        if not view:  # no routed request yet: ask one replica directly (also instantiates the router)
            try:
                st = await asyncio.wait_for(self.engine_plain.stats.remote(), timeout=5.0)
                view = {st["replica"]: st}
            except Exception:
                view = {}
        return PlainTextResponse(prometheus_text(self.metrics, view, self.opts.model_name),
                                 media_type="text/plain; version=0.0.4")

    def _view(self) -> dict:
        from serve_app.router import cluster_view

        return cluster_view(self.opts.engine_deployment)
