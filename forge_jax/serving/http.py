"""An OpenAI-compatible HTTP API over a :class:`forge_jax.serving.engine.Engine`, as a
Starlette app (served by uvicorn: ``forge-jax serve``).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus'
text format). Errors have OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``: 400 for malformed JSON, an unknown model, bad parameter values or a prompt over
the context; 429 when the queue is full; 503 while shutting down. A client that
disconnects, mid-stream or while it waits for a whole answer, cancels its request (its pages
are freed).

Besides OpenAI's parameters a request may carry ``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids`` and ``ignore_eos`` (the ``openai`` client's
``extra_body``); each choice carries its ``token_ids``.

Starlette rather than FastAPI: the API is six routes whose validation must give OpenAI's
error shape (FastAPI's pydantic validation answers 422 in its own shape, which would have
to be overridden), and Starlette is the part of FastAPI this needs, with fewer dependencies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Mapping

from forge_jax.generation.sampling import SamplingParams
from forge_jax.serving import engine as serving
from forge_jax.text import api as text

log = logging.getLogger("forge_jax.serve")

_OPENAI_KEYS = {"temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "stop",
                "stream", "stream_options", "n", "model", "user", "frequency_penalty",
                "presence_penalty", "logprobs", "top_logprobs", "echo", "suffix", "best_of",
                "logit_bias", "messages", "prompt", "response_format",
                "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}


def _number(body: Mapping, name: str, default, *, kind=float, low=None, high=None,
            low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if ok:
        value = kind(value)
        ok = math.isfinite(value) and (low is None or (value > low if low_open else value >= low)
                                       ) and (high is None or value <= high)
    if not ok:
        bounds = f"{'(' if low_open else '['}{low}, {'inf' if high is None else high}]"
        raise APIError(400, f"{name} must be a{'n integer' if kind is int else ' number'} in "
                            f"{bounds}, got {value!r}", param=name)
    return value


def request_params(body: Mapping, *, default_max_tokens: int) -> serving.RequestParams:
    """The engine's parameters of an OpenAI request body (APIError 400 naming a bad one)."""
    if body.get("n", 1) != 1 or body.get("best_of", 1) not in (1, None):
        raise APIError(400, "only n=1 is supported", param="n")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"stop must be a string or a list of non-empty strings, got "
                            f"{body.get('stop')!r}", param="stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise APIError(400, f"stop_token_ids must be a list of ints, got {stop_ids!r}",
                       param="stop_token_ids")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", default_max_tokens,
                         kind=int, low=1)
    top_k = _number(body, "top_k", None, kind=int, low=-1)
    seed = _number(body, "seed", None, kind=int, low=0, high=2**32 - 1)
    penalty = _number(body, "repetition_penalty", None, low=0, low_open=True)
    try:
        sampling = SamplingParams(
            temperature=_number(body, "temperature", 1.0, low=0, high=2),
            top_k=None if top_k in (None, -1, 0) else top_k,
            top_p=_number(body, "top_p", None, low=0, high=1, low_open=True),
            min_p=_number(body, "min_p", None, low=0, high=1), repetition_penalty=penalty)
        return serving.RequestParams(
            max_tokens=max_tokens, sampling=sampling, seed=seed,
            stop_token_ids=tuple(stop_ids), stop=tuple(stop),
            ignore_eos=bool(body.get("ignore_eos", False)))
    except ValueError as e:
        raise APIError(400, str(e)) from None


