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
import dataclasses
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve import context as serve_context
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.data.prompts import chat_prompt_ids
from pipeline.core.runtime import apply_env
from serve_app.ingress_metrics import CONTENT_TYPE, IngressMetrics
from serve_app.readiness import ReadinessProbe
from serve_app.protocol import (SEED_RANGE, APIError, AssistantMessage, ChatChoice, ChatChunkChoice,
                                ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                ChatLogprobs, CompletionChoice, CompletionChunk, CompletionLogprobs,
                                CompletionRequest, CompletionResponse, Health, Liveness, ModelCard, ModelList,
                                TokenLogprob, TopLogprob, Usage)
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
        self._token_texts: dict[int, str] = {}  # token id -> its text (logprobs)
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
        reqs = [req] if body.n == 1 else [self._choice_request(req, i) for i in range(body.n)]
        if body.stream:
            self.metrics.request(endpoint, 200)
            return StreamingResponse(self._stream(rid, reqs, body, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        return await self._complete(rid, reqs, body, chat, endpoint)

    @staticmethod
    def _choice_request(req: dict, i: int) -> dict:
        """Choice i of an n > 1 request: its own engine request; with a seed, seed + i (independent samples that a
        rerun with the same seed reproduces)."""
        seed = req.get("seed")
        return {**req, "request_id": f"{req['request_id']}-{i}",
                "seed": None if seed is None else (seed + i) % SEED_RANGE}

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

    async def _events(self, req: dict, own_call_id: bool = False):
        """Engine events for one request; cancels the engine stream if the consumer goes away.  own_call_id: this
        is one of several concurrent engine calls of the same HTTP request (the n choices) and runs in a task of
        its own: give it a Serve request id of its own, since Serve's router keys its pending calls by the id every
        call made while serving the HTTP request inherits, and same-id calls in flight together never complete."""
        if own_call_id:
            ctx = serve_context._get_serve_request_context()
            serve_context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=uuid.uuid4().hex))
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

    # ------------------------------------------------------------------------------------------ logprobs
    def _token_text(self, tid: int) -> str:
        t = self._token_texts.get(tid)
        if t is None:
            t = self._token_texts[tid] = self.tok.decode([tid])
        return t

    def _chat_logprobs(self, ids: list, entries: list) -> ChatLogprobs:
        """Engine log-probabilities [(logprob, [(id, logprob)] * k)] per id -> the chat ``logprobs`` object."""
        def top(tid, lp):
            t = self._token_text(tid)
            return TopLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8")))

        return ChatLogprobs(content=[TokenLogprob(**top(tid, lp).model_dump(),
                                                  top_logprobs=[top(i, v) for i, v in alts])
                                     for tid, (lp, alts) in zip(ids, entries)])

    def _completion_logprobs(self, ids: list, entries: list, offset: int = 0) -> CompletionLogprobs:
        """... -> the completions ``logprobs`` object; text offsets count from ``offset`` characters."""
        out = CompletionLogprobs()
        for tid, (lp, alts) in zip(ids, entries):
            t = self._token_text(tid)
            out.tokens.append(t)
            out.token_logprobs.append(lp)
            out.top_logprobs.append({self._token_text(i): v for i, v in alts})
            out.text_offset.append(offset)
            offset += len(t)
        return out

    # ------------------------------------------------------------------------------------------ responses
    async def _collect(self, req: dict, t0: float, first_choice: bool = True, own_call_id: bool = False) -> dict:
        """Run one choice to its end: {"text", "ids", "logprobs", "last" (the finishing event), "replica"}; an
        engine error becomes an APIError."""
        m = self.metrics
        text, ids, lps, last, replica = [], [], [], None, None
        async with contextlib.aclosing(self._events(req, own_call_id)) as events:
            async for ev in events:
                replica = ev.get("replica", replica)
                if ev.get("error"):
                    raise APIError(int(ev.get("status", 500)), ev["error"], None,
                                   "engine_error" if ev.get("status", 500) >= 500 else "invalid_value")
                if first_choice and not ids and ev.get("token_ids"):
                    m.ttft.observe(time.monotonic() - t0)
                text.append(ev.get("text", ""))
                ids.extend(ev.get("token_ids", []))
                lps.extend(ev.get("logprobs") or [])
                m.tokens(len(ev.get("token_ids", [])))
                last = ev
        m.finish(len(req["prompt_ids"]), time.monotonic() - t0, last.get("stats") if last else None)
        return {"text": "".join(text), "ids": ids, "logprobs": lps, "last": last, "replica": replica}

    async def _complete(self, rid: str, reqs: list, body, chat: bool, endpoint: str):
        m = self.metrics
        t0 = time.monotonic()
        try:
            with m.in_flight.track_inprogress():
                if len(reqs) == 1:
                    outs = [await self._collect(reqs[0], t0)]
                else:  # the choices run side by side; one failing cancels the others
                    async with asyncio.TaskGroup() as tg:
                        tasks = [tg.create_task(self._collect(r, t0, i == 0, own_call_id=True))
                                 for i, r in enumerate(reqs)]
                    outs = [t.result() for t in tasks]
        except Exception as e:
            while isinstance(e, ExceptionGroup):  # a choice of several failed: its own error
                e = e.exceptions[0]
            if not isinstance(e, APIError):
                e = APIError(500, f"engine failure: {type(e).__name__}: {e}", None, "engine_error")
            m.request(endpoint, e.status)
            return e.response()
        n_prompt = len(reqs[0]["prompt_ids"])
        m.request(endpoint, 200)
        choices, n_out = [], 0
        for i, o in enumerate(outs):
            last = o["last"] or {}
            n_out += last.get("completion_tokens", len(o["ids"]))
            finish = last.get("finish_reason") or "stop"
            extra = {"token_ids": o["ids"], "prompt_token_ids": list(reqs[0]["prompt_ids"])} \
                if body.return_token_ids else {}
            if body.logprobs_wanted() is not None:
                extra["logprobs"] = (self._chat_logprobs if chat else self._completion_logprobs)(o["ids"],
                                                                                                 o["logprobs"])
            if chat:
                choices.append(ChatChoice(index=i, message=AssistantMessage(content=o["text"]), finish_reason=finish,
                                          **extra))
            else:
                choices.append(CompletionChoice(index=i, text=o["text"], finish_reason=finish, **extra))
        replica = outs[0]["replica"]
        dspark = self._dspark(outs[0]["last"], replica)
        if len(outs) > 1:
            dspark["choices"] = [self._dspark(o["last"], o["replica"]) for o in outs]
        common = dict(id=rid, created=int(time.time()), model=body.model, usage=Usage.of(n_prompt, n_out),
                      dspark=dspark)
        resp = (ChatCompletionResponse if chat else CompletionResponse)(choices=choices, **common)
        return _json(resp, headers={"X-DSpark-Replica": str(replica), "X-Request-Id": rid})

    async def _choice_events(self, reqs: list):
        """(choice index, engine event) of every choice, as they come; the streams of the others are cancelled
        when the consumer stops."""
        if len(reqs) == 1:
            async with contextlib.aclosing(self._events(reqs[0])) as events:
                async for ev in events:
                    yield 0, ev
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: dict):
            try:
                async with contextlib.aclosing(self._events(req, own_call_id=True)) as events:
                    async for ev in events:
                        await queue.put((i, ev))
            except Exception as e:
                await queue.put((i, {"error": f"engine failure: {type(e).__name__}: {e}", "status": 500,
                                     "finished": True}))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            open_ = len(tasks)
            while open_:
                i, ev = await queue.get()
                if ev is None:
                    open_ -= 1
                    continue
                yield i, ev
        finally:
            for t in tasks:
                t.cancel()

    async def _stream(self, rid: str, reqs: list, body, chat: bool):
        m = self.metrics
        t0 = time.monotonic()
        head = dict(id=rid, created=int(time.time()), model=body.model)
        n = len(reqs)
        started, n_ids, last, offsets = [False] * n, [0] * n, [None] * n, [0] * n
        want_lp = body.logprobs_wanted() is not None
        finished_all = False

        def chunk(i, text=None, finish=None, role=False, token_ids=None, ids=(), lps=None, **extra) -> bytes:
            """One SSE chunk of choice i; ``ids`` / ``lps``: the event's token ids and their log-probabilities."""
            if chat:
                delta = ChatDelta(role="assistant" if role else None, content=text)
                lp = self._chat_logprobs(ids, lps) if lps is not None else None
                return _sse(ChatCompletionChunk(choices=[ChatChunkChoice(index=i, delta=delta, finish_reason=finish,
                                                                         logprobs=lp, token_ids=token_ids)],
                                                **head, **extra))
            lp = None
            if lps is not None:
                lp = self._completion_logprobs(ids, lps, offsets[i])
                offsets[i] += sum(len(t) for t in lp.tokens)
            return _sse(CompletionChunk(choices=[CompletionChoice(index=i, text=text or "", finish_reason=finish,
                                                                  logprobs=lp, token_ids=token_ids)],
                                        **head, **extra))

        m.in_flight.inc()
        try:
            async with contextlib.aclosing(self._choice_events(reqs)) as events:
                async for i, ev in events:
                    if ev.get("error"):
                        yield _sse(APIError(int(ev.get("status", 500)), ev["error"], None, "engine_error").wire())
                        finished_all = True
                        break
                    ids = ev.get("token_ids", [])
                    n_ids[i] += len(ids)
                    m.tokens(len(ids))
                    tids = list(ids) if body.return_token_ids else None
                    lps = (ev.get("logprobs") or []) if want_lp else None
                    named = None
                    if not started[i]:  # the first chunk of a choice names the replica
                        if not any(started):
                            m.ttft.observe(time.monotonic() - t0)
                        started[i] = True
                        named = {"replica": ev.get("replica")}
                        if chat:
                            yield chunk(i, "", role=True, dspark=named)
                            named = None
                    text = ev.get("text", "")
                    if ev.get("finished"):
                        last[i] = ev
                        prompt_ids = list(reqs[i]["prompt_ids"]) if body.return_token_ids else None
                        yield chunk(i, text, ev.get("finish_reason") or "stop", token_ids=tids, ids=ids, lps=lps,
                                    dspark=self._dspark(ev, ev.get("replica")), prompt_token_ids=prompt_ids)
                        m.finish(len(reqs[i]["prompt_ids"]), time.monotonic() - t0, ev.get("stats"))
                        if all(x is not None for x in last):
                            finished_all = True
                            break
                    elif text or tids or named or lps:
                        yield chunk(i, text, token_ids=tids, dspark=named, ids=ids, lps=lps)
            if finished_all and all(x is not None for x in last) and body.include_usage:
                usage = Usage.of(len(reqs[0]["prompt_ids"]),
                                 sum(x.get("completion_tokens", k) for x, k in zip(last, n_ids)))
                kind = ChatCompletionChunk if chat else CompletionChunk
                yield _sse(kind(choices=[], usage=usage, **head))
            yield SSE_DONE
        except (asyncio.CancelledError, GeneratorExit):
            if not finished_all:
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
