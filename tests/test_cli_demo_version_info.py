"""``forge-jax demo`` checks every registered op (the paged and ragged ones included),
``forge-jax --version``, ``forge-jax info`` shows a platform's whole reason, and
``generate``'s decode line counts its steps honestly."""

from __future__ import annotations

import importlib.metadata
import re

import jax
import jax.numpy as jnp
import pytest

from forge_jax import backends, cli, dispatch, registry
from forge_jax.ops import paged, ragged


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_demo_checks_every_registered_op(capsys):
    rc, out, err = run(capsys, "demo", "--seed", "3")
    assert rc == 0, out
    # The implementation auto picks on the CPU: XLA, or the C++ kernel for quantized products.
    checked = re.findall(r"^  (\w+)\s+(?:xla|cpu_kernel)\s+max \|err\| \S+\s+"
                         r"\(\s*[\d.]+% of tolerance\)\s+PASS$", out, re.M)
    assert sorted(checked) == sorted(registry.ops()), out
    assert f"{len(registry.ops())}/{len(registry.ops())} ops within tolerance" in out


WRONG = {
    # A write that skips nothing: the padding token's slot -1 wraps around to the last slot.
    "paged_write": lambda k_pages, v_pages, k, v, slots: tuple(
        pages.reshape(pages.shape[0], -1, pages.shape[-1]).at[:, slots].set(
            jnp.swapaxes(x, 0, 1)).reshape(pages.shape)
        for pages, x in ((k_pages, k), (v_pages, v))),
    # A gather that leaves the tail past each length as the pages hold it.
    "paged_gather": lambda pages, block_tables, lengths: paged.gather_pages(
        pages, block_tables, jnp.full_like(lengths, block_tables.shape[1] * pages.shape[2])),
    # Copies made one after the other, a skipped row not skipped.
    "copy_pages": lambda k_pages, v_pages, copies: tuple(
        pages.at[:, copies[:, 1]].set(pages[:, copies[:, 0]]) for pages in (k_pages, v_pages)),
    # Attention whose logits are scaled by 1.1.
    "ragged_paged_attention": lambda q, **kw: ragged.ragged_paged_attention_xla(
        (q * 1.1).astype(q.dtype), **kw),
}


@pytest.mark.parametrize("op", list(WRONG))
def test_demo_fails_on_a_wrong_paged_implementation(capsys, op):
    dispatch.register(op, "wrong", priority={jax.default_backend(): 100})(WRONG[op])
    try:
        rc, out, err = run(capsys, "demo", "--seed", "2")
    finally:
        dispatch.unregister(op, "wrong")
    assert rc == 1, out
    assert re.search(rf"^  {op}\s+wrong .* FAIL$", out, re.M), out
    assert f"FAILED: {op}" in out, out


def test_version(capsys):
    rc, out, err = run(capsys, "--version")
    assert rc == 0 and err == ""
    version = importlib.metadata.version("forge-jax")
    assert out == f"forge-jax {version} (JAX {jax.__version__})\n", out


def test_info_shows_a_platforms_whole_reason(capsys, monkeypatch):
    reason = ("Unable to initialize backend 'tpu': " + "x" * 300
              + "\n(you may need to uninstall the failing plugin package)")
    real = jax.devices

    def devices(name=None):
        if name == "tpu":
            raise RuntimeError(reason)
        return real(name)

    monkeypatch.setattr(jax, "devices", devices)
    rc, out, err = run(capsys, "info")
    assert rc == 0, err
    assert "  tpu: none (Unable to initialize backend 'tpu': " + "x" * 300 in out, out
    assert "    (you may need to uninstall the failing plugin package))" in out, out
    assert backends._platform_info("tpu").error == reason


def test_decode_line_counts_the_step_past_the_eos(capsys):
    from forge_jax.models.tiny import task as tasks

    ids = ",".join(map(str, tasks.encode_prompt(tasks.Problem(12, 34))))
    rc, out, err = run(capsys, "generate", "--prompt-ids", ids, "--max-new-tokens", "10")
    assert rc == 0, err
    answer = [tasks.VOCAB["6"], tasks.VOCAB["4"], tasks.EOS_ID]  # 46 backwards, then eos
    assert f"generated ids: {answer}" in out, out
    assert ("decode:  2 tokens in 3 steps (1 past the end-of-sequence token: it is read one "
            "step behind, so the device never waits for the host), ") in out, out
    rc, out, err = run(capsys, "generate", "--prompt-ids", "1,2,13", "--max-new-tokens", "6")
    assert rc == 0, err
    assert re.search(r"^decode:  5 tokens in 5 steps, [\d.]+ ms/step", out, re.M), out
