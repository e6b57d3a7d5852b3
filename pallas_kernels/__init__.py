"""Hand-written kernels, registered with the forge_jax registry on import.

Layout: ``pallas_kernels/<backend>/<op>.py`` holds one kernel: a ``_kernel(refs..., *,
static params)`` function, a jitted wrapper with keyword-only launch knobs and
``interpret``, the kernel's ``supports``, its launch knobs (a frozen ``Config``, the
per-device table ``TUNED`` and ``default_config(args, device_kind)``), where it was
``VERIFIED``, and, at the bottom, its registration. Its docstring names the public op and
the XLA reference it is tested against, and its test file. ``forge_jax.registry`` imports
this package lazily on the first dispatch; the public ops never import a kernel.

* ``_registration.py``: ``register(op, kernel, *, backend=...)``, the one way a Pallas kernel
  joins the registry (``"pallas"`` on its backend, by name until verified there;
  ``"pallas_<backend>_interpret"`` by name everywhere).
* ``_vjp.py``: ``with_reference_vjp``, every kernel's backward pass (the XLA reference's VJP).
* ``_attention_common.py``: the XLA-side bookkeeping the GPU and TPU attention kernels share.
* ``gpu/``: Pallas kernels through the Triton lowering; ``jax_triton_elementwise.py``, plain
  Triton kernels launched with ``jax-triton`` (the ``gpu`` extra, imported only at launch
  because it needs a GPU jaxlib); ``jax_nn_attention.py``, cuDNN attention through
  ``jax.nn.dot_product_attention``. ``gpu/_common.py``: GPU facts (dtypes, dot sizes,
  compute capability, device kinds) and table lookups.
* ``tpu/``: Mosaic kernels, ragged paged attention included; ``tpu/_common.py``: TPU facts
  (dtypes, lanes, sublane tiles, generations and their scoped VMEM) and table lookups.
"""

from forge_jax.pallas_kernels import gpu, tpu  # noqa: F401  (importing registers their kernels)
