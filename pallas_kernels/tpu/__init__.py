"""Pallas TPU kernels (Mosaic), one module per op; importing registers them.

Each registers (at the bottom of its module) as ``"pallas"`` on TPU (by name until its
``VERIFIED`` record names a TPU) and ``"pallas_tpu_interpret"`` by name everywhere (see
:mod:`forge_jax.pallas_kernels._registration`), with its launch knobs: its ``Config``,
``TUNED`` table (:func:`_common.per_generation`) and ``default_config``. ``_common.py``:
what they share (dtypes, lanes, sublane tiles, TPU generations and their scoped VMEM, the
table lookup).
"""

from forge_jax.pallas_kernels.tpu import (  # noqa: F401  (importing registers the kernels)
    attention,
    gated_delta,
    grouped_matmul,
    mla_paged_attention,
    paged_attention,
    quantized_matmul,
    ragged_paged_attention,
    rms_norm,
    rope,
    silu_mul,
)
