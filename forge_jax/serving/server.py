"""Running the OpenAI-compatible app under uvicorn: a listening socket bound before the
model loads (:func:`bind`), a connection limit and a deadline for a request's headers
(:func:`protocol_class`), the engine warmed up before ``/health`` says ready
(:func:`warm_up`), and a shutdown that lets streams end
(:func:`draining_server_class`).

On SIGTERM or SIGINT the server keeps its connections and its listening socket while the
engine drains: new requests get 503 in OpenAI's shape, the requests in flight finish for up
to ``shutdown_timeout`` seconds, the rest end with ``finish_reason: "cancelled"`` (streams
get their final chunk and ``data: [DONE]``); then uvicorn closes the connections and the
process exits with status 0. A second signal cancels the requests left at once; a third
exits without waiting for anything.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import threading
import time

import numpy as np

from forge_jax.generation.sampling import SamplingParams
from forge_jax.serving.requests import EngineStats, RequestParams

log = logging.getLogger("forge_jax.serve")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port), for uvicorn.

    Raises:
      OSError: the address is in use or cannot be bound (its errno and message).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500
                                 else "invalid_request_error", "param": None, "code": code}})
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n{body}").encode()


def protocol_class(*, max_connections: int | None, header_timeout: float | None):
    """uvicorn's h11 protocol with a connection limit (the connection past it is answered
    503 in OpenAI's shape and closed) and a deadline for each request's headers (a client
    that sends part of them and stalls is answered 408 and closed)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            if max_connections is not None and len(self.connections) > max_connections:
                log.warning("refused a connection: %d open, the limit is %d",
                            len(self.connections) - 1, max_connections)
                transport.write(_raw_response(
                    503, "Service Unavailable", f"too many connections (the limit is "
                    f"{max_connections}): retry later", "too_many_connections"))
                transport.close()
                return
            self._arm()

        def _arm(self):
            if header_timeout is not None and self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def data_received(self, data):
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and (self.cycle is None
                                                      or self.cycle.response_complete):
                self._arm()  # waiting for (the rest of) a request's headers
            else:
                self._disarm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _headers_late(self):
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return
            if self.conn.trailing_data[0]:  # part of a request came: say why it ends
                self.transport.write(_raw_response(
                    408, "Request Timeout", f"the request's headers did not arrive within "
                    f"{header_timeout:g} s", "request_timeout"))
            self.transport.close()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def send_400_response(self, msg: str) -> None:
            # Malformed HTTP: uvicorn's 400, in OpenAI's shape.
            self.transport.write(_raw_response(400, "Bad Request", msg, "invalid_http"))
            self.transport.close()

    return Protocol


