"""Compiled generation steps kept on disk (forge_jax/generation/compiled_cache.py): a fresh
process that finds them runs them without tracing and gives the same tokens; one that
finds none compiles as before; a corrupted or foreign entry is ignored with one log line.

Each process is a real fresh Python (subprocess) on the repository's tiny checkpoint."""

from __future__ import annotations

import json
import pathlib
import pickle
import subprocess
import sys

import pytest

TINY = pathlib.Path(__file__).resolve().parents[1] / "models" / "tiny"

# Generates greedily and sampling inside the step cache; with "no-trace", the jitted steps
# refuse to be traced, so every step must come from the cache. Prints a JSON line.
SCRIPT = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, format="LOG %(name)s %(message)s")
from forge_jax.generation import compiled_cache, steps
from forge_jax.models import llama

class NoTrace:
    def __getattr__(self, name):
        raise AssertionError(f"the step was traced ({name})")
    def __call__(self, *args, **kwargs):
        raise AssertionError("the step was traced")

if sys.argv[2] == "no-trace":
    steps.prefill_step._jitted = NoTrace()
    steps.decode_step._jitted = NoTrace()
model = llama.from_pretrained(sys.argv[3])
with compiled_cache.use_step_cache(sys.argv[1]):
    greedy = llama.generate(model, [[1, 4, 5, 13, 6]], max_new_tokens=6, eos_token_id=())
    sampled = llama.generate(model, [[1, 7, 8, 13, 9, 10]], max_new_tokens=5,
                             eos_token_id=(), temperature=1.0, seed=3)
print("RESULT " + json.dumps([greedy, sampled]))
"""


def _run(cache: pathlib.Path, mode: str) -> tuple[list, list[str]]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(cache), mode, str(TINY)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    logs = [line for line in done.stderr.splitlines() if line.startswith("LOG ")]
    return json.loads(result[len("RESULT "):]), logs


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache written by a first process, and that process's tokens."""
    cache = tmp_path_factory.mktemp("steps")
    tokens, logs = _run(cache, "trace")
    assert logs == []
    return cache, tokens


def test_a_fresh_process_runs_the_kept_steps_untraced(filled):
    cache, tokens = filled
    entries = sorted(p.name for p in cache.glob("*.step"))
    # prefill and decode, greedy and sampling: four steps
    assert len(entries) == 4 and {e.split("-")[0] for e in entries} == {"prefill", "decode"}
    again, logs = _run(cache, "no-trace")
    assert again == tokens and logs == []


@pytest.mark.slow
def test_no_cache_compiles_as_before(filled, tmp_path):
    _, tokens = filled
    fresh, logs = _run(tmp_path, "trace")
    assert fresh == tokens and logs == []
    assert len(list(tmp_path.glob("*.step"))) == 4


@pytest.mark.parametrize("damage", ["corrupted", pytest.param("foreign", marks=pytest.mark.slow)])
def test_a_bad_entry_is_ignored_with_one_log_line(filled, tmp_path, damage):
    cache, tokens = filled
    for entry in cache.glob("*.step"):
        data = entry.read_bytes()
        if damage == "corrupted":
            data = data[: len(data) // 2]
        else:  # as if written for another machine or version under this name
            record = pickle.loads(data)
            record["key"] = record["key"].replace("jax ", "jax 0.0.0-other ", 1)
            data = pickle.dumps(record)
        (tmp_path / entry.name).write_bytes(data)
    out, logs = _run(tmp_path, "trace")
    assert out == tokens
    assert len(logs) == 4 and all("ignoring the compiled step" in line for line in logs), logs
    if damage == "foreign":
        assert all("another model, machine" in line for line in logs)
    # rewritten: the next process loads them untraced
    again, logs = _run(tmp_path, "no-trace")
    assert again == tokens and logs == []


# The serving engine's step inside the step cache: with "no-trace", its jitted step refuses
# to be traced, so every variant must come from the cache.
ENGINE_SCRIPT = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, format="LOG %(name)s %(message)s")
from forge_jax import serving
from forge_jax.generation import compiled_cache
from forge_jax.models import llama
from forge_jax.serving import batch_step

class NoTrace:
    def __getattr__(self, name):
        raise AssertionError(f"the step was traced ({name})")
    def __call__(self, *args, **kwargs):
        raise AssertionError("the step was traced")

if sys.argv[2] == "no-trace":
    batch_step.ragged_step._jitted = NoTrace()
model = llama.from_pretrained(sys.argv[3])
with compiled_cache.use_step_cache(sys.argv[1]):
    engine = serving.Engine(model, None, serving.EngineConfig(
        max_batch_tokens=16, min_batch_tokens=8, num_pages=32, eos_token_ids=()))
    streams = [engine.submit(p, serving.RequestParams(max_tokens=5))
               for p in ([1, 4, 5, 13, 6], [1, 7, 8, 13, 9, 10, 11])]
    while engine.has_work():
        engine.step()
print("RESULT " + json.dumps([s.result()[0] for s in streams]))
"""


def test_the_serving_step_is_kept_and_run_untraced(tmp_path):
    runs = []
    for mode in ("trace", "no-trace"):
        done = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(tmp_path), mode,
                               str(TINY)], capture_output=True, text=True, timeout=600,
                              check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        assert not [line for line in done.stderr.splitlines() if line.startswith("LOG ")]
        runs.append(next(line for line in done.stdout.splitlines() if line.startswith("RESULT ")))
    assert any(f.name.startswith("ragged-") for f in tmp_path.iterdir())
    tokens = json.loads(runs[0][len("RESULT "):])
    assert runs[1] == runs[0] and all(len(t) == 5 for t in tokens)


# A step compiled while JAX's persistent compilation cache already holds it: JAX hands back
# the executable it loaded from there, which serializes without its functions' code
# (XLA:CPU: "Function compare_convert_fusion not found" at the kept step's first run), so a
# step to keep must be compiled afresh.
JAX_CACHE_SCRIPT = """
import functools, sys
import jax, jax.numpy as jnp
from forge_jax.generation import compiled_cache
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

@functools.partial(jax.jit, static_argnames=("k",))
def f(x, y, *, k):
    return (jnp.tanh(x @ y) > 0.1).astype(jnp.float32).sum(-1) * k + jnp.exp(x).mean()

x, y = jnp.linspace(-1, 1, 64 * 64).reshape(64, 64), jnp.linspace(1, -2, 64 * 64).reshape(64, 64)
want = f(x, y, k=3)  # now in JAX's persistent cache
jax.clear_caches()
step = compiled_cache.CachedStep(f, "f", ("k",))
with compiled_cache.use_step_cache(sys.argv[2]):
    assert (step(x, y, k=3) == want).all()  # compiled (JAX's cache would have it) and kept
    compiled_cache._LOADED.clear()
    assert (step(x, y, k=3) == want).all()  # the kept executable, loaded and run
print("OK")
"""


def test_a_step_in_jax_s_own_cache_is_compiled_afresh_to_be_kept(tmp_path):
    done = subprocess.run([sys.executable, "-c", JAX_CACHE_SCRIPT, str(tmp_path / "jax"),
                           str(tmp_path / "steps")], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]
    assert len(list((tmp_path / "steps").glob("f-*.step"))) == 1
