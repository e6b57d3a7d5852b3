"""``forge-jax chat``: a multi-turn chat with an instruct checkpoint, one user message per
stdin line, each reply streamed to stdout; the conversation's KV cache is kept between turns."""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
import threading

from forge_jax.cli import _checkpoint, _compilation_cache, _flags
from forge_jax.cli._checkpoint import describe, quantize_kwargs
from forge_jax.cli._run import UsageError


def add_parser(subparsers) -> None:
    chat = subparsers.add_parser(
        "chat", help="a multi-turn chat with an instruct checkpoint, one message per stdin line",
        description="Reads one user message per line from stdin and streams each reply to "
                    "stdout; the conversation's KV cache is kept between turns, so a turn "
                    "prefills only its own tokens. /reset starts over, /help lists the "
                    "commands; Ctrl-C stops a reply; /exit, end of input (Ctrl-D) or Ctrl-C "
                    "at the prompt ends. Replies are sampled as the checkpoint's "
                    "generation_config.json says; where it sets no do_sample, at "
                    "temperature 0.8, top-k 40, top-p 0.95, min-p 0.05 (llama.cpp's "
                    "defaults); greedy where it says do_sample false, or with --temperature 0.")
    _checkpoint.add_flags(chat, required=True,
                          help="a Hugging Face Llama-family directory with a chat template")
    chat.add_argument("--system", metavar="TEXT", help="a system message to start with")
    chat.add_argument("--max-new-tokens", type=int, default=None,
                      help="per reply (default: generation_config.json's, else 256)")
    chat.add_argument("--max-context", type=int, default=None,
                      help="tokens the conversation may hold (default: the model's "
                           "max_position_embeddings, at most 4096)")
    _flags.add_sampling_flags(chat)
    _flags.add_dtype_flag(chat)
    _flags.add_kv_cache_flag(chat)
    chat.add_argument("--seed", type=int, default=0, help="sampling seed")
    chat.add_argument("--stats", action=argparse.BooleanOptionalAction, default=True,
                      help="after each reply, its time to first token and speed on stderr")
    _compilation_cache.add_flags(chat)
    chat.set_defaults(fn=run)


# The commands a line starting with "/" may give; "//" sends a message starting with "/".
COMMANDS = {"/reset": "start the conversation over (the system message stays)",
            "/help": "list the commands",
            "/exit": "end the chat (also /quit, end of input, Ctrl-C at the prompt)",
            "/quit": "end the chat"}
_WORD = re.compile(r"/[A-Za-z][\w-]*")


def _command(line: str) -> tuple[str, str] | None:
    """``(command, the rest)`` when ``line`` (stripped) gives one: its first word is ``/``
    and a name (``/reset``, ``/foo``). A path (``/usr/bin ...``) or ``//...`` is a message."""
    word, _, rest = line.partition(" ")
    return (word, rest.strip()) if _WORD.fullmatch(word) else None


def _stats_line(stats) -> str:
    compiled = (f"compiled in {stats.compile_seconds:.1f} s, then "
                if getattr(stats, "compile_seconds", 0.0) else "")
    return (f"[{compiled}first token {stats.first_token_seconds * 1e3:.0f} ms; prefilled "
            f"{stats.prefilled_tokens} of {stats.prompt_tokens} tokens ({stats.reused_tokens} "
            f"kept in the cache); {stats.new_tokens} new tokens, "
            f"{stats.decode_ms_per_step:.1f} ms/token]")


def run(args: argparse.Namespace) -> int:
    """``forge-jax chat``: one user message per stdin line, each reply streamed to stdout."""

    import jax.numpy as jnp

    from forge_jax.generation import settings
    from forge_jax.kv_cache import CacheSpec
    from forge_jax.models import llama
    from forge_jax.text import api as text
    from forge_jax.text.chat_session import ChatSession

    _flags.check_sampling_flags(args)
    _flags.check_seed(args.seed)
    _flags.check_implementation_env()
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_context is not None and args.max_context < 2:
        raise UsageError(f"--max-context must be >= 2, got {args.max_context}")
    if args.system is not None and not args.system.strip():
        raise UsageError(f"--system is empty ({args.system!r}): give the system message's "
                         f"text, or leave --system out")
    _flags.resolve_dtype(args)
    _compilation_cache.check(args)
    with _compilation_cache.gguf_cache(args):  # a GGUF file's config and tokenizer, kept
        path = _checkpoint.checkpoint_path(args)
        config = llama.load_config(path)
        tokenizer = text.load_tokenizer(path)
    if not tokenizer.chat_template:
        raise UsageError(f"{path} has no chat template (no 'chat_template' in "
                         f"tokenizer_config.json, no chat_template.jinja): use "
                         f"forge-jax generate --prompt TEXT")
    _check_template(tokenizer, args.system, path)
    generation_config = settings.chat_generation_config(
        tokenizer.generation_config, says_greedy=_says_greedy(path))
    sampling = _flags.sampling_params(args, generation_config)
    if args.max_context is not None and args.max_context > config.max_position_embeddings:
        raise UsageError(f"--max-context {args.max_context} is beyond "
                         f"max_position_embeddings={config.max_position_embeddings} "
                         f"of {path}")
    with _compilation_cache.compilation_cache(args):
        model = llama.from_pretrained(path, dtype=jnp.dtype(args.dtype),
                                      **quantize_kwargs(args, config))
        session = ChatSession(
            model, tokenizer, max_context=args.max_context, system=args.system,
            max_new_tokens=args.max_new_tokens, sampling=sampling,
            cache=CacheSpec(kv_dtype=args.kv_cache_dtype))
        decoding = _flags.describe_sampling(
            args, sampling, generation_config,
            why=None if generation_config is tokenizer.generation_config else
            " (chat's default where generation_config.json sets no do_sample; --temperature "
            "0 for greedy)")
        print(f"{describe(model, path, args)}; context {session.max_context} tokens; "
              f"{decoding}. One message per line; /help lists the commands; Ctrl-C stops a "
              f"reply; /exit or end of input (Ctrl-D) quits.", file=sys.stderr)
        read_line = _line_reader()
        try:
            while True:
                try:
                    line = read_line()
                except KeyboardInterrupt:  # Ctrl-C at the prompt: the end, not an error
                    print(file=sys.stderr)
                    break
                if line is None or not _turn(session, line, args):
                    break
        except KeyboardInterrupt:  # a second Ctrl-C during a reply: stop at once
            print("\n[interrupted]", file=sys.stderr)
            return 130
    return 0


