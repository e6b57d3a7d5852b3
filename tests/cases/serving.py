"""A live ``forge-jax serve`` app on loopback (uvicorn in a thread) for the serving tests, and
the greedy references they compare with."""

from __future__ import annotations

import threading
import time

from forge_jax.kv_cache import CacheSpec
from forge_jax.models import llama
from forge_jax.serving import engine as serving
from forge_jax.serving import http as serving_http
from forge_jax.text import api as text

MODEL = "tiny-chat"
# One geometry for every serving test, so that they share the step's compiled variants
# (row buckets 8, 16 and 32, one table width; greedy or sampling).
PAGES = CacheSpec(page_size=8)
GEOMETRY = dict(max_batch_tokens=32, min_batch_tokens=8, max_seqs=32, num_pages=64,
                max_model_len=128, cache=PAGES)


class LiveServer:
    """Serves ``app`` on 127.0.0.1 (a free port) until :meth:`stop`: plain uvicorn, or with
    ``options`` the server ``forge-jax serve`` runs (:func:`forge_jax.serving.server.
    make_server`'s keywords: ``engine=``, ``max_connections=``, ``header_timeout=``...)."""

    def __init__(self, app, **options):
        import uvicorn

        from forge_jax.serving import server as serving_server

        if options:
            self.server = serving_server.make_server(app, **dict(
                dict(shutdown_timeout=5.0), **options))
        else:
            self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                        lifespan="on"))
        sock = serving_server.bind("127.0.0.1", 0)
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[sock]),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "no server"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                             **kwargs)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=60)


def engine(model, tokenizer, **fields) -> serving.Engine:
    """An engine of :data:`GEOMETRY` with the tokenizer's eos ids; ``fields`` replace
    :class:`~forge_jax.serving.EngineConfig` fields."""
    eos = text.eos_ids(model, tokenizer, tokenizer.generation_config)
    config = serving.EngineConfig(**dict(GEOMETRY, eos_token_ids=eos, **fields))
    return serving.Engine(model, tokenizer, config)


def serve(model, tokenizer, *, http: serving_http.HTTPConfig | None = None,
          server: dict | None = None, **kwargs) -> tuple[LiveServer, serving.Engine]:
    """A live server of an :func:`engine` (``kwargs``: its config's fields), the app made with
    ``http``, the server with ``server`` (:class:`LiveServer`'s options)."""
    e = engine(model, tokenizer, **kwargs)
    app = serving_http.create_app(e, model_name=MODEL, tokenizer=tokenizer, config=http)
    return LiveServer(app, **(dict(server, engine=e) if server is not None else {})), e


def greedy(model, tokenizer, prompts, max_tokens: int) -> list[list[int]]:
    """``llama.generate``'s greedy tokens for each prompt (ids), eos included, as the
    engine's token ids are."""
    eos = text.eos_ids(model, tokenizer, tokenizer.generation_config)
    return llama.generate(model, prompts, max_tokens, eos_token_id=eos)


def reply_text(tokenizer, ids, eos) -> str:
    return tokenizer.decode([t for t in ids if t not in eos])


def wait_idle(engine: serving.Engine, timeout: float = 30.0) -> dict:
    """The engine's gauges once no request runs or waits (after its last step)."""
    deadline = time.monotonic() + timeout
    while engine.has_work() or not engine.gauges:
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.02)
    time.sleep(0.05)
    return engine.snapshot()
