"""Exported programs: the tiny model's steps exported (``forge_jax.generation.export`` and
``forge-jax export``), loaded by ``forge_jax.generation.exported`` in a fresh process that
never imports the model code, give exactly the live model's greedy tokens on CPU."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from cases.cli import assert_one_line_error, run

import forge_jax as fj
from forge_jax.generation import export as export_lib
from forge_jax.generation import exported as programs
from forge_jax.generation import loop as generation
from forge_jax.models import llama
from forge_jax.models.tiny import task as tasks
from forge_jax.models.tiny import train as train_tiny

BATCH, CONTEXT, PROMPT_LENGTH, NEW = 4, 32, 16, 8

# Runs in a fresh interpreter: loads the program both ways and reports the tokens, which
# source each load used, and whether the model code (or Flax) was ever imported.
_CHILD = """
import json, sys
import jax
jax.config.update("jax_platforms", "cpu")
from forge_jax.generation import exported as programs
prompts = json.loads(sys.argv[2])
out = {}
for executable in (False, True):
    program = programs.load(sys.argv[1], executable=executable)
    out[program.source] = program.generate(prompts, NEW)
out["text"] = programs.load(sys.argv[1]).generate_text(sys.argv[3], NEW)
out["modules"] = sorted(m for m in sys.modules
                        if m == "flax" or m.startswith(("forge_jax.models", "flax.")))
