"""What the CPU benchmarks share: the model shapes they build (SmolLM2-135M's and a tiny
one for ``--quick`` smoke runs) and a Llama with random weights in a shape.

Imported by the scripts beside it (``python benchmarks/<name>.py`` puts this folder first
on ``sys.path``); importing it puts the repository root there too, so that the scripts run
from a checkout without an install.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from flax import nnx  # noqa: E402

from forge_jax.models import llama  # noqa: E402

# SmolLM2-135M's shape: 30 layers, hidden 576, 9 query / 3 KV heads (head_dim 64),
# intermediate 1536, vocab 49152, tied output head.
SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
            rope_theta=100000.0, tie_word_embeddings=True)
# A tiny Llama for ``--quick``: seconds, a smoke test of the script, not a figure.
QUICK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
             rope_theta=10000.0, tie_word_embeddings=True)

# The quantization benchmarks' tiny Llama for ``--quick``.
QUICK_QUANT = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def rounds_args(description: str, *, quick_rounds: int, rounds: int) -> argparse.Namespace:
    """The arguments of a benchmark with ``--quick`` (tiny shapes, a smoke run) and
    ``--rounds`` (default: ``quick_rounds`` or ``rounds``); prints the JAX version, the
    device and the load average first."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a smoke run")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    args.rounds = args.rounds or (quick_rounds if args.quick else rounds)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
          f"load average {os.getloadavg()[0]:.2f}")
    return args


def hf_config(shape: dict, **extra) -> dict:
    """A Hugging Face ``config.json`` of a Llama in ``shape`` (SiLU, RMS norm eps 1e-5),
    with ``extra`` keys."""
    return dict(shape, architectures=["LlamaForCausalLM"], model_type="llama",
                hidden_act="silu", rms_norm_eps=1e-5, **extra)


def random_llama(shape: dict, dtype=jnp.float32, **config) -> llama.Llama:
    """A Llama in ``shape`` with random weights (seed 0) in ``dtype``; ``config``: more keys
    of its ``config.json``."""
    return llama.Llama(llama.LlamaConfig.from_hf(hf_config(shape, **config)), rngs=nnx.Rngs(0),
                       dtype=dtype, param_dtype=dtype)
