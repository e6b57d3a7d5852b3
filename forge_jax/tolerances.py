"""The tolerance and determinism policy: how far each implementation may stray.

Tolerances bound the error of an op's output against a float64 reference computed
from the same (already rounded) inputs, as ``|out - ref| <= atol + rtol * |ref|``.
They are set per output dtype and per implementation family:

* ``"xla"``: the reference implementations. Math runs in float32, so the error is
  that of float32 accumulation plus one final rounding to the output dtype.
* ``"kernel"``: Pallas / Triton kernels. They may tile reductions and use online
  softmax (a different summation order) and hardware exp approximations, so they
  get twice the float32 budget; the output rounding is the same.

Determinism:

* CPU, XLA: bitwise reproducible run to run for the same shapes, dtypes, jaxlib
  and ``XLA_FLAGS``. Results may differ in the last bits between ``jit`` and eager
  execution, and between shapes (XLA fuses and vectorises differently), so tests
  compare such variants with the float32 tolerance, not bitwise.
* GPU: XLA's GPU reductions and cuBLAS/cuDNN algorithm choice (autotuning) may
  reorder float32 sums between runs or processes; set
  ``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` for run-to-run equality. Pallas
  kernels with a fixed grid and no atomics are deterministic per shape.
* TPU: deterministic for a given program.

Precision: GPUs run float32 dots as TF32 and TPUs as bfloat16 passes by default, which
would miss the float32 tolerance above; forge_jax's XLA ``matmul`` and ``attention``
ask for ``Precision.HIGHEST`` on float32 operands (no cost on CPU). bfloat16 and
float16 operands keep their native speed: their products are exact in float32 and
accumulate in float32.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def as_kwargs(self) -> dict[str, float]:
        return {"atol": self.atol, "rtol": self.rtol}


# Output dtype -> tolerance of the XLA implementations. bfloat16 keeps 8 bits of
# mantissa (relative spacing 2**-8 = 0.0039), float16 11 bits (2**-11 = 0.00049):
# one rounding of the result costs half of that, and inputs of order 1-10 that
# pass through float32 math add a little more.
_XLA = {
    jnp.dtype(jnp.float32): Tolerance(atol=2e-5, rtol=2e-5),
    jnp.dtype(jnp.float16): Tolerance(atol=2e-3, rtol=2e-3),
    jnp.dtype(jnp.bfloat16): Tolerance(atol=1.6e-2, rtol=1.6e-2),
    jnp.dtype(jnp.float64): Tolerance(atol=1e-10, rtol=1e-10),
}
_KERNEL_FLOAT32 = Tolerance(atol=5e-5, rtol=5e-5)


def tolerance(dtype, implementation: str = "xla") -> Tolerance:
    """The tolerance for an output of ``dtype`` computed by ``implementation``.

    Args:
      dtype: the op's output dtype.
      implementation: ``"xla"`` or the name of a kernel implementation (anything
        else than ``"xla"`` gets the kernel budget).
    """
    dtype = jnp.dtype(dtype)
    if dtype not in _XLA:
        raise ValueError(f"no tolerance defined for {dtype=}")
    if implementation == "xla" or dtype != jnp.dtype(jnp.float32):
        return _XLA[dtype]
    return _KERNEL_FLOAT32


def scaled(tol: Tolerance, factor: float) -> Tolerance:
    """``tol`` widened by ``factor``, for quantities with a known error growth
    (e.g. a gradient through a reduction over ``n`` terms, or a whole model)."""
    return Tolerance(atol=tol.atol * factor, rtol=tol.rtol * factor)
