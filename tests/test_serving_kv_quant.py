"""The serving engine with a quantized KV cache (``EngineConfig(cache=CacheSpec(
kv_dtype="int8"))``, ``forge-jax serve --kv-cache-dtype``): its pages are int8 with a float32
scale per token and KV head, and its greedy tokens equal ``llama.generate``'s with the same
``kv_cache_dtype`` for concurrent requests of different lengths, chunked prefill and a prefix
read from the prefix cache's quantized pages."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
from cases import serving as cases

import forge_jax as fj
from forge_jax.kv_cache import CacheSpec
from forge_jax.models import llama
from forge_jax.serving import engine as serving
from forge_jax.text import api as text

TEXTS = ["Hello there! How", "The quick brown fox jumps over the lazy dog. The quick",
         "Numbers 0123", "Caf\u00e9 cr\u00e8me"]
SYSTEM = "user assistant system: tell me a story about a small robot who"


def _run(engine, prompts, max_tokens):
    streams = [engine.submit(p, serving.RequestParams(max_tokens=max_tokens))
               for p in prompts]
    while engine.has_work():
        engine.step()
    return [s.result()[0] for s in streams]


def test_int8_kv_cache_serves_generates_tokens(chat_model, chat_tokenizer):
    eos = text.eos_ids(chat_model, chat_tokenizer, chat_tokenizer.generation_config)
    prompts = [chat_tokenizer.encode(t) for t in TEXTS]
    system = chat_tokenizer.encode(SYSTEM + " " + TEXTS[1])  # several full pages
    shared = [system + chat_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS[:2]]
    want = llama.generate(chat_model, prompts + shared, 10, eos_token_id=eos,
                          kv_cache_dtype="int8")
    engine = cases.engine(chat_model, chat_tokenizer,
                          cache=dataclasses.replace(cases.PAGES, kv_dtype="int8"))
    pool = engine.cache.k_pages[0]
    assert isinstance(pool, fj.QuantizedArray) and pool.format == "int8"
    assert pool.values.dtype == jnp.int8 and pool.scales.shape == pool.shape[:-1] + (1,)
    # The first shared-prefix request alone, then the others together: the second reads
    # the first's cached (quantized) prefix pages beside four prompts being prefilled.
    first = _run(engine, shared[:1], 10)
    rest = _run(engine, prompts + shared[1:], 10)
    assert rest[:4] + first + rest[4:] == want
    assert engine.prefix_cache.stats.reused_pages >= len(system) // engine.page_size
    assert engine.manager.usage().num_sequences == 0


def test_a_bad_kv_cache_dtype_is_refused(chat_model):
    with pytest.raises(ValueError, match=r"kv_dtype must be 'int8' or 'fp8'.*'int4'"):
        serving.EngineConfig(cache=CacheSpec(kv_dtype="int4"))


def test_serve_flag(capsys, monkeypatch, chat_checkpoint, chat_model):
    import types

    from cases.cli import assert_one_line_error, run

    from forge_jax.cli import serve as serve_cli
    from forge_jax.serving import http as serving_http
    from forge_jax.serving import server as serving_server

    assert_one_line_error(run(capsys, "serve", "--checkpoint", str(chat_checkpoint),
                              "--kv-cache-dtype", "int4"),
                          "--kv-cache-dtype", "invalid choice: 'int4'", prog="forge-jax serve")
    # A good value reaches the engine (the server itself is not started).
    engines = []
    monkeypatch.setattr(llama, "from_pretrained", lambda *a, **kw: chat_model)
    monkeypatch.setattr(serving_http, "create_app", lambda engine, **kw: engines.append(engine))
    monkeypatch.setattr(serve_cli, "_import_server",
                        lambda: types.SimpleNamespace(run=lambda app, **kw: None))
    monkeypatch.setattr(serving_server, "run", lambda *args, **kwargs: None)
    rc, _, err = run(capsys, "serve", "--checkpoint", str(chat_checkpoint), "--max-pages", "8",
                     "--kv-cache-dtype", "fp8")
    assert rc == 0 and "fp8 KV cache" in err, err
    [engine] = engines
    assert engine.kv_cache_dtype == "fp8" and engine.cache.k_pages[0].format == "fp8"
