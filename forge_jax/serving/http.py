"""An OpenAI-compatible HTTP API over a :class:`forge_jax.serving.engine.Engine`, as a
Starlette app (served by uvicorn: ``forge-jax serve``, :mod:`forge_jax.serving.server`).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (server-sent events with
``"stream": true``; ``n`` choices per prompt, several prompts per completions call),
``GET /v1/models``, ``GET /health`` (503 while warming up or shutting down) and
``GET /metrics`` (Prometheus, :mod:`forge_jax.serving.metrics`). Request bodies are read
under a size limit and a deadline and checked parameter by parameter
(:mod:`forge_jax.serving.openai_params`); the API key and the Host header are checked
before any route (:mod:`forge_jax.serving.protection`). Text too long for the context is
refused before it is tokenized; tokenizing and chat templates run off the event loop.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for
anything wrong in what the client sent (JSON, a parameter, a text the tokenizer or the chat
template cannot take, a prompt over the context), 401 without the API key, 404 for an
unknown model or route, 408 and 413 for a slow or oversized body, 429 (with
``Retry-After``) when the queue is full, 503 while warming up or shutting down, 500 only
for the server's own faults (never with a traceback). A client that disconnects, mid-stream
or while it waits for a whole answer, cancels its requests (their pages are freed); the log
says so in one line.

Each choice carries its ``token_ids`` besides OpenAI's fields. Log-probabilities, ``echo``,
structured output (``response_format``, vLLM's ``guided_*``) and tool calls are put in
OpenAI's shapes by :mod:`forge_jax.serving.openai_features`; a constrained request whose
grammar the grammar engine rejects is a 400 before any work.

Starlette rather than FastAPI: the API is six routes whose validation must give OpenAI's
error shape (FastAPI's pydantic validation answers 422 in its own shape, which would have
to be overridden), and Starlette is the part of FastAPI this needs, with fewer dependencies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import logging
import time
import uuid

from forge_jax.generation import scoring
from forge_jax.generation.constraints import ConstraintError
from forge_jax.serving import engine as serving
from forge_jax.serving import openai_features, openai_params, protection
from forge_jax.serving.metrics import CONTENT_TYPE, Metrics  # noqa: F401  (the app's API)
from forge_jax.serving.openai_params import APIError  # noqa: F401  (the app's API)
from forge_jax.text import api as text

log = logging.getLogger("forge_jax.serve")

# A text this many times longer (in characters) than the longest token, times the context,
# cannot fit: it is refused before it is tokenized (2: room for a normalizer that composes
# characters).
_LENGTH_SLACK = 2


@dataclasses.dataclass(frozen=True)
class HTTPConfig:
    """How the app protects itself (``forge-jax serve``'s flags).

    Attributes:
      api_key: the key clients send as ``Authorization: Bearer KEY`` on every route but
        ``/health`` (None: none needed).
      allowed_hosts: the Host header names served (None: any).
      max_request_bytes: a request body's size at most (413 past it).
      body_timeout: seconds a request's body may take to arrive (408 past it; None: any).
      warm_up: compile the engine's step variants before ``/health`` says ready (requests
        meanwhile get 503).
      shutdown_timeout: seconds the requests in flight get to finish at shutdown.
    """

    api_key: str | None = None
    allowed_hosts: frozenset[str] | None = None
    max_request_bytes: int = 4 * 2**20
    body_timeout: float | None = 30.0
    warm_up: bool = False
    shutdown_timeout: float = 5.0


def _check_text(value: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{where} is not valid Unicode: a lone surrogate "
                            f"{value[e.start]!r} at character {e.start}",
                       param=where.split("[")[0].split(".")[0]) from None


def create_app(engine: serving.Engine, *, model_name: str, tokenizer: text.Tokenizer | None,
               default_max_tokens: int | None = None, shutdown_wait: float | None = None,
               config: HTTPConfig | None = None):
    """The Starlette app; its lifespan starts the engine's loop (and warms it up, with
    ``config.warm_up``) and, at shutdown, finishes or cancels the requests in flight and logs
    how many.

    Args:
      engine: the :class:`~forge_jax.serving.engine.Engine` serving the requests.
      model_name: the model's id in the API.
      tokenizer: the checkpoint's tokenizer (None: token ids only).
      default_max_tokens: a request's ``max_tokens`` when it gives none, at most the context
        it leaves (None: the context it leaves).
      shutdown_wait: ``config.shutdown_timeout`` (kept for the keyword's callers).
      config: an :class:`HTTPConfig` (None: its defaults).
    """
    import contextlib

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    config = HTTPConfig() if config is None else config
    if shutdown_wait is not None:
        config = dataclasses.replace(config, shutdown_timeout=shutdown_wait)
    metrics = Metrics(engine)
    pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="forge-jax-tokenize")
    capacity = min(engine.max_model_len, engine.manager.num_pages * engine.page_size)
    longest_token = 1
    if tokenizer is not None:
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        longest_token = max((len(t) for t in vocab), default=1)
    max_chars = _LENGTH_SLACK * longest_token * capacity

    def error(e: APIError) -> JSONResponse:
        headers = dict(e.headers)
        if e.status == 429:
            headers.setdefault("Retry-After", "1")
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def read_json(request: Request):
        raw = await protection.read_body(request.receive, request.headers,
                                         limit=config.max_request_bytes,
                                         timeout=config.body_timeout)
        if len(raw) < 2**16:
            return decode_json(raw)
        return await asyncio.get_running_loop().run_in_executor(pool, decode_json, raw)

    def decode_json(raw: bytes):
        try:
            body = json.loads(raw)
        except RecursionError:
            raise APIError(400, "the body nests JSON too deeply") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        if not openai_params.json_depth_ok(body):
            raise APIError(400, f"the body nests JSON deeper than "
                                f"{openai_params.MAX_JSON_DEPTH} levels")
        return body

    def refuse_long(chars: int, where: str) -> None:
        if chars > max_chars:
            raise APIError(400, f"{where} has {chars} characters: at least "
                                f"{-(-chars // (_LENGTH_SLACK * longest_token))} tokens, more "
                                f"than the context of {capacity} tokens",
                           param=where.split("[")[0], code="context_length_exceeded")

    def encode_chat(messages: list[dict], variables: dict) -> list[int]:
        try:
            text.check_messages(messages)
        except (ValueError, TypeError) as e:  # a malformed message, named
            raise APIError(400, str(e), param="messages") from None
        try:
            return text.encode_chat(tokenizer, messages, **variables)
        except text.ChatTemplateError as e:  # no template, or it raised (raise_exception)
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # the template or the tokenizer failed on these messages
            raise APIError(400, f"these messages cannot be rendered or encoded: "
                                f"{type(e).__name__}: {e}", param="messages") from None

    def encode_text(prompt: str, where: str) -> list[int]:
        try:
            return tokenizer.encode(prompt)
        except Exception as e:  # the tokenizers library raises its own exception types
            raise APIError(400, f"{where} cannot be encoded: {type(e).__name__}: {e}",
                           param="prompt") from None

    async def prompt_ids(req: openai_params.ParsedRequest) -> list[list[int]]:
        """Each prompt's token ids, the text checked and tokenized off the event loop."""
        loop = asyncio.get_running_loop()
        if req.chat:
            if tokenizer is None:
                raise APIError(400, "this checkpoint has no tokenizer: use /v1/completions "
                                    "with token ids")
            for i, m in enumerate(req.messages):
                _check_text(m["content"], f"messages[{i}].content")
            refuse_long(sum(len(m["content"]) for m in req.messages), "messages")
            variables = openai_features.template_variables(req.values)  # tools
            return [await loop.run_in_executor(pool, encode_chat, req.messages, variables)]
        out = []
        for i, prompt in enumerate(req.prompts):
            where = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise APIError(400, "this checkpoint has no tokenizer: send token ids",
                                   param="prompt")
                _check_text(prompt, where)
                refuse_long(len(prompt), where)
                prompt = await loop.run_in_executor(pool, encode_text, prompt, where)
            out.append(prompt)
        return out

    def submit(req: openai_params.ParsedRequest, prompts: list[list[int]]):
        """The streams of every choice (prompt-major, as OpenAI numbers them)."""
        streams = []
        try:
            for ids in prompts:
                room = capacity - len(ids)
                max_tokens = req.max_tokens
                if max_tokens is None:
                    if room < 1:
                        raise APIError(400, f"the prompt has {len(ids)} tokens, leaving no "
                                            f"room in the context of {capacity} tokens",
                                       param="messages" if req.chat else "prompt",
                                       code="context_length_exceeded")
                    max_tokens = min(room, default_max_tokens or room)
                for j in range(req.n):
                    seed = req.params.seed
                    params = dataclasses.replace(
                        req.params, max_tokens=max_tokens,
                        seed=None if seed is None else (seed + j) % 2**32)
                    streams.append(engine.submit(ids, params))
        except ConstraintError as e:  # the grammar is refused before any work
            cancel(streams)
            raise APIError(400, str(e), param=openai_features.constraint_param(req.values),
                           code="invalid_grammar") from None
        except serving.RequestRefused as e:
            cancel(streams)
            raise APIError(400, str(e), param="messages" if req.chat else "prompt",
                           code="invalid_token_id" if "vocabulary" in str(e) else
                           "context_length_exceeded") from None
        except serving.QueueFull as e:
            cancel(streams)
            if engine.stopping or state.stopping:
                raise APIError(503, "the server is shutting down", type="server_error",
                               code="shutting_down") from None
            raise APIError(429, str(e), type="rate_limit_error",
                           code="rate_limit_exceeded") from None
        except BaseException:
            cancel(streams)
            raise
        return streams

    async def echoed(req: openai_params.ParsedRequest, prompts: list[list[int]]):
        """Completions' ``echo``: each prompt's ``(text, entries)``, ``entries`` its tokens'
        log-probabilities (scored off the event loop) when ``logprobs`` is asked; None
        without ``echo``."""
        if req.chat or not req.values.get("echo"):
            return None
        k = req.params.sampling.logprobs
        loop = asyncio.get_running_loop()
        out = []
        for prompt, ids in zip(req.prompts, prompts, strict=True):
            prompt_text = prompt if isinstance(prompt, str) else (
                tokenizer.decode(ids) if tokenizer is not None else "")
            entries = None if k is None else await loop.run_in_executor(
                pool, functools.partial(scoring.sequence_logprobs, engine.model, ids, k,
                                        graphdef=engine.graphdef, state=engine.state))
            out.append((prompt_text, entries))
        return out

    def cancel(streams) -> None:
        for s in streams:
            if s.finish_reason is None:
                s.cancel()

    async def merged(streams):
        """``(choice index, Output)`` of every stream as they come, until all finished."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, stream):
            try:
                async for out in stream:
                    await queue.put((i, out))
            except Exception as e:  # noqa: BLE001  (handed to the consumer)
                await queue.put((i, e))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            left = len(streams)
            while left:
                i, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out.finish_reason is not None:
                    left -= 1
                yield i, out
        finally:
            for t in tasks:
                t.cancel()

    async def completions(request: Request, chat: bool):
        start = time.monotonic()
        try:
            if engine.stopping or state.stopping:
                raise APIError(503, "the server is shutting down", type="server_error",
                               code="shutting_down")
            if not state.ready:
                raise APIError(503, "the server is warming up (compiling its steps): retry "
                                    "when /health says ok", type="server_error",
                               code="warming_up", headers={"Retry-After": "5"})
            req = openai_params.parse(await read_json(request), chat=chat,
                                      model_name=model_name, vocab_size=engine.vocab_size)
            prompts = await prompt_ids(req)
            echoes = await echoed(req, prompts)
            streams = submit(req, prompts)
        except APIError as e:
            log.info("%s %s %d %s", request.method, request.url.path, e.status, e)
            return error(e)
        except Exception as e:
            log.exception("%s %s 500: %s", request.method, request.url.path, e)
            return error(APIError(500, f"internal error ({type(e).__name__}); the server's log "
                                       f"has the details", type="server_error"))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        n_prompt = sum(len(ids) for ids in prompts)
        completion = [0] * len(streams)
        reasons: list[str | None] = [None] * len(streams)
        shapes = [openai_features.Choice(req.values, tokenizer, chat=chat,
                                         echo=echoes[i // req.n] if echoes else None)
                  for i in range(len(streams))]

        def usage():
            return {"prompt_tokens": n_prompt, "completion_tokens": sum(completion),
                    "total_tokens": n_prompt + sum(completion)}

        def done(outcome: str | None = None):
            log.info("%s %s %d prompt=%d completion=%d finish=%s %.3fs", request.method,
                     request.url.path, 200, n_prompt, sum(completion),
                     outcome or ",".join(str(r) for r in reasons), time.monotonic() - start)

        if req.stream:
            def chunk(i, piece, token_ids, reason, role=False, logprobs=()):
                if chat and role:
                    choice = {"index": i, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": reason, "logprobs": None,
                              "token_ids": token_ids}
                else:
                    choice = dict(index=i, **shapes[i].piece(piece, logprobs, reason),
                                  token_ids=token_ids)
                return {"id": rid, "object": f"{obj}.chunk" if chat else obj, "created": created,
                        "model": model_name, "choices": [choice]}

            def event(payload) -> str:
                return f"data: {json.dumps(payload)}\n\n"

            async def events():
                ended = False
                try:
                    if chat:
                        for i in range(len(streams)):
                            yield event(chunk(i, "", [], None, role=True))
                    async for i, out in merged(streams):
                        completion[i], reasons[i] = out.completion_tokens, out.finish_reason
                        yield event(chunk(i, out.text, list(out.token_ids), out.finish_reason,
                                          logprobs=out.logprobs))
                    if req.include_usage:
                        yield event({"id": rid, "object": f"{obj}.chunk" if chat else obj,
                                     "created": created, "model": model_name, "choices": [],
                                     "usage": usage()})
                    yield "data: [DONE]\n\n"
                    ended = True
                finally:
                    cancel(streams)  # the client went away: free the pages
                    done(None if ended else "disconnected")

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        pieces = [[] for _ in streams]
        token_ids = [[] for _ in streams]
        entries = [[] for _ in streams]
        errors = []
        # Nothing is sent until the end, so only the connection says the client left:
        # Starlette does not end this handler then; the watcher cancels the requests.
        watcher = asyncio.ensure_future(cancel_on_disconnect(request, streams))
        try:
            async for i, out in merged(streams):
                pieces[i].append(out.text)
                token_ids[i] += out.token_ids
                entries[i] += out.logprobs
                completion[i], reasons[i] = out.completion_tokens, out.finish_reason
                if out.error:
                    errors.append(out.error)
        finally:
            watcher.cancel()
            cancel(streams)
        done()
        if errors:
            return error(APIError(500, errors[0], type="server_error"))
        choices = []
        for i in range(len(streams)):
            content = "".join(pieces[i])
            choice = dict(index=i, **shapes[i].whole(content, entries[i], reasons[i]))
            choice["token_ids"] = token_ids[i]
            choices.append(choice)
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                             "choices": choices, "usage": usage()})

    async def cancel_on_disconnect(request: Request, streams):
        """Cancels ``streams`` when the client disconnects (the body has been read, so the
        next ASGI message is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel(streams)

    async def chat_completions(request: Request):
        return await completions(request, chat=True)

    async def text_completions(request: Request):
        return await completions(request, chat=False)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": int(engine.stats.created),
             "owned_by": "forge_jax", "max_model_len": engine.max_model_len}]})

    async def health(request: Request):
        if engine.stopping or state.stopping:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "warming up"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def prometheus(request: Request):
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def http_error(request: Request, exc: HTTPException):
        return error(APIError(exc.status_code, f"{request.method} {request.url.path}: "
                              f"{exc.detail}", code=str(exc.status_code)))

    async def server_error(request: Request, exc: Exception):
        return error(APIError(500, f"internal error ({type(exc).__name__}); the server's log "
                                   f"has the details", type="server_error"))

    def warm_up():
        from forge_jax.serving import server

        began = time.monotonic()
        log.info("warming up: compiling the step for each row bucket, greedy and sampled "
                 "(/health says ok when done)")
        try:
            variants = server.warm_up(engine)
        except serving.QueueFull:  # shutting down meanwhile
            return
        except Exception as e:  # the step itself fails: requests will say so (500)
            log.error("the warm-up failed (%s: %s); serving without it", type(e).__name__, e)
            state.ready = True
            return
        state.ready = True
        log.info("warmed up: %d step variants compiled in %.1f s", variants,
                 time.monotonic() - began)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        state.ready = not config.warm_up
        if config.warm_up:
            asyncio.get_running_loop().run_in_executor(None, warm_up)
        log.info("serving %s", model_name)
        yield
        counts = getattr(app.state, "drained", None) or engine.shutdown(
            wait=config.shutdown_timeout)
        pool.shutdown(wait=False, cancel_futures=True)
        log.info("shut down: %d requests in flight finished, %d cancelled",
                 counts["finished"], counts["cancelled"])

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", text_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"])]
    guard = Middleware(protection.Guard, api_key=config.api_key,
                       allowed_hosts=config.allowed_hosts)
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[guard],
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    state = app.state
    state.ready = not config.warm_up
    state.stopping = False  # set by the server's drain: new requests get 503
    state.drained = None
    return app
