"""Hand-written Pallas kernels, registered with ``forge_jax.dispatch`` on import.

Layout: ``pallas_kernels/<backend>/<op>.py`` holds a ``_kernel(refs..., *, static
params)`` function and a jitted wrapper with keyword-only tuning knobs and
``interpret``; the module registers the wrapper as an implementation of the
public op (``dispatch.register(op, "pallas", priority={"gpu": 10}, supports=...)``).
``forge_jax.dispatch`` imports this package lazily on the first dispatch; the
public ops never import a kernel.

GPU (``gpu/``): Pallas kernels through the Triton lowering, plain Triton kernels launched
with ``jax-triton`` (the ``gpu`` extra, imported only at launch because it needs a GPU
jaxlib), cuDNN attention, and the per-device launch table. TPU (``tpu/``): Mosaic kernels,
ragged paged attention included.
"""

from forge_jax.pallas_kernels import gpu, tpu  # noqa: F401  (importing registers their kernels)