print(json.dumps(out))
""".replace("NEW", str(NEW))


@pytest.fixture(scope="module")
def model():
    return llama.from_pretrained(train_tiny.TINY_DIR)


@pytest.fixture(scope="module")
def prompts():
    problems = tasks.AdditionTask(max_digits=3).sample(np.random.default_rng(23), BATCH,
                                                        split="test")
    return [tasks.encode_prompt(p) for p in problems]


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_program")
    return export_lib.export(model, out, batch=BATCH, context=CONTEXT,
                             prompt_length=PROMPT_LENGTH, executable=True,
                             tokenizer=train_tiny.TINY_DIR / "tokenizer.json")


def test_the_manifest_describes_the_files(exported, model):
    manifest = programs.read_manifest(exported)
    assert manifest["platforms"] == ["cpu"] and manifest["decoding"] == "greedy"
    assert (manifest["batch"], manifest["context"], manifest["prompt_length"]) == (
        BATCH, CONTEXT, PROMPT_LENGTH)
    assert manifest["eos_token_ids"] == [tasks.EOS_ID]
    for step in programs.STEPS:
        assert (exported / manifest["steps"][step]["file"]).stat().st_size > 0
        assert (exported / manifest["executables"]["cpu"]["files"][step]).stat().st_size > 0
    # Weights are arguments, not constants: the steps are far smaller than the weights.
    weights = exported / programs.WEIGHTS
    assert (exported / programs.step_file("decode")).stat().st_size < weights.stat().st_size
    config = model.config
    cache = manifest["cache"]
    assert len(cache) == 2 * config.num_hidden_layers + 1  # k and v per layer, lengths
    assert cache[0]["shape"] == [BATCH, CONTEXT, config.num_key_value_heads, config.head_dim]


def test_a_fresh_process_without_the_model_code_generates_the_live_tokens(
        exported, model, prompts):
    live = generation.generate(model, prompts, NEW, cache="contiguous")
    live_paged = generation.generate(model, prompts, NEW)
    assert live == live_paged
    text_prompt = "123+459="
    live_text = tasks.decode(generation.generate(
        model, [tasks.encode_prompt(tasks.Problem(123, 459))], NEW)[0])[0]
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(exported), json.dumps(prompts), text_prompt],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["modules"] == []
    assert out["stablehlo"] == live
    assert out["executable"] == live
    # Some answers ended with eos before NEW tokens: the loop stops as generate does.
    assert any(row[-1] == tasks.EOS_ID and len(row) < NEW for row in live)
    assert out["text"] == live_text


def test_an_executable_from_another_jax_is_refused(exported, tmp_path):
    copy = tmp_path / "program"
    shutil.copytree(exported, copy)
    manifest = json.loads((copy / programs.MANIFEST).read_text())
    manifest["executables"]["cpu"]["jaxlib"] = "0.0.1"
    (copy / programs.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(programs.ProgramError, match=r"jaxlib 0\.0\.1, this is jax ") as e:
        programs.load(copy, executable=True)
    assert "\n" not in str(e.value)
    # Left to choose, it runs the exported StableHLO instead.
    assert programs.load(copy).source == "stablehlo"


@pytest.mark.target("h100")
def test_an_executable_for_a_named_target_runs_only_there(model, tmp_path):
    out = export_lib.export(model, tmp_path / "program", batch=1, context=16,
                            targets=("h100",))
    manifest = programs.read_manifest(out)
    h100 = fj.targets.get("h100")
    entry = manifest["executables"]["h100"]
    assert entry == {"platform": "gpu", "device_kind": h100.device_kind,
                     **programs.versions(),
                     "files": {s: f"{s}.h100.executable" for s in programs.STEPS}}
    # What the compiler wrote without the device: XLA GPU executables, serialized.
    for file in entry["files"].values():
        assert (out / file).stat().st_size > 1000
    assert programs.executable_mismatch(manifest, "gpu", h100.device_kind) is None
    a100 = fj.targets.get("a100").device_kind
    assert programs.executable_mismatch(manifest, "gpu", a100) == (
        f"the gpu executables were compiled for h100 ({h100.device_kind}), this device is "
        f"{a100!r}: load with executable=False (the exported StableHLO)")
    manifest["executables"]["h100"]["jax"] = "0.0.1"
    assert programs.executable_mismatch(manifest, "gpu", h100.device_kind).startswith(
        "the gpu executables were compiled by jax 0.0.1 / jaxlib ")
    # On this CPU: none to run; the exported StableHLO runs.
    with pytest.raises(programs.ProgramError, match="no serialized executable for 'cpu'"):
        programs.load(out, executable=True)
    assert programs.load(out).generate([[1, 5, 6]], 2) == \
        programs.load(out, executable=False).generate([[1, 5, 6]], 2)


@pytest.mark.parametrize("manifest, match", [
    (None, "not an exported program: no manifest.json"),
    ({"format": "other/1"}, "has format 'other/1'"),
    ({"format": programs.FORMAT, "platforms": ["tpu"]}, r"exported for platforms \['tpu'\]"),
])
def test_load_refuses_what_it_cannot_run(tmp_path, manifest, match):
    if manifest is not None:
        (tmp_path / programs.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(programs.ProgramError, match=match):
        programs.load(tmp_path)


def test_generate_refuses_prompts_the_program_was_not_exported_for(exported):
    program = programs.load(exported, executable=False)
    with pytest.raises(programs.ProgramError, match=r"1 to 4 prompts .*got 5"):
        program.generate([[1, 5]] * 5, 2)
    with pytest.raises(programs.ProgramError, match=r"prompts\[0\] has 17 tokens"):
        program.generate([[5] * 17], 2)
    with pytest.raises(programs.ProgramError, match=r"beyond the exported context=32"):
        program.generate([[5] * 16], 17)
    with pytest.raises(programs.ProgramError, match=r"outside \[0, 15\)"):
        program.generate([[1, 15]], 2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(context=65), "context=65 exceeds the model's max_position_embeddings=64"),
    (dict(batch=0), "batch must be a positive int, got batch=0"),
    (dict(context=16, prompt_length=16), r"prompt_length must be an int in \[1, context=16\)"),
    (dict(platforms=("gpu",)), "platforms must be distinct names"),
    (dict(platforms=("tpu",), executable=True), "executable=True compiles for CPU"),
    (dict(targets=("h10",)), "unknown target 'h10'"),
    (dict(targets=("h100", "h100")), "targets must be distinct"),
])
def test_export_refuses_bad_arguments_before_any_work(model, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        export_lib.export(model, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_the_cli_exports_for_several_platforms(capsys, tmp_path):
    rc, out, err = run(capsys, "export", "--out", str(tmp_path), "--context", "16",
                       "--platforms", "cpu,cuda,tpu")
    assert rc == 0, err
    assert "wrote" in out and "cpu, cuda, tpu" in out
    manifest = programs.read_manifest(tmp_path)
    assert manifest["platforms"] == ["cpu", "cuda", "tpu"]
    assert manifest["implementations"] == "xla" and manifest["prompt_length"] == 8
    assert manifest["tokenizer"] == "tokenizer.json" and (tmp_path / "tokenizer.json").is_file()
    program = programs.load(tmp_path)
    assert program.generate_text("12+34=", 6) == "64"


@pytest.mark.parametrize("argv, fragments", [
    (["--platforms", "cpu,gpu"], ["--platforms must be distinct names"]),
    (["--platforms", "tpu", "--executable"], ["--executable compiles for CPU"]),
    (["--context", "65"], ["--context 65 exceeds", "max_position_embeddings=64"]),
    (["--context", "16", "--prompt-length", "16"], ["--prompt-length 16 must be below"]),
    (["--batch", "0"], ["--batch must be a positive int, got 0"]),
    (["--targets", "h100,h200"], ["--targets: unknown target 'h200'", "known: h100"]),
])
def test_the_cli_refuses_bad_flags_before_loading(capsys, tmp_path, no_model_load, argv,
                                                  fragments):
    result = run(capsys, "export", "--out", str(tmp_path / "out"), *argv)
    assert_one_line_error(result, *fragments, prog="forge-jax export")
    assert not pathlib.Path(tmp_path / "out").exists()


# Three prompts of the test tokenizer's corpus (any text encodes; the models are random).
TEXT_PROMPTS = ("The quick brown fox", "Hello there! How are", "tell me a story about")


def _live_text(model, tokenizer, prompt):
    from forge_jax.generation import SamplingParams
    from forge_jax.text import api as text

    return text.generate_text(model, tokenizer, prompt, max_new_tokens=NEW,
                              sampling=SamplingParams(), cache=fj.kv_cache.CacheSpec(
                                  kind="contiguous"))


def _without_bos(directory: pathlib.Path) -> pathlib.Path:
    """The checkpoint's tokenizer.json without its post-processor: it adds no BOS."""
    file = directory / "tokenizer.json"
    spec = json.loads(file.read_text())
    spec["post_processor"] = None
    file.write_text(json.dumps(spec))
    return directory


