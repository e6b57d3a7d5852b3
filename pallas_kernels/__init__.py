"""Hand-written Pallas kernels, registered with ``forge_jax.dispatch`` on import.

Layout: ``pallas_kernels/<backend>/<op>.py`` holds a ``_kernel(refs..., *, static
params)`` function and a jitted wrapper with keyword-only tuning knobs and
``interpret``; the module registers the wrapper as an implementation of the
public op (``dispatch.register(op, "pallas", priority={"gpu": 10}, supports=...)``).
``forge_jax.dispatch`` imports this package lazily on the first dispatch; the
public ops never import a kernel.

GPU kernels (``gpu/``, Triton lowering, and ``jax-triton`` from the ``gpu`` extra,
imported lazily because it needs a GPU jaxlib) and TPU kernels (``tpu/``, Mosaic,
ragged paged attention) arrive in their own issues.
"""

from forge_jax.pallas_kernels import gpu, tpu  # noqa: F401  (importing registers their kernels)
