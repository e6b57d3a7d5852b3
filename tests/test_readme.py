"""The README is the front door: short, the two commands exactly as CI runs them, and links
that resolve. Its Python blocks run in ``tests/test_docs.py`` with the guides'."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# CI (.ci/run) runs the second command verbatim; a user types both as written.
COMMANDS = [
    "pip install -e . && forge-jax generate",
    'pip install -e ".[test,parity,train]" && python -m pytest -q',
]


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; guides belong in docs/"


def test_readme_shows_the_two_commands_verbatim():
    text = README.read_text()
    for command in COMMANDS:
        assert f"\n{command}\n" in text, command


def test_readme_links_resolve():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10, local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert missing == []


def test_readme_links_every_guide():
    text = README.read_text()
    guides = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")
                    if p.name != "index.md")
    unlinked = [g for g in guides if f"]({g})" not in text]
    assert unlinked == []
