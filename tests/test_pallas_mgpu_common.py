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
        assert _mosaic.mosaic_reason("gpu") is None and _mosaic.wgmma_reason() is None
        assert _mosaic.mma_kind() == "wgmma"
    with fj.targets.use("b200"):  # Mosaic GPU runs; WGMMA does not (the b200 compile below)
        assert _mosaic.mosaic_reason("gpu") is None and _mosaic.mma_kind() == "tcgen05"
        assert "Hopper's WGMMA (compute capability 9.x" in _mosaic.wgmma_reason()
        assert "10.0" in _mosaic.wgmma_reason()
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
args = (S((2, 3, 8, 64), jnp.bfloat16), pool, pool, S((2, 4), jnp.int32), S((2,), jnp.int32))
print("compiled:", fj.aot.compile(lambda *a: paged.paged_attention(*a, mma="wgmma"), *args,
                                  target="b200").compiled)
"""


@pytest.mark.target("b200")
def test_blackwell_refuses_hopper_wgmma_and_dispatch_says_so():
    """WGMMA does not lower for sm_100a (the paged kernel's several-positions path here; its
    int8/fp8 pages and the ragged kernel, and the quantized matmul's int4 and 128 x 128 fp8
    kernels, are WGMMA code too, BENCHMARKS.md), so on a compute capability 10.x device
    those cases of the "mosaic_gpu" records are refused with that reason. Paged decode,
    flash attention and the int8/fp8 per-channel matmul are served there by their tcgen05
    kernels (tests/test_pallas_mgpu_*_sm100.py)."""
    done = subprocess.run([sys.executable, "-c", _B200_COMPILE], capture_output=True,
                          text=True, timeout=600)
    err = done.stderr
    if done.returncode == 0:
        # JAX 0.10: "'nvvm.wgmma.fence.aligned' op is not supported on sm_100a"; JAX 0.12:
        # ptxas, "Instruction 'wgmma.wait_group' not supported on .target 'sm_100a'".
        assert "compiled: False" in done.stdout, err[-2000:]
        assert "wgmma" in err and "not supported on" in err and "sm_100a" in err, err[-2000:]
    else:  # or LLVM's NVPTX backend aborts, the process with it
        assert "Cannot select: intrinsic %llvm.nvvm.wgmma" in err, err[-2000:]
    S = jax.ShapeDtypeStruct
    pool = S((2, 8, 16, 64), jnp.bfloat16)
    tables, lengths = S((2, 4), jnp.int32), S((2,), jnp.int32)
    q = S((1, 16, 8, 64), jnp.bfloat16)
    with fj.targets.use("b200"):
        for name, op_args in (
                ("chunk", (S((2, 3, 8, 64), jnp.bfloat16), pool, pool, tables, lengths)),
                ("ragged", (S((6, 8, 64), jnp.bfloat16), pool, pool, tables, lengths,
                            S((3,), jnp.int32), S((), jnp.int32)))):
            op = "ragged_paged_attention" if name == "ragged" else "paged_attention"
            rejected = fj.explain(op, *op_args).rejected
            assert "sm_100a" in rejected["mosaic_gpu"], (name, rejected)
        decode = (S((2, 8, 64), jnp.bfloat16), pool, pool, tables, lengths)
        for op, op_args in (("paged_attention", decode), ("attention", (q, q, q))):
            assert "could not serve" not in fj.explain(op, *op_args).rejected["mosaic_gpu"]