class Metrics:
    """Prometheus text of an engine's gauges, counters and histograms."""

    def __init__(self, engine: serving.Engine):
        self.engine = engine

    def render(self) -> str:
        e = self.engine
        g, s = e.snapshot(), e.stats
        prefix = g.get("prefix")
        lines = []

        def metric(name, kind, help, value, labels=""):
            lines.extend([f"# HELP forge_jax_{name} {help}", f"# TYPE forge_jax_{name} {kind}",
                          f"forge_jax_{name}{labels} {value}"])

        metric("requests_running", "gauge", "Requests running.", g["running"])
        metric("requests_waiting", "gauge", "Requests waiting.", g["waiting"])
        metric("pages_total", "gauge", "Pages in the pool.", g.get("pages_total", 0))
        metric("pages_used", "gauge", "Pages in use (requests and prefix cache).",
               g.get("pages_used", 0))
        metric("pages_cached", "gauge", "Pages held by the prefix cache.",
               g.get("pages_cached", 0))
        metric("pages_reclaimable", "gauge", "Cached pages no request holds.",
               g.get("pages_reclaimable", 0))
        if prefix is not None:
            metric("prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix cache "
                   "over tokens looked up.", f"{prefix.hit_rate:.6f}")
            metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens not prefilled "
                   "again.", prefix.hit_tokens)
            metric("prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up.",
                   prefix.queried_tokens)
            metric("prefix_cache_reused_pages_total", "counter", "Cached pages reused.",
                   prefix.reused_pages)
        metric("generated_tokens_total", "counter", "Tokens generated.", s.generated_tokens)
        metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", s.prompt_tokens)
        metric("tokens_per_second", "gauge", "Tokens generated per second over the last "
               "10 s.", f"{s.tokens_per_second():.3f}")
        metric("preemptions_total", "counter", "Requests preempted (recomputed later).",
               s.preemptions)
        metric("step_variants", "gauge", "Compiled shapes of the step.", len(s.compiled))
        lines += ["# HELP forge_jax_requests_finished_total Requests finished, by reason.",
                  "# TYPE forge_jax_requests_finished_total counter"]
        lines += [f'forge_jax_requests_finished_total{{reason="{r}"}} {n}'
                  for r, n in s.finished.items()]
        for name, help, h in (("time_to_first_token_seconds", "Time to first token.", s.ttft),
                              ("inter_token_latency_seconds", "Time between tokens.",
                               s.inter_token)):
            lines += [f"# HELP forge_jax_{name} {help}", f"# TYPE forge_jax_{name} histogram"]
            for bound, count in h.cumulative():
                lines.append(f'forge_jax_{name}_bucket{{le="{bound}"}} {count}')
            lines += [f"forge_jax_{name}_sum {h.total:.6f}", f"forge_jax_{name}_count {h.count}"]
        return "\n".join(lines) + "\n"


