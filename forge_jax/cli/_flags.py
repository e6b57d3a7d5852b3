"""The flags several commands share (dtype, seed, sampling), their checks, and the argument
parser whose errors are one line like every other bad input."""

from __future__ import annotations

import argparse

from forge_jax.cli._run import UsageError

DTYPES = ("float32", "bfloat16", "float16")
_SEED_LIMIT = 2**63  # jax.random.key takes a C long; numpy's generator a non-negative int


class Parser(argparse.ArgumentParser):
    """argparse whose errors (an unknown flag, ``--top-k x``) are one line on stderr, exit
    code 2, like every other bad input: no usage block, no SystemExit out of ``main``."""

    def error(self, message):
        raise UsageError(message, prog=self.prog)


def name_defaults(parser: argparse.ArgumentParser) -> None:
    """Appends ``(default: X)`` to the help of each flag of ``parser``'s subcommands whose
    help does not already name its default (a switch, a flag without a default, or one
    whose help says "default" are left as they are), so every --help shows them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                name_defaults(sub)
            continue
        if not action.option_strings or action.help in (None, argparse.SUPPRESS):
            continue
        if action.default in (None, "", argparse.SUPPRESS) and not isinstance(
                action.default, bool | int) or action.required \
                or isinstance(action.default, bool) or "default" in action.help.lower() \
                or str(action.default) in action.help:
            continue
        action.help = f"{action.help} (default: {str(action.default).replace('%', '%%')})"


def check_implementation_env() -> None:
    """``$FORGE_JAX_IMPLEMENTATION``, when set, names a registered implementation (a typo
    there would otherwise surface as a traceback from the first op, after the model loads)."""
    import os

    from forge_jax import dispatch

    name = os.environ.get(dispatch.ENV_VAR, "").strip()
    if name and name not in dispatch.names():
        raise UsageError(f"{dispatch.ENV_VAR}={name!r} is not a registered implementation; "
                         f"registered: {', '.join(dispatch.names())} (unset it for auto "
                         f"selection)")


def add_dtype_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="compute dtype (default: float32 on CPU, bfloat16 on GPU and TPU)")


KV_CACHE_DTYPES = ("int8", "fp8")


def add_kv_cache_flag(parser: argparse.ArgumentParser) -> None:
    # choices: a wrong value is a one-line usage error before anything is read or loaded.
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="quantize the KV cache: int8 or fp8 (e4m3) keys and values with "
                             "a float32 scale per token and KV head, about half a bfloat16 "
                             "cache's bytes (default: the compute dtype)")


def resolve_dtype(args: argparse.Namespace) -> None:
    """Sets ``args.dtype`` to the platform's default when not given; ``--dtype bfloat16`` on
    CPU gets a one-line note on stderr that it will be slow."""
    import sys

    from forge_jax import targets
    from forge_jax.models.checkpoints import hf as llama_checkpoint

    platform = targets.platform()
    if args.dtype is None:
        args.dtype = llama_checkpoint.default_dtype(platform).name
    elif args.dtype == "bfloat16" and platform == "cpu":
        print("note: --dtype bfloat16 on CPU measured as fast as float32 or faster on a CPU "
              "that multiplies bfloat16 natively (AVX512-BF16, AMX; BENCHMARKS.md), not "
              "measured on others; float32 is the CPU default", file=sys.stderr)


def check_seed(seed: int) -> None:
    if not 0 <= seed < _SEED_LIMIT:
        raise UsageError(f"--seed must be in [0, 2**63), got {seed}")


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=None,
                        help="0: greedy (default, unless generation_config.json samples or "
                             "--top-k, --top-p or --min-p is given: then 1.0 or the "
                             "config's)")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the k most "
                        "probable tokens (implies sampling)")
    parser.add_argument("--top-p", type=float, default=None, help="sample from the nucleus "
                        "of probability p (implies sampling)")
    parser.add_argument("--min-p", type=float, default=None, help="sample from the tokens at "
                        "least p times as probable as the most probable (implies sampling)")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="transformers' repetition penalty (1: off)")


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative", choices=("ngram",), default=None,
                        help="speculative decoding: draft tokens by prompt lookup (ngram) and "
                             "verify them in one step; greedy output is unchanged (default: "
                             "off)")
    parser.add_argument("--draft-checkpoint", default=None, metavar="DIR",
                        help="speculative decoding with a draft model: a smaller checkpoint "
                             "of the same tokenizer (directory, Hub id or .gguf) drafts the "
                             "tokens, verified in one step; greedy output is unchanged, "
                             "sampled output distributed as without it (default: none)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                        help="draft tokens per step with --speculative or --draft-checkpoint "
                             "(default: 4)")


def speculative_config(args: argparse.Namespace):
    """The ``SpeculativeConfig`` of ``--speculative`` or ``--draft-checkpoint`` (None
    without; with a draft checkpoint, None until :func:`load_draft` has loaded it into
    ``args.draft_model``); a one-line error for a bad ``--num-speculative-tokens`` or both
    ways of drafting at once."""
    draft = getattr(args, "draft_checkpoint", None)
    if args.speculative is None and draft is None:
        return None
    if args.speculative is not None and draft is not None:
        raise UsageError(f"--speculative {args.speculative} and --draft-checkpoint are two "
                         f"ways to draft tokens: give one")
    flag = "--speculative" if draft is None else "--draft-checkpoint"
    if args.num_speculative_tokens < 1:
        raise UsageError(f"--num-speculative-tokens must be >= 1, got "
                         f"{args.num_speculative_tokens}")
    if getattr(args, "repetition_penalty", None) not in (None, 1.0):
        raise UsageError(f"{flag} does not apply --repetition-penalty")
    if draft is not None and getattr(args, "mesh", None) is not None:
        raise UsageError("--draft-checkpoint runs on one device; it does not combine with "
                         "--mesh")
    from forge_jax.generation import SpeculativeConfig

    if draft is not None:
        model = getattr(args, "draft_model", None)
        return None if model is None else SpeculativeConfig(
            draft_model=model, num_tokens=args.num_speculative_tokens)
    return SpeculativeConfig(method=args.speculative, num_tokens=args.num_speculative_tokens)


def check_draft_checkpoint(args: argparse.Namespace, config, tokenizer=None) -> None:
    """A one-line error, before any weights load, unless ``--draft-checkpoint`` (if given)
    can draft for the target of ``config`` (its ``LlamaConfig``): the same vocabulary size
    and, given the target's ``tokenizer``, the same tokens at the same ids."""
    if getattr(args, "draft_checkpoint", None) is None:
        return
    from forge_jax.generation import speculative
    from forge_jax.models import llama

    def fail(e):
        return UsageError(f"--draft-checkpoint {args.draft_checkpoint}: {e}")

    try:
        draft_config = llama.load_config(args.draft_checkpoint)
    except Exception as e:  # a missing directory, an unreadable config.json
        raise fail(e) from None
    vocabularies = None
    if tokenizer is not None:
        from forge_jax.text import api as text

        try:
            theirs = text.load_tokenizer(args.draft_checkpoint)
        except Exception as e:
            raise fail(e) from None
        vocabularies = {"target": getattr(tokenizer, "backend", tokenizer).get_vocab(),
                        "draft": theirs.backend.get_vocab()}

    from types import SimpleNamespace

    try:  # the configs alone: no weights loaded yet
        speculative.check_draft(SimpleNamespace(config=config),
                                SimpleNamespace(config=draft_config), vocabularies)
    except ValueError as e:
        raise fail(e) from None


