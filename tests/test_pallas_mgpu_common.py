"""The Mosaic GPU kernels' shared pieces (``pallas_kernels/gpu/_mosaic.py``): where they can
run (compute capability 9.x, the named targets answering as their devices) and the
interpreter they are checked in on CPU."""

import subprocess
import sys

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
    with fj.targets.use("b200"):  # WGMMA: sm_90a only (the b200 compile below)
        assert "Hopper's WGMMA (compute capability 9.x" in _mosaic.mosaic_reason("gpu")
        assert "10.0" in _mosaic.mosaic_reason("gpu")
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


# The compile runs in a process of its own: the first Mosaic GPU compile of a process fixes
# the architecture ptxas is run for (BENCHMARKS.md), so a b200 compile here would break the
# h100 compiles of any test file after it in the same process.
_B200_COMPILE = """
import jax, jax.numpy as jnp
import forge_jax as fj
from forge_jax.pallas_kernels.gpu import mosaic_paged_attention as paged
S = jax.ShapeDtypeStruct
pool = S((2, 8, 16, 64), jnp.bfloat16)
args = (S((2, 8, 64), jnp.bfloat16), pool, pool, S((2, 4), jnp.int32), S((2,), jnp.int32))
print("compiled:", fj.aot.compile(paged.paged_attention, *args, target="b200").compiled)
"""


@pytest.mark.skipif(fj.targets.missing("b200") is not None,
                    reason=str(fj.targets.missing("b200")))
def test_blackwell_refuses_hopper_wgmma_and_dispatch_says_so():
    """The Mosaic GPU kernels' WGMMA does not lower for sm_100a (the paged kernel here; the
    flash attention and quantized matmul kernels fail the same way, BENCHMARKS.md), so on a
    compute capability 10.x device every "mosaic_gpu" record refuses with that reason."""
    done = subprocess.run([sys.executable, "-c", _B200_COMPILE], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "compiled: False" in done.stdout, done.stderr[-2000:]
    # JAX 0.10: "'nvvm.wgmma.fence.aligned' op is not supported on sm_100a"; JAX 0.12, from
    # ptxas: "Instruction 'wgmma.wait_group' not supported on .target 'sm_100a'".
    err = done.stderr
    assert "wgmma" in err and "not supported on" in err and "sm_100a" in err, err[-2000:]
    S = jax.ShapeDtypeStruct
    pool = S((2, 8, 16, 64), jnp.bfloat16)
    args = (S((2, 8, 64), jnp.bfloat16), pool, pool, S((2, 4), jnp.int32), S((2,), jnp.int32))
    q = S((1, 16, 8, 64), jnp.bfloat16)
    with fj.targets.use("b200"):
        for op, op_args in (("paged_attention", args), ("attention", (q, q, q))):
            rejected = fj.explain(op, *op_args).rejected
            assert "Hopper's WGMMA" in rejected["mosaic_gpu"], (op, rejected)