def create_app(engine: serving.Engine, *, model_name: str, tokenizer: text.Tokenizer | None,
               default_max_tokens: int = 256, shutdown_wait: float = 5.0):
    """The Starlette app; its lifespan starts the engine's loop and, at shutdown, finishes
    or cancels the requests in flight and logs how many."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    metrics = Metrics(engine)

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def read_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}")
        if body.get("model") not in (None, model_name):
            raise APIError(400, f"the model {body.get('model')!r} does not exist; this server "
                                f"serves {model_name!r}", param="model",
                           code="model_not_found")
        unknown = sorted(set(body) - _OPENAI_KEYS)
        if unknown:
            raise APIError(400, f"unknown parameter {unknown[0]!r}", param=unknown[0])
        return body

    def prompt_ids(body: dict, chat: bool) -> list[int]:
        if chat:
            if tokenizer is None:
                raise APIError(400, "this checkpoint has no tokenizer: use /v1/completions "
                                    "with token ids")
            try:
                return text.encode_chat(tokenizer, body.get("messages"))
            except (ValueError, TypeError) as e:  # ChatTemplateError is a ValueError
                raise APIError(400, str(e), param="messages") from None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            if tokenizer is None:
                raise APIError(400, "this checkpoint has no tokenizer: send token ids",
                               param="prompt")
            return tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise APIError(400, f"prompt must be a non-empty string or list of token ids (one "
                            f"prompt), got {prompt!r:.80}", param="prompt")

    async def completions(request: Request, chat: bool):
        start = time.monotonic()
        try:
            body = await read_body(request)
            ids = prompt_ids(body, chat)
            params = request_params(body, default_max_tokens=default_max_tokens)
            try:
                stream = engine.submit(ids, params)
            except serving.RequestRefused as e:
                raise APIError(400, str(e), param="messages" if chat else "prompt",
                               code="context_length_exceeded") from None
            except serving.QueueFull as e:
                status = 503 if engine.stopping else 429
                raise APIError(status, str(e), type="server_error" if status == 503 else
                               "rate_limit_error") from None
        except APIError as e:
            log.info("%s %s %d %s", request.method, request.url.path, e.status, e)
            return error(e)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        usage = lambda out: {"prompt_tokens": len(ids),
                             "completion_tokens": out.completion_tokens if out else 0,
                             "total_tokens": len(ids) + (out.completion_tokens if out else 0)}

        def done(last, outcome):
            log.info("%s %s %d prompt=%d completion=%d finish=%s %.3fs", request.method,
                     request.url.path, 200, len(ids), last.completion_tokens if last else 0,
                     outcome, time.monotonic() - start)

        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            def chunk(piece, token_ids, reason, role=False):
                if chat:
                    delta = {"role": "assistant", "content": ""} if role else {}
                    if piece or not role:
                        delta["content"] = piece
                    choice = {"index": 0, "delta": delta, "finish_reason": reason,
                              "token_ids": token_ids}
                else:
                    choice = {"index": 0, "text": piece, "finish_reason": reason,
                              "logprobs": None, "token_ids": token_ids}
                return {"id": rid, "object": f"{obj}.chunk" if chat else obj, "created": created,
                        "model": model_name, "choices": [choice]}

            async def events():
                last, outcome = None, "disconnected"
                try:
                    if chat:
                        yield f"data: {json.dumps(chunk('', [], None, role=True))}\n\n"
                    async for out in stream:
                        last = out
                        yield f"data: {json.dumps(chunk(out.text, list(out.token_ids), out.finish_reason))}\n\n"  # noqa: E501
                    outcome = last.finish_reason
                    if include_usage:
                        tail = {"id": rid, "object": f"{obj}.chunk" if chat else obj,
                                "created": created, "model": model_name, "choices": [],
                                "usage": usage(last)}
                        yield f"data: {json.dumps(tail)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    if stream.finish_reason is None:  # the client went away: free its pages
                        stream.cancel()
                    done(last, outcome)

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        pieces, token_ids, last = [], [], None
        # Nothing is sent until the end, so only the connection says the client left:
        # Starlette does not end this handler then; the watcher cancels the request.
        watcher = asyncio.ensure_future(cancel_on_disconnect(request, stream))
        try:
            async for out in stream:
                pieces.append(out.text)
                token_ids += out.token_ids
                last = out
        finally:
            watcher.cancel()
            if stream.finish_reason is None:
                stream.cancel()
        done(last, last.finish_reason)
        if last.finish_reason == "error":
            return error(APIError(500, last.error or "the step failed", type="server_error"))
        content = "".join(pieces)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content},
                   "finish_reason": last.finish_reason, "logprobs": None}
                  if chat else {"index": 0, "text": content, "finish_reason": last.finish_reason,
                                "logprobs": None})
        choice["token_ids"] = token_ids
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                             "choices": [choice], "usage": usage(last)})

    async def cancel_on_disconnect(request: Request, stream: serving.RequestStream):
        """Cancels ``stream`` when the client disconnects (the body has been read, so the
        next ASGI message is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        stream.cancel()

    async def chat_completions(request: Request):
        return await completions(request, chat=True)

    async def text_completions(request: Request):
        return await completions(request, chat=False)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": int(engine.stats.created),
             "owned_by": "forge_jax"}]})

    async def health(request: Request):
        if engine.stopping:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def prometheus(request: Request):
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: HTTPException):
        return error(APIError(exc.status_code, f"{request.method} {request.url.path}: "
                              f"{exc.detail}", code=str(exc.status_code)))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        log.info("serving %s", model_name)
        yield
        counts = engine.shutdown(wait=shutdown_wait)
        log.info("shut down: %d requests in flight finished, %d cancelled",
                 counts["finished"], counts["cancelled"])

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", text_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error})
