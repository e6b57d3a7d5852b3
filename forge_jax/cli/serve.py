"""``forge-jax serve``: an OpenAI-compatible HTTP server over the serving engine
(:mod:`forge_jax.serving.engine`, :mod:`forge_jax.serving.http`), on uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

from forge_jax import _install
from forge_jax.cli import _checkpoint, _compilation_cache, _flags
from forge_jax.cli._checkpoint import describe
from forge_jax.cli._run import UsageError


def add_parser(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (continuous batching, prefix cache)",
        description="Serves POST /v1/chat/completions and /v1/completions (streamed or not), "
                    "GET /v1/models, /health and /metrics. Requests run together: every step "
                    "packs the running requests' next tokens and chunks of new prompts into "
                    "one ragged paged attention batch. Ctrl-C (SIGINT) or SIGTERM stops "
                    "taking requests (503), lets those in flight finish for up to "
                    "--shutdown-timeout seconds, ends the rest with finish_reason "
                    "'cancelled' and exits with status 0.")
    _checkpoint.add_flags(serve, required=True, help="a Hugging Face Llama-family directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (0: any)")
    serve.add_argument("--model-name", default=None,
                       help="the model's id in the API (default: the checkpoint directory's "
                            "or GGUF file's name, or the Hub repository id)")
    serve.add_argument("--max-batch-tokens", type=int, default=512,
                       help="tokens per step, decode tokens and prompt chunks together "
                            "(rounded up to a power of two; running requests wait for a step's "
                            "prompt chunks: smaller streams more evenly)")
    serve.add_argument("--max-seqs", type=int, default=64, help="requests running at once")
    serve.add_argument("--max-pages", type=int, default=512,
                       help="pages in the KV cache pool")
    serve.add_argument("--page-size", type=int, default=16, help="tokens per page")
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="prompt plus new tokens per request (default: the model's "
                            "max_position_embeddings, at most 4096)")
    serve.add_argument("--max-waiting", type=int, default=1024,
                       help="requests waiting at most; more are answered 429")
    serve.add_argument("--max-tokens", type=int, default=None,
                       help="a request's max_tokens when it gives none, at most the context "
                            "its prompt leaves (default: the context its prompt leaves)")
    serve.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True, help="keep full pages for requests with the same prefix")
    _flags.add_dtype_flag(serve)
    _flags.add_kv_cache_flag(serve)
    _flags.add_mesh_flag(serve)
    _compilation_cache.add_flags(serve)
    _flags.add_server_flags(serve)
    _flags.add_speculative_flags(serve)
    serve.set_defaults(fn=run)


def _import_server():
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise UsageError(f"forge-jax serve needs uvicorn, starlette and prometheus_client "
                         f"({e.name} is missing): "
                         f"{_install.pip_install('serve')}") from None
    return uvicorn


def default_model_name(checkpoint: str) -> str:
    """The model's id in the API: a checkpoint directory's name, a GGUF file's name without
    its suffix, or a Hub repository id as given (never a local path)."""
    import pathlib

    path = pathlib.Path(checkpoint)
    if path.is_file():
        return path.stem
    if path.is_dir():
        return path.resolve().name
    return checkpoint


def _tokenizer(path, text):
    """The checkpoint's tokenizer (a GGUF file's own, else tokenizer.json), or None; its
    chat template rendered once on a one-message conversation, so that a broken one is
    found now rather than by every chat request."""
    from forge_jax.models import llama

    if not (path.is_file() or (path / "tokenizer.json").is_file()):
        return None
    try:
        tokenizer = text.load_tokenizer(path)
    except llama.CheckpointError:
        if path.is_file():  # a GGUF file without a vocabulary: token ids only
            return None
        raise
    if tokenizer.chat_template:
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
        except Exception as e:  # the template raised: ChatTemplateError or Jinja's own
            raise UsageError(f"the chat template of {path} cannot render a one-message "
                             f"conversation: {type(e).__name__}: {e}") from None
    return tokenizer


def run(args: argparse.Namespace) -> int:
    _import_server()
    for name in ("max_batch_tokens", "max_seqs", "max_pages", "page_size", "max_waiting"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    speculative = _flags.speculative_config(args)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65536), got {args.port}")
    _flags.check_server_flags(args)
    _flags.check_implementation_env()
    _flags.check_mesh_flag(args)
    _flags.resolve_dtype(args)

    import jax.numpy as jnp

    from forge_jax.kv_cache import CacheSpec
    from forge_jax.models import llama
    from forge_jax.serving import engine as serving
    from forge_jax.serving import http as serving_http
    from forge_jax.serving import protection
    from forge_jax.serving import server as serving_server
    from forge_jax.text import api as text

    try:
        allowed = (protection.default_allowed_hosts(args.host) if args.allowed_hosts is None
                   else protection.parse_allowed_hosts(args.allowed_hosts))
    except ValueError as e:
        raise UsageError(str(e)) from None
    path = _checkpoint.checkpoint_path(args)
    _compilation_cache.check(args)
    with _compilation_cache.gguf_cache(args):  # a GGUF file's config, kept
        config = llama.load_config(path)
    max_len = args.max_model_len or min(config.max_position_embeddings, 4096)
    if not 2 <= max_len <= config.max_position_embeddings:
        raise UsageError(f"--max-model-len must be in [2, max_position_embeddings="
                         f"{config.max_position_embeddings}], got {max_len}")
    mesh = _flags.mesh_from_flag(args, config)
    quantize = _checkpoint.quantize_kwargs(args, config)
    with _compilation_cache.gguf_cache(args):  # and its tokenizer
        tokenizer = _tokenizer(path, text)
    _flags.check_draft_checkpoint(args, config, tokenizer)
    try:  # the port, before the model loads
        sock = serving_server.bind(args.host, args.port)
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    port = sock.getsockname()[1]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    with sock, _compilation_cache.compilation_cache(args):
        try:
            model = llama.from_pretrained(path, dtype=jnp.dtype(args.dtype), mesh=mesh,
                                          **quantize)
        except KeyboardInterrupt:  # Ctrl-C while the weights load: nothing to drain
            print("forge-jax serve: interrupted while loading the model", file=sys.stderr)
            return 130
        eos = text.eos_ids(model, tokenizer, tokenizer.generation_config) if tokenizer else None
        _flags.load_draft(args, model)
        speculative = _flags.speculative_config(args) or speculative
        try:
            engine = serving.Engine(model, tokenizer, serving.EngineConfig(
                max_batch_tokens=args.max_batch_tokens, max_seqs=args.max_seqs,
                num_pages=args.max_pages, max_model_len=max_len, max_waiting=args.max_waiting,
                prefix_caching=args.prefix_caching, eos_token_ids=eos,
                cache=CacheSpec(page_size=args.page_size, kv_dtype=args.kv_cache_dtype),
                speculative=speculative))
        except ValueError as e:  # the model refuses a setting (prefix caching, speculation)
            hint = " (--no-prefix-caching)" if args.prefix_caching and \
                "prefix_caching=False" in str(e) else ""
            raise UsageError(f"{e}{hint}") from None
        name = args.model_name or default_model_name(args.checkpoint)
        app = serving_http.create_app(
            engine, model_name=name, tokenizer=tokenizer, default_max_tokens=args.max_tokens,
            config=serving_http.HTTPConfig(
                api_key=args.api_key, allowed_hosts=allowed,
                max_request_bytes=args.max_request_bytes, body_timeout=args.body_timeout,
                warm_up=args.warm_up, shutdown_timeout=args.shutdown_timeout))
        print(f"{describe(model, path, args)}; serving {name!r} on http://{args.host}:"
              f"{port}/v1 (max {engine.max_batch_tokens} tokens and {args.max_seqs} "
              f"requests per step, {args.max_pages} pages of {args.page_size}"
              + (f", {args.kv_cache_dtype} KV cache" if args.kv_cache_dtype else "")
              + (", tokenizer: none (token ids only)" if tokenizer is None else "")
              + (", API key required" if args.api_key else "") + ")",
              file=sys.stderr, flush=True)
        serving_server.run(app, sock, engine=engine, shutdown_timeout=args.shutdown_timeout,
                           max_connections=args.max_connections,
                           header_timeout=args.header_timeout,
                           keep_alive_timeout=args.keep_alive_timeout)
    return 0
