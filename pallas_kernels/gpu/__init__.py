"""GPU implementations; importing registers them.

* Pallas kernels (Triton lowering), one module per op; ``_common.py`` holds the registration
  contract (``"pallas"`` on GPU once verified, ``"pallas_gpu_interpret"`` by name everywhere)
  and the per-device launch table ``TUNING``.
* ``triton_elementwise.py``: ``"triton"``, plain Triton kernels (``_triton_src.py``)
  launched through jax-triton.
* ``cudnn_attention.py``: ``"cudnn"``, attention through ``jax.nn.dot_product_attention``.
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
