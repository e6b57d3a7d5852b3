"""Pallas GPU kernels (Triton lowering), one module per op; importing registers them.

See ``_common.py`` for the registration contract (``"pallas"`` on GPU once verified,
``"pallas_gpu_interpret"`` by name everywhere).
"""

from forge_jax.pallas_kernels.gpu import (  # noqa: F401  (importing registers the kernels)
    attention,
    cudnn_attention,
    paged_attention,
    rms_norm,
    rope,
    silu_mul,
    triton_elementwise,
)
