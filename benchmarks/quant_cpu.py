"""Quantized weights on CPU: fj.matmul with a quantized weight against float32, and decode
ms/token of a SmolLM2-135M-shaped Llama (random weights) per --quantize format.

    python benchmarks/quant_cpu.py           # the figures in BENCHMARKS.md
    python benchmarks/quant_cpu.py --quick   # a smoke run (tiny shapes)

Products: ``x [M, K] @ W.T`` for a ``[N, K]`` weight, best of ``--rounds`` jitted calls:
float32; each format through ``fj.matmul`` (dequantized 128 output rows at a time); and,
for comparison, the int8 weight converted whole before the product, and XLA's int8 x int8
product (which needs int8 activations, a different computation).
"""

from __future__ import annotations

import json
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from _cpu import QUICK_QUANT, rounds_args
from flax import nnx
from safetensors.numpy import save_file

import forge_jax as fj
from forge_jax.models import llama
from forge_jax.models.checkpoints import quantize as quantize_load

FORMATS = {"int8": {}, "int4 g32": {"group_size": 32}, "int4 g64": {"group_size": 64},
           "fp8": {}}


def best_ms(fn, *args, rounds):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def products(n, k, ms, rounds):
    gen = np.random.default_rng(0)
    w = jnp.asarray(gen.standard_normal((n, k)), jnp.float32)
    dims = (((1,), (1,)), ((), ()))
    print(f"\nproducts x [M, {k}] @ W.T, W [{n}, {k}] (best of {rounds}, ms)")
    print("M    | float32 | " + " | ".join(f"{f:>9s}" for f in FORMATS)
          + " | int8 whole | int8 x int8")
    for m in ms:
        x = jnp.asarray(gen.standard_normal((m, k)), jnp.float32)
        row = [best_ms(jax.jit(lambda x, w: fj.matmul(x, w, trans_b=True)), x, w, rounds=rounds)]
        for name, kw in FORMATS.items():
            q = fj.quantize(w, name.split()[0], **kw)
            row.append(best_ms(jax.jit(lambda x, q: fj.matmul(x, q, trans_b=True)), x, q,
                               rounds=rounds))
        q8 = fj.quantize(w, "int8")
        whole = jax.jit(lambda x, v, s: jax.lax.dot_general(
            x, v.astype(jnp.float32), dims) * s[:, 0])
        row.append(best_ms(whole, x, q8.values, q8.scales, rounds=rounds))
        ints = jax.jit(lambda x, v: jax.lax.dot_general(
            jnp.round(x * 20).astype(jnp.int8), v, dims, preferred_element_type=jnp.int32))
        row.append(best_ms(ints, x, q8.values, rounds=rounds))
        print(f"{m:4d} | {row[0]:7.2f} | " + " | ".join(f"{r:9.2f}" for r in row[1:-2])
              + f" | {row[-2]:10.2f} | {row[-1]:11.2f}")


def write_model(directory: pathlib.Path, config: dict) -> pathlib.Path:
    model = llama.Llama(llama.LlamaConfig(**config), rngs=nnx.Rngs(0))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(
        dict(config, model_type="llama", architectures=["LlamaForCausalLM"])))
    save_file(llama.hf_state_dict(model), str(directory / "model.safetensors"))
    return directory


def decode(config, new_tokens, rounds):
    print(f"\ndecode, batch 1, 16-token prompt, {new_tokens} new tokens, paged cache "
          f"(best of {rounds} runs)")
    print("weights    | parameter MB | decode ms/token")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(pathlib.Path(tmp), config)
        prompt = [[(7 * i) % config["vocab_size"] for i in range(16)]]
        for name in ["float32", *FORMATS]:
            kw = {} if name == "float32" else {"quantize": name.split()[0],
                                               **FORMATS[name]}
            model = llama.from_pretrained(path, dtype=jnp.float32, **kw)
            steps = []
            for _ in range(rounds):
                _, stats = llama.generate_with_stats(model, prompt, new_tokens,
                                                     eos_token_id=(), warm_up=True)
                steps.append(stats.decode_ms_per_step)
            print(f"{name:10s} | {quantize_load.parameter_bytes(model) / 1e6:12.1f} | "
                  f"{min(steps):15.2f}")


def main():
    args = rounds_args(__doc__.split("\n")[0], quick_rounds=2, rounds=10)
    rounds = args.rounds
    if args.quick:
        products(256, 256, (1,), rounds)
        decode(QUICK_QUANT, 4, 1)
        return
    products(4096, 2048, (1, 16), rounds)
    config = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                  tie_word_embeddings=True, max_position_embeddings=2048)
    decode(config, 32, 3)


if __name__ == "__main__":
    main()
