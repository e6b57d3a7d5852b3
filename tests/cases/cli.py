"""Running the ``forge-jax`` command in-process, and the shape of its usage errors."""

from __future__ import annotations

from forge_jax import cli


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(result, *fragments, prog="forge-jax generate"):
    rc, out, err = result
    assert rc == 2, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{prog}: error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