def _says_greedy(path) -> bool:
    """Whether the checkpoint's generation_config.json sets ``"do_sample": false``."""
    import json

    file = path / "generation_config.json" if path.is_dir() else None
    if file is None or not file.is_file():
        return False
    try:
        return json.loads(file.read_text()).get("do_sample") is False
    except (ValueError, AttributeError):  # load_tokenizer has reported a bad file already
        return False


def _check_template(tokenizer, system: str | None, path) -> None:
    """The chat template renders a first turn (with the system message, if any) before the
    model loads: a template that raises (``raise_exception``, a Jinja syntax error, a system
    role it refuses) is a usage error, not a traceback at the first message."""
    from forge_jax.text import api as text

    user = {"role": "user", "content": "Hello"}
    try:
        tokenizer.apply_chat_template([user])
    except text.ChatTemplateError as e:
        raise UsageError(f"the chat template of {path} cannot render a conversation: "
                         f"{e}") from None
    if system is not None:
        try:
            tokenizer.apply_chat_template([{"role": "system", "content": system}, user])
        except (text.ChatTemplateError, ValueError, TypeError) as e:
            raise UsageError(f"--system: the chat template of {path} refuses a system "
                             f"message: {e}") from None


def _line_reader():
    """A function returning the next line of stdin (None at its end). On a terminal,
    ``readline`` gives line editing and history, and the prompt is shown."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        with contextlib.suppress(ImportError):  # a Python built without it: plain lines
            import readline  # noqa: F401  (input() then edits lines and keeps a history)

        def read():
            try:
                return input("> ")
            except EOFError:
                print(file=sys.stderr)
                return None

        return read

    def read():
        if sys.stdin.isatty():  # the replies go elsewhere: the prompt on stderr
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None

    return read


def _turn(session, line: str, args: argparse.Namespace) -> bool:
    """One line of input: a command or a message and its reply. False: end the chat."""
    from forge_jax.text import api as text
    from forge_jax.text.chat_session import ContextFullError

    message = line.strip()
    if not message:
        return True
    command = _command(message)
    if command is not None:
        name, rest = command
        if name not in COMMANDS:
            print(f"[unknown command {name}: not sent to the model; {', '.join(COMMANDS)} "
                  f"are known, and // sends a message that starts with /]", file=sys.stderr)
        elif rest:
            print(f"[{name} takes no arguments, got {rest!r}]", file=sys.stderr)
        elif name in ("/exit", "/quit"):
            return False
        elif name == "/reset":
            session.reset()
            print("[conversation reset]", file=sys.stderr)
        else:
            for known, meaning in COMMANDS.items():
                print(f"  {known:7s} {meaning}", file=sys.stderr)
            print("  //...   a message that starts with /; Ctrl-C stops a reply",
                  file=sys.stderr)
        return True
    if line.lstrip().startswith("//"):
        line = line.replace("/", "", 1)
    try:
        stopped = _reply(session, line.strip())
    except ContextFullError as e:
        print(f"[context full: {e}]", file=sys.stderr)
        return True
    except (text.ChatTemplateError, ValueError, TypeError) as e:
        print(f"[not sent: {e}]", file=sys.stderr)
        return True
    print(flush=True)
    if stopped:
        print("[reply stopped; the conversation keeps it as far as it got]", file=sys.stderr)
    elif session.last_turn.context_full:
        print(f"[context full: the reply stopped at {session.max_context} tokens; "
              f"/reset to start over]", file=sys.stderr)
    if args.stats:
        print(_stats_line(session.last_turn), file=sys.stderr)
    return True


def _reply(session, message: str) -> bool:
    """Streams the reply to ``message`` to stdout; returns whether Ctrl-C stopped it.

    Ctrl-C during the reply stops it at the next piece of text: the stream is closed
    there, so the session keeps the reply so far in the conversation and its tokens in the
    cache (the model is never interrupted mid-step, which would lose the donated cache).
    A second Ctrl-C before that piece arrives (a long prefill) interrupts at once."""
    stream = session.stream(message)  # checks, renders and fits the message first
    interrupted = False

    def on_sigint(signum, frame):
        nonlocal interrupted
        if interrupted:
            raise KeyboardInterrupt
        interrupted = True

    main = threading.current_thread() is threading.main_thread()  # where signals go
    previous = signal.signal(signal.SIGINT, on_sigint) if main else None
    stopped = False
    try:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
            if interrupted:
                stopped = True
                break
    finally:
        stream.close()
        if main:
            signal.signal(signal.SIGINT, previous)
    return stopped
