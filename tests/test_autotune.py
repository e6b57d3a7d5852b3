"""fj.autotune and the persistent cache (forge_jax/autotuning.py), on CPU with the XLA and
interpreted kernel implementations: candidates, timing, caching, lookup from another
process, auto selection following the measurement, invalidation and broken cache files."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.inputs import normal, rng

import forge_jax as fj
from forge_jax import autotuning, dispatch

INTERPRET = "pallas_gpu_interpret"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    path = tmp_path / "autotune.json"
    monkeypatch.setenv(autotuning.CACHE_ENV, str(path))
    return path


def norm_inputs(rows=8, dim=48, seed=0):
    gen = rng(seed, rows, dim)
    return normal(gen, (rows, dim)), normal(gen, (dim,))


def store(path, **entry):
    """Writes one cache entry for this device and JAX version (fields overridable)."""
    entry = {"device_kind": autotuning.device_kind("cpu"), "jax": jax.__version__,
             "config": {}, **entry}
    path.write_text(json.dumps({"format": autotuning.FORMAT, "version": autotuning.VERSION,
                                "entries": [entry]}))


def test_times_every_candidate_and_stores_the_fastest(cache):
    x, w = norm_inputs()
    result = fj.autotune("rms_norm", x, w, eps=1e-5, implementations=("xla", INTERPRET),
                         iters=2)
    assert not result.cached
    names = [c.implementation for c in result.candidates]
    assert names.count("xla") == 1
    assert names.count(INTERPRET) >= 2  # the defaults and the registered configurations
    assert {} in [c.config for c in result.candidates if c.implementation == INTERPRET]
    assert all(c.seconds > 0 and c.error is None for c in result.candidates)
    best = min(result.candidates, key=lambda c: c.seconds)
    assert (result.implementation, result.config, result.seconds) == (
        best.implementation, best.config, best.seconds)
    (entry,) = json.loads(cache.read_text())["entries"]
    assert entry["op"] == "rms_norm" and entry["jax"] == jax.__version__
    assert entry["device_kind"] == jax.devices()[0].device_kind
    assert entry["signature"] == "x=float32[8, 48] weight=float32[48] eps=1e-05 residual=None"
    assert entry["implementation"] == result.implementation
    assert len(entry["times"]) == len(result.candidates)


def test_default_candidates_are_what_auto_could_choose():
    x, w = norm_inputs()
    result = fj.autotune("rms_norm", x, w, iters=1)
    assert {c.implementation for c in result.candidates} == {"xla"}


def test_second_call_and_other_processes_read_the_cache(cache, monkeypatch):
    x, w = norm_inputs(rows=3)
    first = fj.autotune("rms_norm", x, w, implementations=("xla", INTERPRET), iters=1)

    def no_timing(*a, **k):
        raise AssertionError("timed again")

    monkeypatch.setattr(autotuning, "_time", no_timing)
    again = fj.autotune("rms_norm", x, w, implementations=("xla", INTERPRET))
    assert again.cached and again.implementation == first.implementation
    assert again.config == first.config and again.candidates == ()
    code = ("import jax.numpy as jnp, forge_jax as fj\n"
            "r = fj.autotune('rms_norm', jnp.ones((3, 48)), jnp.ones(48))\n"
            "print(r.cached, r.implementation)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", first.implementation]


@pytest.fixture
def probe():
    """A test implementation of silu_mul that records the keywords it was called with."""
    calls = []

    def fn(gate, up, **config):
        calls.append(config)
        return fj.silu_mul(gate, up, implementation="xla")

    dispatch.register("silu_mul", "probe")(fn)
    yield calls
    dispatch.unregister("silu_mul", "probe")


def test_auto_selection_follows_the_measured_winner_with_its_config(cache, probe):
    gate = normal(rng(1), (4, 40))
    sig = autotuning.signature(dict(gate=gate, up=gate))
    assert fj.explain("silu_mul", gate, gate).implementation == "xla"
    store(cache, op="silu_mul", signature=sig, implementation="probe", config={"block": 7})
    selection = fj.explain("silu_mul", gate, gate)
    assert selection.implementation == "probe" and selection.source == "auto"
    assert "measured slower than 'probe'" in selection.rejected["xla"]
    out = fj.silu_mul(gate, gate)
    assert probe == [{"block": 7}]
    np.testing.assert_allclose(out, fj.silu_mul(gate, gate, implementation="xla"))
    # Other shapes are not covered by the measurement.
    other = normal(rng(2), (4, 41))
    assert fj.explain("silu_mul", other, other).implementation == "xla"
    # A call by name is not overridden.
    assert fj.explain("silu_mul", gate, gate, implementation="xla").implementation == "xla"


def test_foreign_device_or_jax_version_is_not_used(cache, probe):
    gate = normal(rng(1), (4, 40))
    sig = autotuning.signature(dict(gate=gate, up=gate))
    store(cache, op="silu_mul", signature=sig, implementation="probe", jax="0.0.1")
    assert fj.explain("silu_mul", gate, gate).implementation == "xla"
    store(cache, op="silu_mul", signature=sig, implementation="probe", device_kind="TPU v9")
    assert fj.explain("silu_mul", gate, gate).implementation == "xla"


def test_a_winner_that_cannot_serve_falls_back_with_the_reason(cache):
    x, w = norm_inputs()
    sig = autotuning.signature(dispatch.bind("rms_norm", x, w))
    store(cache, op="rms_norm", signature=sig, implementation="gone")
    selection = fj.explain("rms_norm", x, w)
    assert selection.implementation == "xla"
    assert "not registered now" in selection.rejected["gone"]


def test_force_times_again_and_clear_forgets(cache):
    x, w = norm_inputs(rows=2)
    fj.autotune("rms_norm", x, w, iters=1)
    again = fj.autotune("rms_norm", x, w, iters=1, force=True)
    assert not again.cached and again.candidates
    gate = normal(rng(3), (2, 16))
    fj.autotune("silu_mul", gate, gate, iters=1)
    assert len(json.loads(cache.read_text())["entries"]) == 2
    assert autotuning.clear("silu_mul") == 1
    assert [e["op"] for e in json.loads(cache.read_text())["entries"]] == ["rms_norm"]
    assert autotuning.clear() == 1
    assert fj.autotune("rms_norm", x, w, iters=1).cached is False


@pytest.mark.parametrize("content", ["{not json", json.dumps({"some": "other tool"}),
                                     json.dumps({"format": autotuning.FORMAT, "version": 1,
                                                 "entries": [{"op": 3}]}),
                                     "\udcff"])
def test_corrupt_or_foreign_cache_is_ignored_with_a_warning(cache, content):
    cache.write_bytes(content.encode("utf-8", "surrogateescape"))
    x, w = norm_inputs(rows=5)
    with pytest.warns(RuntimeWarning, match="autotune cache .* ignored"):
        assert fj.explain("rms_norm", x, w).implementation == "xla"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fj.autotune("rms_norm", x, w, iters=1)
    assert not result.cached
    assert cache.with_name(cache.name + ".corrupt").exists()
    assert json.loads(cache.read_text())["entries"][0]["implementation"] == "xla"


def test_a_wrong_candidate_is_rejected():
    dispatch.register("silu_mul", "wrong")(lambda gate, up: gate * up)
    try:
        gate = normal(rng(4), (4, 32))
        result = fj.autotune("silu_mul", gate, gate, implementations=("xla", "wrong"),
                             iters=1, store=False)
    finally:
        dispatch.unregister("silu_mul", "wrong")
    (wrong,) = [c for c in result.candidates if c.implementation == "wrong"]
    assert wrong.seconds is None and "differs from XLA" in wrong.error
    assert result.implementation == "xla"


def test_unsupported_implementations_are_skipped_with_the_reason():
    with jax.enable_x64(True):
        x = jnp.asarray(rng(5).standard_normal((4, 16)))
        result = fj.autotune("rms_norm", x, jnp.ones(16, x.dtype),
                             implementations=("xla", INTERPRET), iters=1, store=False)
    assert "float64" in result.skipped[INTERPRET]
    assert result.implementation == "xla"


def test_bad_arguments():
    x, w = norm_inputs()
    with pytest.raises(ValueError, match="iters must be a positive int, got iters=0"):
        fj.autotune("rms_norm", x, w, iters=0)
    with pytest.raises(ValueError, match=r"implementations=\['nope'\] are not registered"):
        fj.autotune("rms_norm", x, w, implementations=("nope",))
    with pytest.raises(KeyError, match="unknown op 'rms_nrom'"):
        fj.autotune("rms_nrom", x, w)
    with pytest.raises(ValueError, match="weight"):
        fj.autotune("rms_norm", x, jnp.ones(3))
    with pytest.raises(ValueError, match="outside jax.jit"):
        jax.jit(lambda x: fj.autotune("rms_norm", x, w).seconds)(x)


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv(autotuning.CACHE_ENV, "off")
    assert autotuning.cache_path() is None
    x, w = norm_inputs(rows=6)
    assert not fj.autotune("rms_norm", x, w, iters=1).cached
    assert not fj.autotune("rms_norm", x, w, iters=1).cached  # nothing stored
    monkeypatch.delenv(autotuning.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert autotuning.cache_path() == tmp_path / "forge_jax" / "autotune.json"


def test_cli_tune_names_apply_to_the_ops_that_have_them(cache, capsys):
    import numpy as np

    from forge_jax import cli
    from forge_jax.generation import op_shapes as llama_ops
    from forge_jax.models import TINY_DIR, llama

    calls = len(llama_ops.op_calls(llama.load_config(TINY_DIR), batch=1, seq_len=4,
                                   dtype=np.float32, rng=np.random.default_rng(0)))
    argv = ["tune", "--iters", "1", "--seq-len", "4", "--implementations", "cudnn"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    # cuDNN serves attention on a GPU only; nothing here has it.
    assert out.count("not tuned: none of --implementations serves it on cpu") == calls, out
    argv = ["tune", "--iters", "1", "--seq-len", "4", "--implementations", "xla,cudnn"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.count("candidates timed]") == calls


@pytest.mark.parametrize("argv,words", [
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--iters", "0"], "--iters must be >= 1, got 0"),
    (["--implementations", "xla,pallsa"], "'pallsa' is not registered"),
    (["--checkpoint", "/nonexistent/dir"], "/nonexistent/dir"),
])
def test_cli_tune_bad_input(argv, words, capsys):
    from forge_jax import cli

    assert cli.main(["tune", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("forge-jax tune: error: ") and words in err, err


@pytest.mark.parametrize("op,make", [
    ("rope", lambda g: ((normal(g, (1, 6, 4, 32)),
                         jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (1, 6))), {})),
    ("attention", lambda g: ((normal(g, (1, 8, 4, 32)), normal(g, (1, 8, 2, 32)),
                              normal(g, (1, 8, 2, 32))), {})),
])
def test_kernel_configs_are_valid(op, make):
    """Every configuration the GPU kernels offer in the interpreter runs and passes the check
    against XLA (the compiled ones' validity is checked by lowering them in the kernel
    tests' style below)."""
    args, kwargs = make(rng(9))
    result = fj.autotune(op, *args, implementations=("xla", INTERPRET), iters=1, store=False,
                         **kwargs)
    ours = [c for c in result.candidates if c.implementation == INTERPRET]
    assert len(ours) == 2 and all(c.error is None for c in ours), ours


@pytest.mark.parametrize("op", ["rms_norm", "silu_mul", "rope", "attention"])
def test_gpu_configs_lower_for_cuda(op):
    """Each launch configuration autotuning would time on a GPU lowers for CUDA (Pallas ->
    Triton runs here; only PTX needs the device)."""
    from forge_jax import _compat

    S = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    shapes = {
        "rms_norm": (S((8, 576), bf16), S((576,), bf16)),
        "silu_mul": (S((8, 576), bf16), S((8, 576), bf16)),
        "rope": (S((1, 6, 4, 64), bf16), S((1, 6), jnp.int32)),
        "attention": (S((1, 16, 4, 64), bf16), S((1, 16, 2, 64), bf16), S((1, 16, 2, 64), bf16)),
    }[op]
    pallas = dispatch.implementations(op, "gpu")["pallas"]
    bound = dispatch.bind(op, *[jnp.zeros(s.shape, s.dtype) for s in shapes])
    static = {n: a for n, a in bound.items() if not isinstance(a, jax.Array)}
    names = [n for n, a in bound.items() if isinstance(a, jax.Array)]
    configs = pallas.candidate_configs(bound)[1:]  # past the defaults
    assert len(configs) >= 4
    for config in configs[:4] + configs[-2:]:
        def fn(*arrays, config=config):
            return pallas.fn(**dict(zip(names, arrays, strict=True)), **static, **config)

        _compat.export_for_cuda(fn, *shapes)


def test_an_unwritable_cache_is_not_fatal(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(autotuning.CACHE_ENV, str(blocker / "autotune.json"))
    x, w = norm_inputs(rows=7)
    with pytest.warns(RuntimeWarning, match="not written"):
        result = fj.autotune("rms_norm", x, w, iters=1)
    assert result.implementation == "xla" and not result.cached
    assert fj.explain("rms_norm", x, w).implementation == "xla"


def test_end_to_end_the_tiny_model_follows_what_tune_measured(cache, capsys):
    """forge-jax tune (every op call of the tiny model's generate, read back from the cache the
    second time) with only the interpreted GPU kernels as candidates; then a generate at those
    shapes runs them by auto selection, and agrees with XLA."""
    from forge_jax import cli
    from forge_jax.models import TINY_DIR, llama

    argv = ["tune", "--iters", "1", "--seq-len", "8", "--max-new-tokens", "4", "--dtype",
            "float32", "--implementations", INTERPRET]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "models/tiny: tuning 26 op calls of generate (batch 1, prefill 8 tokens and decode" \
        in out
    # The kernels the interpreter has: 2 norms, 2 ropes and silu_mul, each at the prefill's
    # and the decode's shapes; attention at the prefill's (the prompt over itself, and the
    # last layer's last token over the prompt) and paged attention at the decode's.
    assert out.count(f": {INTERPRET}") == 13 and f"cache: {cache}" in out
    entries = json.loads(cache.read_text())["entries"]
    assert len(entries) == 13 and {e["op"] for e in entries} == {
        "rms_norm", "silu_mul", "rope", "attention", "paged_attention"}
    # The decode step's fused norm: x [1, 1, hidden] with the residual.
    assert any(e["op"] == "rms_norm" and e["signature"].startswith("x=float32[1, 1, 128]")
               and "residual=float32[1, 1, 128]" in e["signature"] for e in entries)
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.count("[cached]") == 13
    model = llama.from_pretrained(TINY_DIR)
    prompt = [[3, 4, 5, 6, 7, 8, 9, 10]]
    dispatch.clear_selections()
    ids = llama.generate(model, prompt, 4)
    used = {op: s.implementation for op, s in dispatch.last_selections().items()}
    assert all(used[op] == INTERPRET
               for op in ("rms_norm", "silu_mul", "rope", "attention", "paged_attention")), used
    with fj.use_implementation("xla"):
        want = llama.generate(model, prompt, 4)
    np.testing.assert_array_equal(ids, want)