def load_draft(args: argparse.Namespace, model) -> None:
    """Loads ``--draft-checkpoint`` (nothing without it; checked before by
    :func:`check_draft_checkpoint`) into ``args.draft_model``, in the target ``model``'s
    dtype, for :func:`speculative_config`."""
    if getattr(args, "draft_checkpoint", None) is None:
        return
    from forge_jax.models import llama

    args.draft_model = llama.from_pretrained(args.draft_checkpoint, dtype=model.dtype)


def check_sampling_flags(args: argparse.Namespace) -> None:
    """The sampling flags of ``generate`` and ``chat`` (None: the checkpoint's
    generation_config.json, else greedy and no filter)."""
    import math

    import numpy as np

    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k must be >= 1, got {args.top_k}")
    largest = float(np.finfo(np.float32).max)
    if args.temperature is not None and not (
            math.isfinite(args.temperature) and 0 <= args.temperature <= largest):
        raise UsageError(f"--temperature must be a finite number >= 0 (at most float32's "
                         f"{largest:.4g}), got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.min_p is not None and not 0 <= args.min_p <= 1:
        raise UsageError(f"--min-p must be in [0, 1], got {args.min_p}")
    if args.repetition_penalty is not None and not (
            math.isfinite(args.repetition_penalty) and 0 < args.repetition_penalty <= largest):
        raise UsageError(f"--repetition-penalty must be a finite number > 0, got "
                         f"{args.repetition_penalty}")


def sampling_params(args: argparse.Namespace, generation_config):
    """The flags (``--seed`` included, where the command has it) over the checkpoint's
    generation_config.json: a ``SamplingParams``."""
    from forge_jax.generation import settings

    try:
        return settings.sampling_params(
            generation_config,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            seed=getattr(args, "seed", 0))
    except ValueError as e:
        raise UsageError(str(e)) from None


def describe_sampling(args: argparse.Namespace, params, generation_config=None, *,
                      why: str | None = None) -> str:
    """How the tokens are picked, in one phrase, saying why when the flags imply sampling:
    ``sampling at temperature 1 (--top-p without --temperature; --temperature 0 for
    greedy), top-p 0.9, seed 1``, or ``greedy``."""
    if params.greedy:
        words = ["greedy"]
    else:
        why = "" if why is None or args.temperature is not None else why
        if args.temperature is None and not why:
            if generation_config is not None and generation_config.do_sample:
                why = " (generation_config.json's do_sample)"
            else:
                given = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p),
                                                  ("--min-p", args.min_p)) if value is not None]
                why = f" ({', '.join(given)} without --temperature; --temperature 0 for greedy)"
        words = [f"sampling at temperature {params.temperature:g}{why}"]
        words += [f"{name} {value:g}" for name, value in (
            ("top-k", params.top_k), ("top-p", params.top_p), ("min-p", params.min_p))
            if value is not None]
    if params.repetition_penalty is not None:
        words.append(f"repetition penalty {params.repetition_penalty:g}")
    if not params.greedy:
        words.append(f"seed {params.seed}")
    return ", ".join(words)