@pytest.mark.parametrize("adds_bos", [True, False], ids=["bos", "no-bos"])
def test_the_programs_text_is_the_live_models_whether_the_tokenizer_adds_bos_or_not(
        tmp_path, adds_bos):
    from cases import chat_checkpoint

    from forge_jax.text import api as text

    directory = chat_checkpoint.write_checkpoint(tmp_path / "ckpt")
    if not adds_bos:
        _without_bos(directory)
    model, tokenizer = llama.from_pretrained(directory), text.load_tokenizer(directory)
    bos = model.config.bos_token_id
    assert all((tokenizer.encode(p)[0] == bos) == adds_bos for p in TEXT_PROMPTS)
    out = export_lib.export(model, tmp_path / "program", context=32, prompt_length=16,
                            tokenizer=directory / "tokenizer.json")
    program = programs.load(out)
    live = [_live_text(model, tokenizer, p) for p in TEXT_PROMPTS]
    assert [program.generate_text(p, NEW) for p in TEXT_PROMPTS] == live
    if not adds_bos:  # a BOS prepended would change the answer: the test tells them apart
        with_bos = [tokenizer.decode(generation.generate(
            model, [[bos] + tokenizer.encode(p)], NEW, eos_token_id=())[0][:NEW])
            for p in TEXT_PROMPTS]
        assert with_bos != [tokenizer.decode(generation.generate(
            model, [tokenizer.encode(p)], NEW, eos_token_id=())[0][:NEW])
            for p in TEXT_PROMPTS]


