"""JAX's persistent compilation cache for the commands that compile a model (``generate``,
``chat``): where it lives, and the context that turns it on for one command."""

from __future__ import annotations

import argparse

from forge_jax.cli._run import UsageError

CACHE_ENV = "FORGE_JAX_COMPILATION_CACHE"
_CACHE_OFF = ("", "0", "off", "no", "none", "false")


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compilation-cache", metavar="DIR", default=None,
                        help=f"JAX's persistent compilation cache (default: ${CACHE_ENV}, else "
                             f"~/.cache/forge_jax/jax): a second run skips compilation")
    parser.add_argument("--no-compilation-cache", action="store_true",
                        help=f"compile afresh, cache nothing (or {CACHE_ENV}=off)")


def compilation_cache_dir(args: argparse.Namespace):
    """Where the persistent compilation cache lives for this run, or None for none:
    ``--no-compilation-cache``, else ``--compilation-cache DIR``, else
    ``$FORGE_JAX_COMPILATION_CACHE`` (a directory, or ``off``), else
    ``$XDG_CACHE_HOME/forge_jax/jax`` (``~/.cache/forge_jax/jax``)."""
    import os
    import pathlib

    if args.no_compilation_cache:
        return None
    if args.compilation_cache:
        return pathlib.Path(args.compilation_cache).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in _CACHE_OFF else pathlib.Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "forge_jax" / "jax"


def check(args: argparse.Namespace) -> None:
    """Creates the cache directory the flags ask for now, before the model loads, so that
    one that cannot be created is a usage error naming where it came from."""
    import os

    directory = compilation_cache_dir(args)
    if directory is None:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        source = (f"--compilation-cache {args.compilation_cache}" if args.compilation_cache
                  else f"${CACHE_ENV}={os.environ[CACHE_ENV]}" if os.environ.get(CACHE_ENV)
                  else "the default compilation cache")
        raise UsageError(f"{source}: cannot create the directory {directory}: "
                         f"{e.strerror or e}; pass --compilation-cache DIR or "
                         f"--no-compilation-cache") from None


def gguf_cache(args: argparse.Namespace):
    """Where a GGUF file's conversion (metadata, tokenizer, weights) is kept for this run,
    as a context manager: the compilation cache's ``gguf`` folder (none without one)."""
    from forge_jax.models.checkpoints import gguf_cache as kept

    directory = compilation_cache_dir(args)
    if directory is not None:
        try:
            (directory / "gguf").mkdir(parents=True, exist_ok=True)
        except OSError:  # no cache: `check` names the problem
            directory = None
    return kept.use_gguf_cache(None if directory is None else directory / "gguf")


def compilation_cache(args: argparse.Namespace) -> CompilationCache:
    """The cache the flags ask for, as a context manager: ``with compilation_cache(args):``."""
    return CompilationCache(compilation_cache_dir(args))


class CompilationCache:
    """JAX's persistent compilation cache in ``directory`` for the duration of a command
    (every step cached, however fast it compiled), so that the next run of the same model
    loads its compiled steps instead of compiling them. JAX's settings are restored on
    exit (``main`` may run inside a longer process); a cache the user configured for JAX
    itself (``JAX_COMPILATION_CACHE_DIR``) is left alone."""

    _SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                 "jax_persistent_cache_min_entry_size_bytes")

    def __init__(self, directory):
        self.directory, self.saved, self.active = directory, None, None
        self.steps = None  # the compiled-steps cache beside it (generation.compiled_cache)
        self.gguf = None  # and a GGUF file's conversion (models.checkpoints.gguf_cache)

    def __enter__(self):
        import jax

        if self.directory is None or jax.config.jax_compilation_cache_dir:
            self.active = jax.config.jax_compilation_cache_dir
            return self
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot create the compilation cache {self.directory}: {e}; "
                             f"pass --compilation-cache DIR or --no-compilation-cache"
                             ) from None
        from jax.experimental.compilation_cache import compilation_cache

        self.saved = {name: getattr(jax.config, name) for name in self._SETTINGS}
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", str(self.directory))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        self.active = str(self.directory)
        from forge_jax.generation import compiled_cache

        self.steps = compiled_cache.use_step_cache(self.directory / "steps")
        self.steps.__enter__()
        from forge_jax.models.checkpoints import gguf_cache

        self.gguf = gguf_cache.use_gguf_cache(self.directory / "gguf")
        self.gguf.__enter__()
        return self

    def __exit__(self, *exc):
        if self.gguf is not None:
            self.gguf.__exit__(None, None, None)
        if self.steps is not None:
            self.steps.__exit__(None, None, None)
        if self.saved is not None:
            import jax
            from jax.experimental.compilation_cache import compilation_cache

            for name, value in self.saved.items():
                jax.config.update(name, value)
            compilation_cache.reset_cache()
        return False
