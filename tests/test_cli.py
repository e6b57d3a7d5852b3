"""The ``forge-jax`` command line, end to end through ``forge_jax.cli.main``."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from forge_jax import cli, registry
from forge_jax.models.tiny import task as tasks
from forge_jax.models.tiny import train as train_tiny

TINY = train_tiny.TINY_DIR


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, out, err, *fragments):
    assert rc == 2, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("forge-jax generate: error: ")
    for fragment in fragments:
        assert fragment in err, err


def test_info_and_demo_still_work(capsys):
    rc, out, _ = run(capsys, "info")
    assert rc == 0 and "jax" in out.lower()
    rc, out, _ = run(capsys, "demo")
    n = len(registry.ops())
    assert rc == 0 and f"{n}/{n} ops within tolerance" in out


def test_generate_runs_the_embedded_model(capsys):
    rc, out, err = run(capsys, "generate", "--num-problems", "32", "--show", "3", "--progress")
    assert rc == 0, err
    accuracy = re.search(r"accuracy: (\d+)/32 = ", out)
    assert accuracy and int(accuracy.group(1)) >= 29, out  # >= 90%
    assert len(re.findall(r"^ +\d+\+\d+= ", out, re.M)) == 3  # the examples shown
    assert re.search(r"prefill: .* tokens/s", out) and re.search(r"decode: .* tokens/s", out)
    for op in ("embedding", "matmul", "rms_norm", "rope", "silu_mul", "paged_attention"):
        assert re.search(rf"^  {op} +xla \(auto, cpu\)", out, re.M), out
    assert "generating [" in err  # the progress bar, on stderr


def test_generate_prompt_text_and_ids_and_both_caches(capsys):
    rc, out, err = run(capsys, "generate", "--prompt", "123+459=", "--cache", "contiguous")
    assert rc == 0, err
    assert "completion: '285'" in out  # 582, least significant digit first
    ids = ",".join(str(i) for i in tasks.encode_prompt(tasks.Problem(123, 459)))
    rc, out2, err = run(capsys, "generate", "--prompt-ids", ids, "--implementation", "xla")
    assert rc == 0, err
    answer = [tasks.VOCAB[c] for c in "285"] + [tasks.EOS_ID]
    assert f"generated ids: {answer}" in out and f"generated ids: {answer}" in out2
    assert re.search(r"^  matmul +xla \(context, cpu\)", out2, re.M), out2


def test_generate_bfloat16(capsys):
    rc, out, err = run(capsys, "generate", "--dtype", "bfloat16", "--num-problems", "16")
    assert rc == 0, err
    assert "bfloat16" in out and re.search(r"accuracy: \d+/16", out)


BAD_CONFIGS = {
    "other_architecture": (json.dumps({"architectures": ["GPT2LMHeadModel"],
                                       "model_type": "gpt2"}), ("unsupported", "gpt2")),
    "bad_json": ("{not json", ("not valid JSON",)),
}


@pytest.mark.parametrize("kind", ["missing", "no_config", *BAD_CONFIGS])
def test_bad_checkpoint_directory_is_one_line(capsys, tmp_path, kind):
    if kind == "missing":
        path, fragments = tmp_path / "missing", ("does not exist",)
    elif kind == "no_config":
        path, fragments = tmp_path, ("no config.json",)
    else:
        text, fragments = BAD_CONFIGS[kind]
        (tmp_path / "config.json").write_text(text)
        path = tmp_path
    rc, out, err = run(capsys, "generate", "--checkpoint", str(path))
    assert_one_line_error(rc, out, err, *fragments)


def test_bad_arguments_are_one_line(capsys, tmp_path):
    assert_one_line_error(*run(capsys, "generate", "--prompt-ids", "1,x"), "comma-separated")
    assert_one_line_error(*run(capsys, "generate", "--prompt-ids", "1,99"), "[99]")
    assert_one_line_error(*run(capsys, "generate", "--implementation", "nope"), "nope")
    assert_one_line_error(*run(capsys, "generate", "--top-p", "1.5"), "--top-p")
    # A checkpoint without tokenizer.json takes ids, not text; one without a task needs a prompt.
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(TINY / "model.safetensors", plain)
    config = json.loads((TINY / "config.json").read_text())
    del config["forge_jax_task"]
    (plain / "config.json").write_text(json.dumps(config))
    assert_one_line_error(*run(capsys, "generate", "--checkpoint", str(plain), "--prompt", "1+1="),
                          "no tokenizer.json", "--prompt-ids")
    assert_one_line_error(*run(capsys, "generate", "--checkpoint", str(plain)), "--prompt")


def test_generate_on_a_mesh(capsys):
    """--mesh: the embedded model sharded over conftest's CPU devices answers as on one."""
    rc, out, err = run(capsys, "generate", "--mesh", "dp=2,tp=4", "--num-problems", "32",
                       "--show", "0")
    assert rc == 0, err
    assert "sharded over dp=2 x tp=4 (8 CPU devices)" in out, out
    assert re.search(r"accuracy: (3[0-2])/32 = ", out), out
    rc, one, err = run(capsys, "generate", "--num-problems", "32", "--show", "0")
    assert re.search(r"accuracy: .*", out).group(0) == re.search(r"accuracy: .*", one).group(0)


@pytest.mark.parametrize("mesh,fragment", [
    ("tp=16", "needs 16 devices; only 8 available"),
    ("tp=3", "num_attention_heads=4 does not split over a tensor axis of 3"),
    ("tp=2,x=2", "mesh axes ['x'] are neither tp_axis='tp'"),
    ("tp:2", "a mesh is written like 'tp=4'"),
])
def test_bad_mesh_is_one_line(capsys, mesh, fragment):
    assert_one_line_error(*run(capsys, "generate", "--mesh", mesh), "--mesh", fragment)