def _chat_gguf(path: pathlib.Path, add_bos: bool | None = None) -> pathlib.Path:
    """A random GGUF Llama whose tokenizer (byte-level BPE, as SmolLM2's) adds no BOS (or,
    with ``add_bos``, its ``tokenizer.ggml.add_bos_token``, as Llama 3's sets it)."""
    from cases import chat_checkpoint, gguf_files

    spec = json.loads(chat_checkpoint.build_tokenizer().to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    config = dict(gguf_files.CONFIG, vocab_size=len(tokens), bos_token_id=tokens.index("<s>"),
                  eos_token_id=tokens.index("<|im_end|>"))
    gguf_files.write(path, gguf_files.random_llama(5, config), {"attn_q": "Q8_0"},
                     config=config, tokenizer=dict(
                         tokens=tokens, merges=merges,
                         types=[3 if t in chat_checkpoint.SPECIALS else 1 for t in tokens],
                         **({} if add_bos is None else {"add_bos_token": add_bos})))
    return path


@pytest.mark.parametrize("add_bos", [None, False, True])
def test_a_gguf_bpe_tokenizer_adds_a_bos_exactly_when_its_metadata_says(tmp_path, add_bos):
    from forge_jax.text import api as text

    tokenizer = text.load_tokenizer(_chat_gguf(tmp_path / "model.gguf", add_bos))
    bos = tokenizer.backend.token_to_id("<s>")
    plain = tokenizer.encode("Hello there", add_special_tokens=False)
    assert tokenizer.encode("Hello there") == ([bos] if add_bos else []) + plain


def test_a_gguf_file_exports_with_its_own_tokenizer_in_a_fresh_process(tmp_path):
    import os

    from forge_jax.text import api as text

    file = _chat_gguf(tmp_path / "model.gguf")
    out = tmp_path / "program"
    result = subprocess.run(
        [sys.executable, "-m", "forge_jax.cli", "export", "--checkpoint", str(file),
         "--out", str(out), "--context", "32"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "program"]
    program = programs.load(out)
    assert program.manifest["tokenizer"] == programs.TOKENIZER
    model, tokenizer = llama.from_pretrained(file), text.load_tokenizer(file)
    live = [_live_text(model, tokenizer, p) for p in TEXT_PROMPTS]
    assert [program.generate_text(p, NEW) for p in TEXT_PROMPTS] == live


def test_a_failed_export_leaves_nothing_and_a_partial_one_is_refused_in_one_line(
        model, tmp_path, monkeypatch):
    def disk_full(out, named_weights):
        (out / programs.WEIGHTS).write_bytes(b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_lib, "_save_weights", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_lib.export(model, tmp_path / "program", context=16)
    assert list(tmp_path.iterdir()) == []
    # An earlier export survives a failed one over it.
    monkeypatch.undo()
    export_lib.export(model, tmp_path / "program", context=16)
    monkeypatch.setattr(export_lib, "_save_weights", disk_full)
    with pytest.raises(OSError):
        export_lib.export(model, tmp_path / "program", context=16, batch=2)
    assert [p.name for p in tmp_path.iterdir()] == ["program"]
    assert programs.load(tmp_path / "program").batch == 1
    # A directory an interrupted export (of another version, or a copy) left half-written.
    partial = tmp_path / "partial"
    shutil.copytree(tmp_path / "program", partial)
    (partial / programs.MANIFEST).unlink()
    with pytest.raises(programs.ProgramError) as e:
        programs.load(partial)
    assert "partial export" in str(e.value) and "\n" not in str(e.value)
    assert "decode.jax_exported" in str(e.value)
    # ... and export refuses to write into a directory that is not a program.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an exported program"):
        export_lib.export(model, tmp_path / "other", context=16)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
