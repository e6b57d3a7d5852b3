"""Flax NNX models composed only of forge_jax ops (installed as ``forge_jax.models``)."""

import pathlib

# The tiny Llama shipped in the package (Hugging Face layout: config.json, safetensors,
# tokenizer.json), the default checkpoint of ``forge-jax generate``.
TINY_DIR = pathlib.Path(__file__).resolve().parent / "tiny"
