"""GPU implementations; importing registers them.

* Pallas kernels (Triton lowering), one module per op, each registered at its bottom
  (``"pallas"`` on GPU once verified,
  ``"pallas_gpu_interpret"`` by name everywhere; see
  :mod:`forge_jax.pallas_kernels._registration`), each with its ``Config``, ``TUNED`` table
  and ``default_config``. ``_common.py``: what they share (dtypes, dot sizes, compute
  capability, device kinds and the table lookup).
* ``jax_triton_elementwise.py``: ``"triton"``, plain Triton kernels (``_jax_triton_src.py``)
  launched through jax-triton (not Pallas).
* Mosaic GPU kernels (Hopper; ``"mosaic_gpu"`` on GPU once verified,
  ``"mosaic_gpu_interpret"`` by name everywhere), ``mosaic_*.py``; ``_mosaic.py``: what they
  share (compute capability, the Mosaic GPU interpreter, shared-memory layouts, the online
  softmax); ``_mosaic_paged.py``: what the Hopper and Blackwell paged kernels share (launch
  parameters, splits, page copies); ``mosaic_paged_limits.py``: what the paged and ragged
  paged kernels fit in (shared memory, spill-free head dims); ``*_sm100.py``: the tcgen05
  (Blackwell) variants.
* ``quantized_matmul.py``: ``"pallas"`` (Triton lowering, Ampere and up): int8/int4 weights
  dequantized in registers, for decode's skinny products and prefill tiles.
* ``mosaic_quantized_matmul.py``: ``"mosaic_gpu"`` (Hopper), Mosaic GPU kernels (see
  ``_mosaic.py``): int8/fp8/int4 weights dequantized in registers feeding WGMMA.
* ``jax_nn_attention.py``: ``"cudnn"``, attention through ``jax.nn.dot_product_attention``
  (a library call, not a kernel of ours).
"""

from forge_jax.pallas_kernels.gpu import (  # noqa: F401  (importing registers the kernels)
    attention,
    gated_delta,
    grouped_matmul,
    jax_nn_attention,
    jax_triton_elementwise,
    mla_paged_attention,
    mosaic_attention,
    mosaic_paged_attention,
    mosaic_quantized_matmul,
    mosaic_ragged_paged_attention,
    paged_attention,
    quantized_matmul,
    rms_norm,
    rope,
    silu_mul,
)
