"""The Mosaic GPU kernels' shared pieces (``pallas_kernels/gpu/_mosaic.py``): where they can
run (compute capability 9.0+, the named targets answering as their devices) and the
interpreter they are checked in on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax as fj
from forge_jax.pallas_kernels import _registration
from forge_jax.pallas_kernels.gpu import _mosaic


def test_reason_follows_the_compute_capability():
    assert _mosaic.mosaic_reason("tpu") == "a GPU kernel, not for tpu"
    with fj.targets.use("h100"):
        assert _mosaic.mosaic_reason("gpu") is None
    with fj.targets.use("b200"):
        assert _mosaic.mosaic_reason("gpu") is None
    with fj.targets.use("a100"):
        assert "compute capability >= 9.0" in _mosaic.mosaic_reason("gpu")
        assert "8.0" in _mosaic.mosaic_reason("gpu")


def test_backend_record_names():
    spec = _registration._backend("mosaic_gpu")
    assert (spec.name, spec.interpret_name, spec.platform) == (
        "mosaic_gpu", "mosaic_gpu_interpret", "gpu")
    assert spec.priority > _registration.PRIORITY
    with pytest.raises(ValueError, match="backend='cuda'"):
        _registration._backend("cuda")


def test_interpreter_runs_a_kernel_on_this_machine():
    # The interpreter CI checks every Mosaic GPU kernel in: a kernel body run through it
    # on CPU, against numpy.
    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 128)), jnp.float32)
    with _mosaic.maybe_interpret(True):
        y = _mosaic.kernel(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) * 2.0 + 1.0, rtol=0, atol=0)
    params = _mosaic.interpret_params()
    assert getattr(params, "detect_races", True) is True
