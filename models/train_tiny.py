"""Moved to :mod:`forge_jax.models.tiny.train`; this path warns and is removed in the next
release (``python -m forge_jax.models.tiny.train``)."""

from forge_jax._moved import forward

__getattr__ = forward(__name__, "forge_jax.models.tiny.train")

if __name__ == "__main__":
    import runpy
    import warnings

    warnings.warn("python -m forge_jax.models.train_tiny has moved to python -m "
                  "forge_jax.models.tiny.train (this path is removed in the next release)",
                  DeprecationWarning, stacklevel=1)
    runpy.run_module("forge_jax.models.tiny.train", run_name="__main__", alter_sys=True)