def add_mesh_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", metavar="tp=4", default=None,
                        help="shard the model over a device mesh: tensor-parallel axis tp, "
                             "data-parallel axis dp, e.g. tp=4 or dp=2,tp=4")


def check_mesh_flag(args: argparse.Namespace) -> None:
    """``--mesh``'s spelling (before anything is read)."""
    if args.mesh is not None:
        from forge_jax import sharding

        try:
            sharding.parse_mesh(args.mesh)
        except ValueError as e:
            raise UsageError(f"--mesh: {e}") from None


def mesh_from_flag(args: argparse.Namespace, config):
    """The MeshConfig ``--mesh`` asks for (None without it), checked against the devices
    and the model's head counts before the weights are loaded."""
    if args.mesh is None:
        return None
    import jax

    from forge_jax import sharding

    try:
        mesh = sharding.MeshConfig(sharding.make_mesh(args.mesh))
        _check_mesh(config, mesh)
    except ValueError as e:
        hint = ""
        if "available" in str(e) and jax.default_backend() == "cpu":
            hint = ("; on CPU, give JAX several devices with "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=N")
        raise UsageError(f"--mesh {args.mesh}: {e}{hint}") from None
    return mesh


def _check_mesh(config, mesh) -> None:
    """ValueError if ``config``'s model does not split over ``mesh``: each family with a model
    of its own by its own sharding rules, the Llama family's by its layout."""
    from forge_jax.models import (
        deepseek_sharding,
        gemma4_sharding,
        llama_sharding,
        qwen3_next_sharding,
    )
    from forge_jax.models.deepseek_config import DeepseekV3Config
    from forge_jax.models.gemma4_config import Gemma4Config
    from forge_jax.models.qwen3_next_config import Qwen3NextConfig

    if isinstance(config, DeepseekV3Config):
        deepseek_sharding.check(config, mesh)
    elif isinstance(config, Qwen3NextConfig):
        qwen3_next_sharding.plan(config, mesh)
    elif isinstance(config, Gemma4Config):
        gemma4_sharding.layout_for(config, mesh.tp)
    else:
        llama_sharding.layout_for(config, mesh.tp)


API_KEY_ENV = "FORGE_JAX_API_KEY"


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """``forge-jax serve``'s protection, limits, warm-up and shutdown."""
    parser.add_argument("--api-key", default=None,
                        help=f"the key clients must send (Authorization: Bearer KEY) on every "
                             f"route but /health; 401 without it (default: ${API_KEY_ENV}, "
                             f"else none)")
    parser.add_argument("--allowed-hosts", default=None, metavar="NAME[,NAME...]",
                        help="Host header names served, '*' for any (default: the --host "
                             "address; for a loopback one also localhost, 127.0.0.1 and ::1; "
                             "for 0.0.0.0 or :: any)")
    parser.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                        help="a request body's size at most; larger ones are answered 413 "
                             "as soon as that is known (default: 4 MiB)")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a request's headers may take to arrive (408 and the "
                             "connection closed past them; default 10)")
    parser.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a request's body may take to arrive (408 past them; "
                             "default 30)")
    parser.add_argument("--keep-alive-timeout", type=float, default=5.0,
                        help="seconds an idle connection stays open (default 5)")
    parser.add_argument("--max-connections", type=int, default=1024,
                        help="open connections at most; one more is answered 503 and closed "
                             "(default 1024)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds the requests in flight get to finish after SIGTERM or "
                             "SIGINT before they are cancelled (default 30)")
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                        help="compile the step's variants before /health says ok (requests "
                             "meanwhile get 503)")


def check_server_flags(args: argparse.Namespace) -> None:
    """The server flags' values (before anything is read); ``args.api_key`` from the
    environment when not given."""
    import math
    import os

    for name in ("max_request_bytes", "max_connections"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, name)}")
    for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "shutdown_timeout"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0) and not (
                name == "shutdown_timeout" and value == 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number of seconds "
                             f"> 0, got {value}")
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty")
