"""Every ``forge-jax`` subcommand's ``--help``: a description of what it does, and help text
for every flag, naming its default where it has one (flags added later are held to it too)."""

from __future__ import annotations

import argparse
import re

import pytest

from forge_jax import cli


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parsers = {}
    real = cli.Parser.parse_known_args

    def capture(self, args=None, namespace=None):  # the parser main() built, not parsed
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.update(action.choices)
        raise SystemExit(0)

    cli.Parser.parse_known_args = capture
    try:
        with pytest.raises(SystemExit):
            cli.main(["info"])
    finally:
        cli.Parser.parse_known_args = real
    return parsers


SUBCOMMANDS = _subcommands()
# Flags whose value is asked for each time (no default to name), or a switch whose default
# (off) is what its absence says.
_NO_DEFAULT = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction)


def test_every_subcommand_is_listed():
    assert {"info", "demo", "generate", "tune", "chat", "serve", "compile", "export"} <= set(
        SUBCOMMANDS)


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommands_help_describes_it_and_each_flag(name):
    parser = SUBCOMMANDS[name]
    problems = [] if parser.description and len(parser.description) > 20 else [
        "no description"]
    for action in parser._actions:
        flag = "/".join(action.option_strings) or action.dest
        if not (action.help and action.help.strip()):
            problems.append(f"{flag} has no help")
            continue
        if isinstance(action, _NO_DEFAULT) or action.required or action.default is None:
            continue
        if isinstance(action, argparse.BooleanOptionalAction) or action.default == "":
            continue
        default = str(action.default)
        if not (re.search(r"default", action.help, re.I) or default in action.help):
            problems.append(f"{flag}'s help does not name its default {default!r}")
    assert not problems, f"forge-jax {name}: {problems}"
    assert parser.description.split(".")[0] in " ".join(parser.format_help().split())


def test_checkpoint_help_mentions_gguf_files():
    for name in ("generate", "chat", "serve", "export", "compile"):
        action = next(a for a in SUBCOMMANDS[name]._actions if "--checkpoint" in a.option_strings)
        assert "GGUF" in action.help, (name, action.help)


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "export", "compile"])
def test_quantize_with_a_gguf_file_is_refused_before_the_file_is_read(
        capsys, tmp_path, monkeypatch, no_model_load, command):
    from cases import gguf_files
    from cases.cli import assert_one_line_error
    from cases.cli import run as cli_run

    import forge_jax as fj
    from forge_jax.models.checkpoints import gguf

    if command == "compile" and (reason := fj.targets.missing("h100")):
        pytest.skip(f"forge-jax compile first names the missing compiler: {reason}")
    file = tmp_path / "model.gguf"
    gguf_files.write(file, gguf_files.random_llama(0), {})

    def refuse(*args, **kwargs):
        raise AssertionError("read the GGUF file before refusing --quantize")

    monkeypatch.setattr(gguf, "open_gguf", refuse)
    extra = {"export": ["--out", str(tmp_path / "out")], "compile": ["--target", "h100"]}
    assert_one_line_error(
        cli_run(capsys, command, "--checkpoint", str(file), "--quantize", "int8",
                *extra.get(command, [])),
        f"--quantize: {file} is a GGUF file, loaded as it is quantized",
        prog=f"forge-jax {command}")
