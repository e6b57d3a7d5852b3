"""The tiny Llama shipped in the package (``TINY_DIR``: config, safetensors, tokenizer),
the addition task it was trained on (:mod:`~forge_jax.models.tiny.task`) and the script that
trains it (:mod:`~forge_jax.models.tiny.train`, ``python -m forge_jax.models.tiny.train``)."""
