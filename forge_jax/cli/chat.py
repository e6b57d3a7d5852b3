"""``forge-jax chat``: a multi-turn chat with an instruct checkpoint, one user message per
stdin line, each reply streamed to stdout; the conversation's KV cache is kept between turns."""

from __future__ import annotations

import argparse
import sys

from forge_jax.cli import _compilation_cache, _flags
from forge_jax.cli._checkpoint import describe
from forge_jax.cli._run import UsageError


def add_parser(subparsers) -> None:
    chat = subparsers.add_parser(
        "chat", help="a multi-turn chat with an instruct checkpoint, one message per stdin line",
        description="Reads one user message per line from stdin and streams each reply to "
                    "stdout; the conversation's KV cache is kept between turns, so a turn "
                    "prefills only its own tokens. /reset starts over; end of input ends.")
    chat.add_argument("--checkpoint", metavar="DIR", required=True,
                      help="a Hugging Face Llama-family directory with a chat template")
    chat.add_argument("--system", metavar="TEXT", help="a system message to start with")
    chat.add_argument("--max-new-tokens", type=int, default=None,
                      help="per reply (default: generation_config.json's, else 256)")
    chat.add_argument("--max-context", type=int, default=None,
                      help="tokens the conversation may hold (default: the model's "
                           "max_position_embeddings, at most 4096)")
    _flags.add_sampling_flags(chat)
    chat.add_argument("--dtype", choices=_flags.DTYPES, default="float32")
    chat.add_argument("--seed", type=int, default=0, help="sampling seed")
    chat.add_argument("--stats", action=argparse.BooleanOptionalAction, default=True,
                      help="after each reply, its time to first token and speed on stderr")
    _compilation_cache.add_flags(chat)
    chat.set_defaults(fn=run)


def _stats_line(stats) -> str:
    return (f"[first token {stats.first_token_seconds * 1e3:.0f} ms; prefilled "
            f"{stats.prefilled_tokens} of {stats.prompt_tokens} tokens ({stats.reused_tokens} "
            f"kept in the cache); {stats.new_tokens} new tokens, "
            f"{stats.decode_ms_per_step:.1f} ms/token]")


def run(args: argparse.Namespace) -> int:
    """``forge-jax chat``: one user message per stdin line, each reply streamed to stdout."""
    import pathlib

    import jax.numpy as jnp

    from forge_jax.models import llama, text
    from forge_jax.models.chat_session import ChatSession, ContextFullError

    _flags.check_sampling_flags(args)
    _flags.check_seed(args.seed)
    _flags.check_implementation_env()
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_context is not None and args.max_context < 2:
        raise UsageError(f"--max-context must be >= 2, got {args.max_context}")
    path = pathlib.Path(args.checkpoint)
    config = llama.load_config(path)
    tokenizer = text.load_tokenizer(path)
    if not tokenizer.chat_template:
        raise UsageError(f"{path} has no chat template (no 'chat_template' in "
                         f"tokenizer_config.json, no chat_template.jinja): use "
                         f"forge-jax generate --prompt TEXT")
    sampling = _flags.sampling_params(args, tokenizer.generation_config)
    if args.max_context is not None and args.max_context > config.max_position_embeddings:
        raise UsageError(f"--max-context {args.max_context} is beyond "
                         f"max_position_embeddings={config.max_position_embeddings} "
                         f"of {path}")
    _compilation_cache.check(args)
    interactive = sys.stdin.isatty()
    with _compilation_cache.compilation_cache(args):
        model = llama.from_pretrained(path, dtype=jnp.dtype(args.dtype))
        session = ChatSession(
            model, tokenizer, max_context=args.max_context, system=args.system,
            max_new_tokens=args.max_new_tokens, temperature=sampling.temperature,
            top_k=sampling.top_k or 0, top_p=sampling.top_p, min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty, seed=args.seed)
        decoding = _flags.describe_sampling(args, sampling, tokenizer.generation_config)
        print(f"{describe(model, path, args)}; context {session.max_context} tokens; "
              f"{decoding}. "
              f"One message per line; /reset starts over; end of input (Ctrl-D) quits.",
              file=sys.stderr)
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:  # end of input
                break
            message = line.rstrip("\n")
            if not message.strip():
                continue
            if message.strip() == "/reset":
                session.reset()
                print("[conversation reset]", file=sys.stderr)
                continue
            try:
                session.send(message, on_text=lambda piece: (sys.stdout.write(piece),
                                                             sys.stdout.flush()))
            except ContextFullError as e:
                print(f"[context full: {e}]", file=sys.stderr)
                continue
            print(flush=True)
            if session.last_turn.context_full:
                print(f"[context full: the reply stopped at {session.max_context} tokens; "
                      f"/reset to start over]", file=sys.stderr)
            if args.stats:
                print(_stats_line(session.last_turn), file=sys.stderr)
    return 0
