"""What checking the weights for NaN and inf costs ``from_pretrained``, on CPU.

Loads the shipped tiny checkpoint and a random float32 checkpoint of ~190 MB written by
the script (and the same in bfloat16), alternating runs with the check and with it
replaced by a no-op; prints the best and median load time of each.

Usage::

    python benchmarks/load_cpu.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import ml_dtypes
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from forge_jax.models import TINY_DIR, llama  # noqa: E402
from forge_jax.models.checkpoints import hf as llama_checkpoint

SHAPE = dict(vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=3,
             num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True)


def write(directory: pathlib.Path, dtype) -> pathlib.Path:
    from safetensors.numpy import save_file

    directory.mkdir()
    config = dict(SHAPE, architectures=["LlamaForCausalLM"], model_type="llama",
                  hidden_act="silu", torch_dtype="float32")
    (directory / "config.json").write_text(json.dumps(config))
    c = llama.LlamaConfig.from_hf(config)
    gen = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
              "model.norm.weight": (c.hidden_size,)}
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (c.hidden_size,),
                       f"{p}.post_attention_layernorm.weight": (c.hidden_size,),
                       f"{p}.self_attn.q_proj.weight": (q, c.hidden_size),
                       f"{p}.self_attn.k_proj.weight": (kv, c.hidden_size),
                       f"{p}.self_attn.v_proj.weight": (kv, c.hidden_size),
                       f"{p}.self_attn.o_proj.weight": (c.hidden_size, q),
                       f"{p}.mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                       f"{p}.mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                       f"{p}.mlp.down_proj.weight": (c.hidden_size, c.intermediate_size)})
    save_file({k: (0.02 * gen.standard_normal(s, np.float32)).astype(dtype)
               for k, s in shapes.items()}, str(directory / "model.safetensors"))
    return directory


def timed_loads(path, rounds):
    check = llama_checkpoint._check_finite
    times = {"checked": [], "unchecked": []}
    for _ in range(rounds):
        for name in times:
            llama_checkpoint._check_finite = check if name == "checked" else (
                lambda *args: None)
            start = time.perf_counter()
            model = llama.from_pretrained(path)
            jax.block_until_ready(jax.tree.leaves(model))
            times[name].append(time.perf_counter() - start)
            del model
    llama_checkpoint._check_finite = check
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
          f"load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        cases = {"tiny (shipped)": TINY_DIR,
                 "random float32": write(pathlib.Path(tmp) / "f32", np.float32),
                 "random bfloat16": write(pathlib.Path(tmp) / "bf16", ml_dtypes.bfloat16)}
        print("checkpoint       |     MB | load, checked (best / median) | unchecked | cost")
        for name, path in cases.items():
            mb = (path / "model.safetensors").stat().st_size / 1e6
            times = timed_loads(path, args.rounds)
            best = {k: min(v) * 1e3 for k, v in times.items()}
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"{name:16s} | {mb:6.1f} | {best['checked']:8.1f} / {med['checked']:8.1f} ms "
                  f"| {best['unchecked']:8.1f} / {med['unchecked']:8.1f} ms "
                  f"| {best['checked'] - best['unchecked']:+6.1f} ms best, "
                  f"{med['checked'] - med['unchecked']:+6.1f} ms median")


if __name__ == "__main__":
    main()
