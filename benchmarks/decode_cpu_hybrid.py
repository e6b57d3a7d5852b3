"""Steady-state batch-1 decode on CPU of a Qwen3-Next-shaped hybrid model (gated delta-rule
layers and gated full attention, a mixture of experts with a shared expert): forge_jax
against Hugging Face transformers, in one run.

Builds the model with random weights, saves it once with transformers' ``save_pretrained``
(float32 safetensors), loads it into both, and measures decode ms/token, greedy, batch 1,
after a prompt of ``--prompt-len`` tokens:

* forge_jax: :meth:`Qwen3Next.forward_cached` jitted as one decode step (the cache
  donated), over a :class:`~forge_jax.kv_cache.HybridCache` of a paged or a contiguous
  attention cache and the delta rule's state pool; compilation excluded;
* transformers: eager single-token forwards with its cache (``torch.inference_mode``),
  timing the decode steps only, the faster of torch's default thread count and one.

The contenders alternate over ``--rounds`` rounds and each keeps its best round, so that a
burst of load from other processes hurts one sample, not one contender.

Usage::

    python benchmarks/decode_cpu_hybrid.py            # the Qwen3-Next shape (minutes)
    python benchmarks/decode_cpu_hybrid.py --quick    # tiny shape, seconds: a smoke test
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from flax import nnx  # noqa: E402

from forge_jax.kv_cache import ContiguousKVCache, PagedKVCache  # noqa: E402
from forge_jax.models import qwen3_next_checkpoint  # noqa: E402

# Qwen3-Next's proportions (three delta-rule layers to one gated attention layer, partial
# rotary, 2 KV heads, value heads twice the key heads, sparse experts with a shared one),
# scaled to a ~100M-parameter model.
FULL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=8, num_key_value_heads=2, head_dim=128,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
            linear_value_head_dim=128, num_experts=16, num_experts_per_tok=4,
            moe_intermediate_size=256, shared_expert_intermediate_size=256)
QUICK = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=32)


def ours_decoder(model, prompt: list[int], max_len: int, kind: str, page_size: int = 16):
    """``run(new_tokens) -> ms/token``: a fresh cache, the prompt prefilled, then
    ``new_tokens`` greedy decode steps, the decode steps alone timed."""
    graphdef, state = nnx.split(model)
    c = model.config
    geometry = dict(num_layers=model.num_attention_layers, kv_heads=model.kv_heads,
                    head_dim=c.head_dim, dtype=model.dtype)

    def fresh():
        if kind == "contiguous":
            att = ContiguousKVCache.create(batch=1, max_len=max_len, **geometry)
        else:
            pages = -(-max_len // page_size)
            att = PagedKVCache.create(num_pages=pages, page_size=page_size,
                                      block_tables=np.arange(pages)[None], **geometry)
        return model.hybrid_cache(att)

    @jax.jit
    def prefill(state, tokens, cache):
        n = tokens.shape[1]
        positions = jnp.arange(n, dtype=jnp.int32)[None]
        logits, cache = nnx.merge(graphdef, state).forward_cached(
            tokens, positions, jnp.ones((1, n), bool), cache, logits_at=jnp.array([n - 1]),
            empty_cache=True)
        return jnp.argmax(logits, -1).astype(jnp.int32), cache

    @functools.partial(jax.jit, donate_argnums=(2,))
    def decode(state, token, cache):
        logits, cache = nnx.merge(graphdef, state).forward_cached(
            token[:, None], cache.lengths[:, None], jnp.ones((1, 1), bool), cache,
            logits_at=jnp.zeros((1,), jnp.int32))
        return jnp.argmax(logits, -1).astype(jnp.int32), cache

    tokens = jnp.asarray([prompt], jnp.int32)

    def run(new_tokens: int) -> float:
        token, cache = prefill(state, tokens, fresh())
        token.block_until_ready()
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            token, cache = decode(state, token, cache)
        token.block_until_ready()
        return 1e3 * (time.perf_counter() - start) / (new_tokens - 1)

    return run


def hf_ms(hf_model, prompt, new_tokens, threads) -> float:
    """Eager transformers decode ms/token (the decode steps only)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            out = hf_model(input_ids=torch.tensor([prompt]), use_cache=True)
            past = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(new_tokens - 1):
                out = hf_model(input_ids=token, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            token.item()
            return 1e3 * (time.perf_counter() - start) / (new_tokens - 1)
    finally:
        torch.set_num_threads(old)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape, a smoke test")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (3)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (32)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens (64)")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    rounds = args.rounds or (1 if args.quick else 3)
    prompt_len = args.prompt_len or (8 if args.quick else 32)
    new_tokens = args.new_tokens or (8 if args.quick else 64)

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    print(f"# decode_cpu_hybrid{' --quick' if args.quick else ''} | jax {jax.__version__} "
          f"({jax.devices()[0].device_kind}) | torch {torch.__version__}, transformers "
          f"{transformers.__version__} | {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"# qwen3_next, shape {shape}; float32, batch 1, prompt {prompt_len}, {new_tokens} "
          f"new tokens, greedy, {rounds} round(s)")
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(**shape, max_position_embeddings=2048,
                                          bos_token_id=None, eos_token_id=None)
    with tempfile.TemporaryDirectory() as tmp:
        transformers.Qwen3NextForCausalLM(config).eval().save_pretrained(tmp)
        model = qwen3_next_checkpoint.from_pretrained(tmp, dtype=jnp.float32)
        hf_model = transformers.Qwen3NextForCausalLM.from_pretrained(
            tmp, dtype=torch.float32).eval()
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, shape["vocab_size"],
                                                                prompt_len)]
    max_len = prompt_len + new_tokens
    ours = {kind: ours_decoder(model, prompt, max_len, kind) for kind in ("paged", "contiguous")}
    for run in ours.values():  # compile, and first executions
        run(min(new_tokens, 4))
    hf_ms(hf_model, prompt, min(new_tokens, 4), torch.get_num_threads())
    threads = sorted({torch.get_num_threads(), 1}, reverse=True)
    samples: dict[str, list[float]] = {"paged": [], "contiguous": [], "hf": []}
    for _ in range(rounds):
        for kind, run in ours.items():
            samples[kind].append(run(new_tokens))
        samples["hf"].append(min(hf_ms(hf_model, prompt, new_tokens, t) for t in threads))
    best = {k: min(v) for k, v in samples.items()}
    for key, label in (("paged", "forge_jax, paged attention cache"),
                       ("contiguous", "forge_jax, contiguous attention cache"),
                       ("hf", "HF transformers eager")):
        print(f"| {label:<38} | {best[key]:8.2f} ms/token | samples "
              + " ".join(f"{s:.2f}" for s in samples[key]) + " |")
    print(f"forge_jax paged: {best['hf'] / best['paged']:.2f}x transformers' speed; "
          f"contiguous {best['hf'] / best['contiguous']:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
