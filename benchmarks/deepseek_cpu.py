"""DeepSeek-V3 on the CPU: what multi-head latent attention's cache costs per token against
the same model's expanded K/V, and decode ms/token of a DeepSeek-V3-shaped model against
transformers eager in one run.

1. Cache bytes per token, DeepSeek-V3's own shape (61 layers, 128 heads, latent 512 + RoPE
   64, qk 192 / v 128), bfloat16: the exact arithmetic
   (:func:`forge_jax.kv_cache.latent.bytes_per_token`) and a latent page pool of that shape
   measured (``PagedLatentCache.nbytes`` over the tokens it holds).
2. The benchmark model (random weights, DeepSeek-V3's attention widths, fewer layers,
   heads and experts): its latent cache as ``generate`` creates it, measured, against its
   expanded K/V (arithmetic) and transformers' own cache for the same tokens, measured
   (transformers 5 keeps the latent too).
3. Decode, batch 1, greedy: forge_jax's :func:`forge_jax.generation.generate` with the paged
   and the contiguous latent cache, and transformers eager (a loop of single-token forwards
   with its cache), interleaved round by round; best and median ms/token.

    python benchmarks/deepseek_cpu.py            # the figures (a few minutes)
    python benchmarks/deepseek_cpu.py --quick    # tiny shapes, a smoke run
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from decode_cpu import cpu_model, hf_ms  # noqa: E402

from forge_jax import generation  # noqa: E402
from forge_jax.kv_cache import CacheSpec, PagedLatentCache  # noqa: E402
from forge_jax.kv_cache.latent import bytes_per_token  # noqa: E402
from forge_jax.models import llama  # noqa: E402

# DeepSeek-V3's attention widths (latent 512 + RoPE 64, nope 128, v 128, query bottleneck
# 1536 scaled to the hidden size), 16 heads, 4 layers (the first dense), 16 experts of 256,
# 4 per token in 2 of 4 groups, one shared expert.
FULL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256,
            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
            q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
            n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
            max_position_embeddings=4096)
QUICK = dict(FULL, vocab_size=256, hidden_size=64, intermediate_size=128,
             moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8)
V3 = dict(num_layers=61, kv_lora_rank=512, rope_dim=64, heads=128, qk_head_dim=192, v_dim=128)


def v3_bytes() -> None:
    exact = bytes_per_token(**V3, dtype=jnp.bfloat16)
    pages, page = 4, 64
    pool = PagedLatentCache.create(num_layers=V3["num_layers"], num_pages=pages,
                                   page_size=page, kv_lora_rank=512, rope_dim=64,
                                   dtype=jnp.bfloat16, block_tables=np.zeros((1, pages), np.int32),
                                   width=576)
    measured = pool.nbytes / (pages * page)
    print(f"DeepSeek-V3 shape, bfloat16, bytes per token: latent {exact['latent']:,} "
          f"(measured pool: {measured:,.0f}), expanded K/V {exact['expanded']:,} "
          f"(arithmetic): {exact['expanded'] / exact['latent']:.1f}x")


def save_checkpoint(shape: dict, directory: pathlib.Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**shape, bos_token_id=None, eos_token_id=None,
                                           pad_token_id=None)
    transformers.DeepseekV3ForCausalLM(config).eval().save_pretrained(directory)


def ours_ms(model, prompt, new_tokens, kind) -> tuple[float, int]:
    _, stats = generation.generate_with_stats(model, [prompt], new_tokens, eos_token_id=(),
                                              cache=CacheSpec(kind))
    return stats.decode_ms_per_step, stats.cache_bytes // stats.cache_len


def hf_cache_bytes_per_token(hf_model, prompt) -> float:
    import torch

    with torch.inference_mode():
        past = hf_model(input_ids=torch.tensor([prompt]), use_cache=True).past_key_values
    tensors = [t for layer in past.layers for t in (layer.keys, layer.values)]
    return sum(t.numel() * t.element_size() for t in tensors) / len(prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (3)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens (64)")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    new_tokens = args.new_tokens or (8 if args.quick else 64)
    shape = QUICK if args.quick else FULL

    import torch
    import transformers

    print(f"jax {jax.__version__}, {cpu_model()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"load average {os.getloadavg()[0]:.2f}")
    v3_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(shape, pathlib.Path(tmp))
        model = llama.from_pretrained(tmp, dtype="float32")  # a DeepseekV3
        hf_model = transformers.DeepseekV3ForCausalLM.from_pretrained(
            tmp, dtype=torch.float32).eval()
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, shape["vocab_size"], 32)]
    print(f"benchmark model: {shape}; batch 1, prompt 32, {new_tokens} new tokens, greedy, "
          f"{rounds} round(s), float32")

    # Warm-up: compile and run each path once.
    _, paged_bytes = ours_ms(model, prompt, new_tokens, "paged")
    _, contiguous_bytes = ours_ms(model, prompt, new_tokens, "contiguous")
    hf_ms(hf_model, prompt, min(new_tokens, 8), torch.get_num_threads())
    hf_bytes = hf_cache_bytes_per_token(hf_model, prompt)
    c = model.config
    exact = bytes_per_token(num_layers=c.num_hidden_layers, kv_lora_rank=c.kv_lora_rank,
                            rope_dim=c.qk_rope_head_dim, heads=c.num_attention_heads,
                            qk_head_dim=c.qk_head_dim, v_dim=c.v_head_dim, dtype=jnp.float32)
    latent = exact["latent"]
    print(f"cache bytes per token slot: latent {latent:,} and expanded K/V "
          f"{exact['expanded']:,} by arithmetic; measured: paged pool "
          f"{paged_bytes:,}, contiguous {contiguous_bytes:,}; transformers' own cache (which "
          f"also stores the latent and the RoPE key) "
          f"{hf_bytes:,.0f} ({hf_bytes / latent:.1f}x)")

    samples: dict[str, list[float]] = {"paged": [], "contiguous": [], "hf": []}
    threads = sorted({torch.get_num_threads(), 1}, reverse=True)
    for _ in range(rounds):
        samples["paged"].append(ours_ms(model, prompt, new_tokens, "paged")[0])
        samples["contiguous"].append(ours_ms(model, prompt, new_tokens, "contiguous")[0])
        samples["hf"].append(min(hf_ms(hf_model, prompt, new_tokens, t) for t in threads))
    best = {k: min(v) for k, v in samples.items()}
    print("\n| decode | best ms/token | median | vs transformers |")
    print("|---|---|---|---|")
    for key, label in (("paged", "forge_jax, paged latent cache"),
                       ("contiguous", "forge_jax, contiguous latent cache"),
                       ("hf", "transformers eager")):
        print(f"| {label} | {best[key]:.2f} | {statistics.median(samples[key]):.2f} | "
              f"{best['hf'] / best[key]:.2f}x |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
