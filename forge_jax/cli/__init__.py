"""The ``forge-jax`` command line: ``info``, ``demo``, ``generate``, ``tune``, ``chat``,
``serve``, ``compile`` and ``export``, one module each; ``_run`` turns the errors a user can
cause into one line and an exit code."""

from __future__ import annotations

# _flax_import first: it imports flax (see there) before any command's module does.
from forge_jax.cli import (
    _flax_import,  # noqa: F401
    _noise,
    chat,
    compile,
    demo,
    export,
    generate,
    info,
    serve,
    tune,
)
from forge_jax.cli._flags import Parser, name_defaults
from forge_jax.cli._run import GenerateError, UsageError, report, run_command

__all__ = ["GenerateError", "UsageError", "main"]


def main(argv: list[str] | None = None) -> int:
    """Runs ``forge-jax`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = Parser(
        prog="forge-jax", description="forge_jax: functional JAX kernels for LLM inference")
    parser.add_argument("--version", action="store_true",
                        help="print the versions of forge_jax and JAX, and exit")
    subparsers = parser.add_subparsers(dest="command")
    # The order --help lists them in.
    for module in (info, demo, generate, tune, chat, serve, compile, export):
        module.add_parser(subparsers)
    for sub in subparsers.choices.values():
        sub.add_argument("--verbose", action="store_true",
                         help="also show the libraries' own log lines on stderr (jaxlib's, "
                              "the CUDA plugin's, libtpu's), which are filtered out otherwise")
    name_defaults(parser)
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named with the subcommand they were given to
            command = getattr(args, "command", None)
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}",
                             prog=f"forge-jax {command}" if command else "forge-jax")
    except UsageError as e:
        return report(e.prog, e, 2)
    if args.version:
        import jax

        import forge_jax

        print(f"forge-jax {forge_jax.__version__} (JAX {jax.__version__})")
        return 0
    if not hasattr(args, "fn"):
        parser.print_help()
        return 2
    with _noise.filtered(not args.verbose):
        return run_command(args.fn, args)
