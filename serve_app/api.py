"""OpenAI-compatible HTTP ingress (a Serve FastAPI ingress, served by the Serve proxy on 127.0.0.1).

Endpoints
  POST /v1/completions        prompt: str | [str] | [int, ...] (one prompt); stream=true -> SSE
  POST /v1/chat/completions   messages (system/user/assistant, str or [{"type": "text", "text": ...}] content) through
                              the target tokenizer's chat template; stream=true -> SSE
  GET  /v1/models, GET /metrics (Prometheus text, serve_app/ingress_metrics.py)
  GET  /health                readiness: 200 when at least one engine replica can take a request (ready / wanted
                              replicas, their states), 503 before that and while every replica is down
  GET  /livez                 liveness: 200 whenever the ingress answers

The request and response bodies are the pydantic models of serve_app/protocol.py (sampling fields, what is rejected
as unsupported, the error messages).  Every response carries ``usage`` and an extra ``dspark`` object: the replica
that served it, rounds, accepted tokens, mean verified depth, acceptance length τ, per-position acceptance, the
scheduler, the cluster load the replica saw and its load shift.  Streams end with ``data: [DONE]``; the first chunk
already names the replica (``dspark``), the last content chunk carries the finish reason and the full ``dspark``
stats.

Errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for client mistakes
(malformed JSON, wrong types, out-of-range values, unknown model, over-long prompt, unknown route) and 5xx for
engine failures; the server keeps serving.  A client that disconnects mid-stream cancels the engine request.  A
request that arrives while no engine replica is ready waits at most ``ready_wait_s`` (``--ready-wait-s``) for one,
then gets a 503 (code ``no_replica_ready``) that says how many replicas are ready of how many wanted and why.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.data.prompts import chat_prompt_ids
from pipeline.core.runtime import apply_env
from serve_app.ingress_metrics import CONTENT_TYPE, IngressMetrics
from serve_app.readiness import ReadinessProbe
from serve_app.protocol import (APIError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                ChatCompletionRequest, ChatCompletionResponse, ChatDelta, CompletionChoice,
                                CompletionChunk, CompletionRequest, CompletionResponse, Health, Liveness, ModelCard,
                                ModelList,
                                Usage)
from serve_app.router import cluster_view, known_replicas

MAX_BODY_BYTES = 1 << 20


@dataclass
class IngressOptions:
    target: str
    model_name: str
    max_model_len: int = 2048
    default_max_tokens: int = 256  # chat without max_tokens: min(this, room left in the context)
    engine_deployment: str = "DSparkEngine"
    extra_model_ids: list = field(default_factory=list)  # aliases accepted in "model"
    engine_replicas: int = 1  # how many engine replicas the application wants (for /health)
    ready_wait_s: float = 30.0  # how long a request waits for a ready engine replica before a 503


def _json(model: BaseModel, headers: dict | None = None) -> Response:
    return Response(model.model_dump_json(), media_type="application/json", headers=headers)


def _sse(model: BaseModel) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


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


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(fastapi_app)
class OpenAIIngress:
    def __init__(self, engine, options: dict):
        apply_env()
        from transformers import AutoTokenizer

        self.opts = IngressOptions(**options)
        self.engine = engine.options(stream=True, method_name="generate")
        self.engine_plain = engine
        self.tok = AutoTokenizer.from_pretrained(self.opts.target)
        self.vocab_size = len(self.tok)
        self.model_ids = {self.opts.model_name, *self.opts.extra_model_ids}
        self.metrics = IngressMetrics(self.opts.model_name)
        self.created = int(time.time())
        try:
            app_name = serve.get_replica_context().app_name
        except Exception:  # constructed outside Serve (unit use)
            app_name = "dspark"
        self.readiness = ReadinessProbe(app_name, self.opts.engine_deployment, self.opts.engine_replicas)

    # ------------------------------------------------------------------------------------------ helpers
    def _parse(self, raw: bytes, chat: bool) -> CompletionRequest | ChatCompletionRequest:
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes", None, "payload_too_large")
        kind = ChatCompletionRequest if chat else CompletionRequest
        return kind.parse_body(raw, model_ids=self.model_ids, vocab_size=self.vocab_size)

    def _max_tokens(self, body: CompletionRequest | ChatCompletionRequest, n_prompt: int, chat: bool) -> int:
        room = self.opts.max_model_len - n_prompt
        if room <= 0:
            raise APIError(400, f"this model's maximum context length is {self.opts.max_model_len} tokens; the "
                                f"prompt has {n_prompt} tokens", "messages" if chat else "prompt",
                           "context_length_exceeded")
        requested = body.requested_max_tokens()
        if requested is None:
            return min(room, self.opts.default_max_tokens) if chat else min(room, 16)
        name, v = requested
        if v > room:
            raise APIError(400, f"this model's maximum context length is {self.opts.max_model_len} tokens; you "
                                f"requested {n_prompt} prompt + {v} completion tokens", name,
                           "context_length_exceeded")
        return v

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
            body = self._parse(await request.body(), chat)
            if chat:
                prompt_ids = self._chat_ids([m.for_template() for m in body.messages])
            else:
                prompt_ids = self.tok.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
                if not prompt_ids:
                    raise APIError(400, "'prompt' must not be empty", "prompt", "invalid_value")
            mt = self._max_tokens(body, len(prompt_ids), chat)
            await self._wait_for_a_replica()
        except APIError as e:
            self.metrics.request(endpoint, e.status)
            return e.response()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        req = {"request_id": rid, "prompt_ids": prompt_ids, "max_tokens": mt, "stream": bool(body.stream),
               **body.engine_sampling()}
        if body.stream:
            self.metrics.request(endpoint, 200)
            return StreamingResponse(self._stream(rid, req, body, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        return await self._complete(rid, req, body, chat, endpoint)

    async def _wait_for_a_replica(self) -> None:
        """Return once an engine replica can take a request; a 503 naming why after ``ready_wait_s`` (before the
        first replica is ready, or while every replica is down), never an open-ended wait.

        The engine handle's router knows the running replicas at no cost (Serve pushes each change to it); until it
        exists (it is built by the first request) Serve's controller is asked.  When the router knows none, the
        controller's word is not enough (it may not have noticed a death yet): wait for the router to see one."""
        t0 = time.monotonic()
        while True:
            known = known_replicas(self.opts.engine_deployment)
            if known:
                return
            r = await self.readiness.get(fresh=known == 0)
            if r.ready and known is None:
                return
            waited = time.monotonic() - t0
            if r.failed or waited >= self.opts.ready_wait_s:
                why = r.describe() if not r.ready else f"{r.describe()}, but none reachable yet"
                raise APIError(503, f"no engine replica can take the request after waiting {waited:.1f} s: {why}",
                               None, "no_replica_ready", "server_error")
            await asyncio.sleep(min(0.25, max(0.0, self.opts.ready_wait_s - waited)))

    def _chat_ids(self, msgs: list) -> list:
        try:
            if len(msgs) == 1 and msgs[0]["role"] == "user":
                return chat_prompt_ids(self.tok, msgs[0]["content"])
            ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages",
                           "invalid_value") from None

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

    async def _complete(self, rid: str, req: dict, body, chat: bool, endpoint: str):
        m = self.metrics
        t0 = time.monotonic()
        text, ids, last, replica, first = [], [], None, None, True
        try:
            with m.in_flight.track_inprogress():
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
            m.request(endpoint, e.status)
            return e.response()
        except Exception as e:
            m.request(endpoint, 500)
            return APIError(500, f"engine failure: {type(e).__name__}: {e}", None, "engine_error").response()
        n_prompt = len(req["prompt_ids"])
        m.request(endpoint, 200)
        m.finish(n_prompt, time.monotonic() - t0, last.get("stats") if last else None)
        n_out = last.get("completion_tokens", len(ids)) if last else len(ids)
        finish = (last or {}).get("finish_reason") or "stop"
        out_text = "".join(text)
        extra = {"token_ids": ids, "prompt_token_ids": list(req["prompt_ids"])} if body.return_token_ids else {}
        common = dict(id=rid, created=int(time.time()), model=body.model, usage=Usage.of(n_prompt, n_out),
                      dspark=self._dspark(last, replica))
        if chat:
            resp = ChatCompletionResponse(choices=[ChatChoice(message=AssistantMessage(content=out_text),
                                                              finish_reason=finish, **extra)], **common)
        else:
            resp = CompletionResponse(choices=[CompletionChoice(text=out_text, finish_reason=finish, **extra)],
                                      **common)
        return _json(resp, headers={"X-DSpark-Replica": str(replica), "X-Request-Id": rid})

    async def _stream(self, rid: str, req: dict, body, chat: bool):
        m = self.metrics
        t0 = time.monotonic()
        head = dict(id=rid, created=int(time.time()), model=body.model)
        first, last, n_ids, finished = True, None, 0, False

        def chunk(text=None, finish=None, role=False, token_ids=None, **extra) -> bytes:
            if chat:
                delta = ChatDelta(role="assistant" if role else None, content=text)
                return _sse(ChatCompletionChunk(choices=[ChatChunkChoice(delta=delta, finish_reason=finish,
                                                                         token_ids=token_ids)], **head, **extra))
            return _sse(CompletionChunk(choices=[CompletionChoice(text=text or "", finish_reason=finish,
                                                                  token_ids=token_ids)], **head, **extra))

        m.in_flight.inc()
        try:
            async with contextlib.aclosing(self._events(req)) as events:
                async for ev in events:
                    if ev.get("error"):
                        yield _sse(APIError(int(ev.get("status", 500)), ev["error"], None, "engine_error").wire())
                        finished = True
                        break
                    ids = ev.get("token_ids", [])
                    n_ids += len(ids)
                    m.tokens(len(ids))
                    tids = list(ids) if body.return_token_ids else None
                    named = None
                    if first:  # the first chunk names the replica
                        m.ttft.observe(time.monotonic() - t0)
                        first = False
                        named = {"replica": ev.get("replica")}
                        if chat:
                            yield chunk("", role=True, dspark=named)
                            named = None
                    if ev.get("finished"):
                        last, finished = ev, True
                        prompt_ids = list(req["prompt_ids"]) if body.return_token_ids else None
                        yield chunk(ev.get("text", ""), ev.get("finish_reason") or "stop", token_ids=tids,
                                    dspark=self._dspark(ev, ev.get("replica")), prompt_token_ids=prompt_ids)
                        break
                    if ev.get("text") or tids or named:
                        yield chunk(ev.get("text", ""), token_ids=tids, dspark=named)
            if last is not None:
                n_prompt = len(req["prompt_ids"])
                m.finish(n_prompt, time.monotonic() - t0, last.get("stats"))
                if body.include_usage:
                    usage = Usage.of(n_prompt, last.get("completion_tokens", n_ids))
                    kind = ChatCompletionChunk if chat else CompletionChunk
                    yield _sse(kind(choices=[], usage=usage, **head))
            yield SSE_DONE
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                m.disconnects.inc()
            raise
        except Exception as e:
            yield _sse(APIError(500, f"engine failure: {type(e).__name__}: {e}", None, "engine_error").wire())
            yield SSE_DONE
        finally:
            m.in_flight.dec()

    # ------------------------------------------------------------------------------------------ routes
    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._handle(request, chat=False)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._handle(request, chat=True)

    @fastapi_app.get("/v1/models")
    async def models(self):
        return _json(ModelList(data=[ModelCard(id=mid, created=self.created, root=self.opts.target,
                                               max_model_len=self.opts.max_model_len)
                                     for mid in sorted(self.model_ids)]))

    @fastapi_app.get("/health")
    async def health(self):
        """Readiness: 200 when at least one engine replica can take a request, else 503 (starting, or down)."""
        r = await self.readiness.get(fresh=known_replicas(self.opts.engine_deployment) == 0)
        status = "ok" if r.ready else "failed" if r.failed else "starting" if r.app_status == "DEPLOYING" else \
            "unavailable"
        body = Health(status=status, model=self.opts.model_name, ready_replicas=r.ready_replicas,
                      wanted_replicas=r.wanted_replicas, replica_states=r.replica_states, detail=r.describe())
        return Response(body.model_dump_json(), status_code=200 if r.ready else 503, media_type="application/json")

    @fastapi_app.get("/livez")
    async def livez(self):
        """Liveness: the HTTP ingress answers (whether or not an engine replica is ready)."""
        return _json(Liveness(model=self.opts.model_name))

    @fastapi_app.get("/metrics")
    async def metrics_endpoint(self):
        view = self._view()
        if not view:  # no routed request yet: ask one replica directly (also instantiates the router)
            try:
                st = await asyncio.wait_for(self.engine_plain.stats.remote(), timeout=5.0)
                view = {st["replica"]: st}
            except Exception:
                view = {}
        return Response(self.metrics.exposition(view), media_type=CONTENT_TYPE)

    def _view(self) -> dict:
        return cluster_view(self.opts.engine_deployment)