def warm_up(engine, *, seed: int = 0) -> int:
    """Compiles the engine's step for each row bucket, greedy and sampled, by running short
    requests of random tokens through it (the engine must be started); then resets its
    counters and the prefix cache's, so that ``/metrics`` counts clients' requests only (the
    warm-up's pages stay cached until evicted); with speculative decoding, its steps too
    (:func:`_warm_up_speculation`). Returns the number of compiled variants."""
    rng = np.random.default_rng(seed)
    rows, buckets = engine.min_batch_tokens, []
    while rows <= engine.max_batch_tokens:
        buckets.append(rows)
        rows *= 2
    for temperature in (0.0, 1.0):
        params = RequestParams(max_tokens=2, sampling=SamplingParams(temperature=temperature),
                               seed=seed, ignore_eos=True)
        for length in buckets:
            if length + 2 > engine.max_model_len or -(-(length + 2) // engine.page_size) > \
                    engine.manager.num_pages:
                continue
            prompt = rng.integers(0, engine.vocab_size, length).tolist()
            engine.submit(prompt, params, loop=None).result()
    if engine.config.speculative is not None:
        _warm_up_speculation(engine, rng, seed)
    compiled = engine.stats.compiled
    engine.stats = EngineStats()
    engine.stats.compiled = compiled
    engine.prefix_cache.stats = type(engine.prefix_cache.stats)()
    return len(compiled)


def _warm_up_speculation(engine, rng, seed: int) -> None:
    """Compiles the speculative steps (verification, and a draft model's steps) for 1, 2,
    4, ... concurrent speculating requests, as many as a step holds, greedy and sampled
    (prompt lookup drafts the last token while ``engine.warming_up``: any drafts compile
    the same steps)."""
    k = engine.config.speculative.num_tokens
    engine.warming_up = True
    try:
        for temperature in (0.0, 1.0):
            params = RequestParams(max_tokens=k + 2, seed=seed, ignore_eos=True,
                                   sampling=SamplingParams(temperature=temperature))
            n = 1
            while n <= engine.max_seqs and n * (k + 1) <= engine.max_batch_tokens:
                length = min(8, engine.max_model_len - k - 2)
                if length < 1 or n * -(-(length + k + 2) // engine.page_size) > \
                        engine.manager.num_pages:
                    break
                streams = [engine.submit(rng.integers(0, engine.vocab_size, length).tolist(),
                                         params, loop=None) for _ in range(n)]
                for stream in streams:
                    stream.result()
                n *= 2
    finally:
        engine.warming_up = False


def make_server(app, *, engine, shutdown_timeout: float, max_connections: int | None = None,
                header_timeout: float | None = None, keep_alive_timeout: float = 5.0):
    """A :func:`draining_server_class` server of ``app`` (uvicorn, h11, its own logs at warning)."""
    import uvicorn

    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", http=protocol_class(
            max_connections=max_connections, header_timeout=header_timeout),
        timeout_keep_alive=keep_alive_timeout, timeout_graceful_shutdown=5)
    return draining_server_class()(config, app=app, engine=engine,
                                   shutdown_timeout=shutdown_timeout)


def run(app, sock: socket.socket, **options) -> None:
    """Serves ``app`` on the listening ``sock`` (:func:`bind`) until a signal drains it;
    ``options`` are :func:`make_server`'s."""
    make_server(app, **options).run(sockets=[sock])


@functools.cache
def draining_server_class():
    """``uvicorn.Server`` whose first SIGTERM or SIGINT drains the engine (the module's
    docstring says how) before uvicorn shuts down; built by :func:`make_server`."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self, config, *, app, engine, shutdown_timeout: float):
            super().__init__(config)
            self.asgi_app, self.engine, self.shutdown_timeout = app, engine, shutdown_timeout
            self.drainer: threading.Thread | None = None
            self.hurry = threading.Event()

        def handle_exit(self, sig, frame):
            # Not uvicorn's: it would re-raise the signal after the server stops (a
            # KeyboardInterrupt traceback, or death by SIGTERM) instead of exiting with 0.
            if self.drainer is None:
                self.drainer = threading.Thread(target=self.drain, name="forge-jax-drain",
                                                daemon=True)
                self.drainer.start()
            elif not self.hurry.is_set():  # a second signal: cancel the rest now
                log.info("a second signal: cancelling the requests in flight")
                self.hurry.set()
            else:  # a third: exit at once
                self.should_exit = self.force_exit = True

        def drain(self):
            engine, state = self.engine, self.asgi_app.state
            before = dict(engine.stats.finished)
            state.stopping = True  # new requests: 503 (the app checks this)
            gauges = engine.snapshot()
            log.info("stopping: new requests are refused; %d running and %d waiting get up "
                     "to %g s to finish", gauges["running"], gauges["waiting"],
                     self.shutdown_timeout)
            deadline = time.monotonic() + self.shutdown_timeout
            while engine.has_work() and time.monotonic() < deadline and \
                    not self.hurry.is_set():
                time.sleep(0.01)
            engine.shutdown()  # cancels what is left and stops the loop
            after = engine.stats.finished
            cancelled = after["cancelled"] - before["cancelled"]
            state.drained = {"finished": sum(after.values()) - sum(before.values()) - cancelled,
                             "cancelled": cancelled}
            deadline = time.monotonic() + 10  # their last chunks go out
            while self.server_state.tasks and time.monotonic() < deadline:
                time.sleep(0.02)
            self.should_exit = True

    return DrainingServer
