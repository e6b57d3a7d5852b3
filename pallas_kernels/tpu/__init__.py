"""Pallas TPU kernels (Mosaic), one module per op; importing registers them.

See ``_common.py`` for the registration contract (``"pallas"`` on TPU,
``"pallas_tpu_interpret"`` by name everywhere).
"""

from forge_jax.pallas_kernels.tpu import (  # noqa: F401  (importing registers the kernels)
    attention,
    paged_attention,
    ragged_paged_attention,
    rms_norm,
    rope,
    silu_mul,
)
