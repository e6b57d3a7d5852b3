"""Steady-state batch-1 decode on CPU: forge_jax's model vs the memory-bandwidth limit and HF.

Builds a Llama-shaped model (or, with ``--family``, the same shape as another family)
with random weights (by default the ~125M shape: 12 layers, hidden 768, 12 heads, 4 KV
heads, intermediate 2048, vocab 32000, untied), saves it once with transformers'
``save_pretrained`` (safetensors) in float32 and in bfloat16, and
measures in one run:

* the memory bandwidth: a jitted ``jnp.sum`` over a 1 GiB float32 array, best of several;
* the bytes of weights one decode token reads (every weight once; of the embedding table
  only the token's row; the output head in full) and the limit they set,
  ``bytes / bandwidth`` in ms/token;
* our decode ms/token through ``forge_jax.models.llama.generate_with_stats`` (greedy, batch 1),
  paged and contiguous cache, compilation excluded;
* Hugging Face transformers' eager decode ms/token on the same checkpoint
  (``torch.inference_mode``, greedy, its KV cache; a manual loop timing only the decode
  steps), best of its default thread count and one thread;
* the bfloat16 checkpoint loaded with the default ``from_pretrained`` (float32 compute).

With ``--prefill``, measures the prompt's side instead, on SmolLM2-135M's shape (30
layers, hidden 576, 9 query / 3 KV heads, intermediate 1536, vocab 49152, tied output
head) in float32, batch 1, at each ``--lengths`` prompt length (128, 512, 2048):

* our jitted forward pass, ``model(tokens)`` (logits at every position, as transformers'
  forward returns them), the weights as arguments (``nnx.split`` / ``nnx.merge``);
* ``generate_with_stats``' own prefill (``prefill_seconds``: the compiled prefill step,
  which writes the KV cache and samples the first token), paged and contiguous cache,
  after a first call per length that compiles it and pays the first-run initialisation
  of its CPU runtimes (reported apart, as "first call");
* transformers' eager forward on the same checkpoint (``torch.inference_mode``), with
  logits at every position and, as its own ``generate`` prefills, at the last only
  (``logits_to_keep=1``); each the faster of torch's default thread count and one thread.

Measurements are interleaved over ``--rounds`` rounds and each keeps its best round, so
that a burst of load from other processes hurts one sample, not one contender.

Usage::

    python benchmarks/decode_cpu.py            # the 125M shape (a few minutes)
    python benchmarks/decode_cpu.py --prefill  # prefill at 128, 512, 2048 tokens (minutes)
    python benchmarks/decode_cpu.py --quick    # tiny shape, seconds: a smoke test
    python benchmarks/decode_cpu.py --prefill --quick
    python benchmarks/decode_cpu.py --family qwen2   # the same shape as a Qwen2 (q/k/v bias)
    python benchmarks/decode_cpu.py --family qwen3_moe  # 8 experts of 512, top-2, per layer
    python benchmarks/decode_cpu.py --family qwen3_moe --quantize int8  # + int8 weights
    python benchmarks/decode_cpu.py --family gpt_oss      # sinks, 8 biased experts, top-2
    python benchmarks/decode_cpu.py --family llama4_text  # NoPE, chunks, top-1 + shared

With ``--quantize FORMAT``, the float32 checkpoint is also loaded with
``from_pretrained(quantize=FORMAT)`` (linear layers and, in a mixture of experts, the
stacked experts) and its paged decode measured in the same rounds, with its parameter
bytes against the float32 model's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from flax import nnx  # noqa: E402

from forge_jax.kv_cache import CacheSpec  # noqa: E402
from forge_jax.models import llama  # noqa: E402
from forge_jax.models.checkpoints import hf_names as llama_hf
from forge_jax.models.checkpoints import quantize as quantize_load

FULL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=4)
QUICK = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
# --family -> (transformers config class, causal LM class, extra config fields)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": None}),
    # A mixture of experts: every layer 8 experts of width 512, 2 per token (renormalised),
    # instead of the dense MLP (whose intermediate_size then goes unused).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512,
                   "norm_topk_prob": True}),
    # gpt-oss: attention sinks, sliding (128) and full layers alternating, every layer 8
    # biased experts of width 512, 2 per token, clamped SwiGLU.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 512,
                 "head_dim": None, "sliding_window": 128}),
    # Llama 4: NoPE every 4th layer, L2 QK-norm, chunked RoPE layers; every 2nd layer 8
    # experts of width 512, top-1 by sigmoid, plus a shared expert; dense layers 2048 wide.
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM",
                    {"num_local_experts": 8, "num_experts_per_tok": 1, "intermediate_size": 512,
                     "intermediate_size_mlp": 2048, "interleave_moe_layer_step": 2,
                     "head_dim": None}),
}
# The prefill's model: SmolLM2-135M's shape (head_dim 64), tied output head.
SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
            max_position_embeddings=8192, tie_word_embeddings=True)
QUICK_TIED = dict(QUICK, tie_word_embeddings=True)


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def save_checkpoints(shape: dict, directory: pathlib.Path, seed: int = 0, bf16: bool = True,
                     family: str = "llama"):
    """Random-weight HF model of ``family`` saved as float32 (``f32/``) and, with ``bf16``,
    bfloat16 (``bf16/``). ``shape`` may set ``max_position_embeddings`` (2048) and
    ``tie_word_embeddings`` (False)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config_cls, model_cls, extra = FAMILIES[family]
    extra = dict(extra)
    if extra.get("head_dim", 0) is None:  # Gemma's default head_dim is 256: the shape's
        extra["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    config = getattr(transformers, config_cls)(
        **{"max_position_embeddings": 2048, "tie_word_embeddings": False, **shape, **extra},
        rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(directory / "f32", safe_serialization=True)
    if bf16:
        model.to(torch.bfloat16).save_pretrained(directory / "bf16", safe_serialization=True)
    del model


def print_header(command: str, quick: bool) -> None:
    """The report's first line: the command, the time, the machine and the versions (and
    transformers' progress bars off)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    now = datetime.datetime.now(datetime.UTC)
    print(f"# {command} {'--quick ' if quick else ''}| {now:%Y-%m-%d %H:%M} UTC"
          f" | {cpu_model()}, {os.cpu_count()} cores | jax {jax.__version__} "
          f"({jax.default_backend()}) | torch {torch.__version__}, transformers "
          f"{transformers.__version__} (torch threads {torch.get_num_threads()})")


def measure_bandwidth(x: jax.Array, repeats: int) -> float:
    """Best bytes/s of a jitted sum over the float32 array ``x``."""
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best


def weight_bytes_per_token(model: llama.Llama) -> int:
    """Bytes of weights one decode token reads: all of them, the embedding table aside
    (one row), the output head in full (the table itself when tied); of a mixture of
    experts' stacked experts, the ``num_experts_per_tok`` a token is routed to."""
    total, seen = 0, set()
    for name, (param, *_) in llama_hf.hf_parameters(model).items():
        if id(param) in seen:  # a fused projection holds several HF tensors
            continue
        seen.add(id(param))
        array = param[...]
        if name == "model.embed_tokens.weight":
            rows = array.shape[0] if model.config.tie_word_embeddings else 1
            total += rows * array.shape[1] * array.dtype.itemsize
        elif ".experts." in name:  # [experts, ...]: the routed ones
            c = model.config
            total += array.size * array.dtype.itemsize * c.num_experts_per_tok // c.num_experts
        else:
            total += array.size * array.dtype.itemsize
    return total


def ours_ms(model, prompt, new_tokens, cache) -> float:
    _, stats = llama.generate_with_stats(model, [prompt], new_tokens,  # every step, no host reads
                                         cache=CacheSpec(kind=cache), eos_token_id=())
    return stats.decode_ms_per_step


def hf_ms(hf_model, prompt, new_tokens, threads) -> float:
    """Eager HF decode ms/token: prefill, then a loop of single-token forwards with the KV
    cache, timing the decode steps only."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            ids = torch.tensor([prompt], dtype=torch.long)
            out = hf_model(input_ids=ids, use_cache=True)
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


def forward_fn(model: llama.Llama):
    """``f(tokens) -> logits``: the model's jitted forward, its weights passed as arguments."""
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    return lambda tokens: step(state, tokens)


def timed(fn, *args) -> float:
    """Seconds until ``fn(*args)``'s result is ready."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def hf_forward_s(hf_model, prompt, logits_to_keep: int = 0) -> float:
    """Seconds of transformers' eager forward over ``prompt`` (logits at every position,
    or at the last ``logits_to_keep``): the faster of torch's default thread count and
    one thread (a loaded machine can make one thread faster)."""
    import torch

    old = torch.get_num_threads()
    best = float("inf")
    try:
        for threads in sorted({old, 1}, reverse=True):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                ids = torch.tensor([prompt], dtype=torch.long)
                start = time.perf_counter()
                hf_model(input_ids=ids, logits_to_keep=logits_to_keep)  # eager: done on return
                best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(old)
    return best


def ours_prefill_s(model, prompt, cache) -> float:
    """``generate_with_stats``' prefill seconds (compilation excluded) for one new token."""
    return llama.generate_with_stats(model, [prompt], 1,
                                     cache=CacheSpec(kind=cache))[1].prefill_seconds


def main_prefill(args):
    """Prefill at several prompt lengths: our forward and generate's prefill against
    transformers' forward, interleaved (see the module docstring)."""
    import torch
    import transformers

    quick = args.quick
    shape = QUICK_TIED if quick else SMOL
    rounds = args.rounds or (1 if quick else 3)
    lengths = [int(n) for n in (args.lengths or ("8,32" if quick else "128,512,2048")
                                ).split(",")]
    print_header("decode_cpu --prefill", quick)
    print(f"# shape {shape}; float32, batch 1, prompts of {lengths} tokens, {rounds} round(s)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        save_checkpoints(shape, tmp, bf16=False)
        model = llama.from_pretrained(tmp / "f32")
        hf_model = transformers.LlamaForCausalLM.from_pretrained(
            tmp / "f32", dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prompts = {n: [int(t) for t in rng.integers(0, shape["vocab_size"], n)] for n in lengths}
    forward = forward_fn(model)
    tokens = {n: jnp.asarray([p], jnp.int32) for n, p in prompts.items()}
    contenders = {
        "forward": lambda n: timed(forward, tokens[n]),
        "paged": lambda n: ours_prefill_s(model, prompts[n], "paged"),
        "contiguous": lambda n: ours_prefill_s(model, prompts[n], "contiguous"),
        "hf": lambda n: hf_forward_s(hf_model, prompts[n]),
        "hf_last": lambda n: hf_forward_s(hf_model, prompts[n], logits_to_keep=1),
    }
    # Warm-up: compile every step; the first generate call per length also pays the
    # first-run initialisation of the compiled prefill (kept apart as "first call").
    first = {(key, n): fn(n) for n in lengths for key, fn in contenders.items()}
    samples = {key: {n: [] for n in lengths} for key in contenders}
    for _ in range(rounds):
        for n in lengths:
            for key, fn in contenders.items():
                samples[key][n].append(fn(n))
    best = {key: {n: min(v) for n, v in by_n.items()} for key, by_n in samples.items()}

    labels = {"forward": "forge_jax forward (all logits)",
              "paged": "forge_jax generate prefill, paged",
              "contiguous": "forge_jax generate prefill, contiguous",
              "hf": "HF transformers forward (all logits)",
              "hf_last": "HF transformers forward (last logits)"}
    width = max(len(v) for v in labels.values())
    print(f"\n| {'prefill, best of ' + str(rounds):<{width}} | "
          + " | ".join(f"{str(n) + ' tokens':>23}" for n in lengths) + " |")
    print(f"|{'-' * (width + 2)}|" + "|".join("-" * 25 for _ in lengths) + "|")
    for key, label in labels.items():
        cells = [f"{1e3 * best[key][n]:6.0f} ms {n / best[key][n]:6.0f} tok/s" for n in lengths]
        print(f"| {label:<{width}} | " + " | ".join(f"{c:>23}" for c in cells) + " |")
    print()
    for key in ("paged", "contiguous"):
        print(f"generate prefill, {key}: first call (first-run init included) "
              + ", ".join(f"{1e3 * first[(key, n)]:.0f} ms at {n}" for n in lengths))
    for key in ("forward", "paged", "contiguous"):
        print(f"{labels[key]}: "
              + ", ".join(f"{best['hf'][n] / best[key][n]:.2f}x" for n in lengths)
              + " HF forward's speed at " + "/".join(map(str, lengths)) + " tokens")
    met = [n for n in lengths if best["paged"][n] <= best["hf"][n]]
    print(f"target (generate's paged prefill at least as fast as HF's forward): "
          f"met at {met or 'no length'} of {lengths}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, small bandwidth array, one round (a smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (3)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (32)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens (128)")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama",
                        help="the model family of the random checkpoint (default llama)")
    parser.add_argument("--prefill", action="store_true",
                        help="measure the prefill instead (SmolLM2-135M's shape)")
    parser.add_argument("--quantize", choices=sorted(quantize_load.FORMATS), default=None,
                        help="also measure the model quantized at load in this format")
    parser.add_argument("--lengths", default=None,
                        help="with --prefill: comma-separated prompt lengths (128,512,2048)")
    args = parser.parse_args(argv)
    if args.prefill:
        return main_prefill(args)
    quick = args.quick
    shape = QUICK if quick else FULL
    rounds = args.rounds or (1 if quick else 3)
    prompt_len = args.prompt_len or (8 if quick else 32)
    new_tokens = args.new_tokens or (8 if quick else 128)
    bw_bytes = (16 if quick else 1024) << 20

    import torch
    import transformers

    print_header("decode_cpu", quick)
    print(f"# {args.family}, shape {shape}; batch 1, prompt {prompt_len}, {new_tokens} new "
          f"tokens, greedy, {rounds} round(s)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        save_checkpoints(shape, tmp, family=args.family)
        model = llama.from_pretrained(tmp / "f32")
        model_bf16 = llama.from_pretrained(tmp / "bf16")  # default: float32 weights
        model_q = None if args.quantize is None else llama.from_pretrained(
            tmp / "f32", quantize=args.quantize,
            group_size=8 if quick and args.quantize == "int4" else None)
        hf_model = getattr(transformers, FAMILIES[args.family][1]).from_pretrained(
            tmp / "f32", dtype=torch.float32).eval()
    hf_model.generation_config.pad_token_id = None
    prompt = [int(t) for t in np.random.default_rng(0).integers(
        0, shape["vocab_size"], prompt_len)]

    weight_bytes = weight_bytes_per_token(model)
    assert weight_bytes_per_token(model_bf16) == weight_bytes  # float32 weights

    # Warm-up: compile every step and run each path once (first executions allocate).
    for m, cache in ((model, "paged"), (model, "contiguous"), (model_bf16, "paged"),
                     (model_q, "paged")):
        if m is not None:
            ours_ms(m, prompt, new_tokens, cache)
    hf_ms(hf_model, prompt, min(new_tokens, 8), torch.get_num_threads())

    bw_array = jnp.asarray(np.random.default_rng(0).standard_normal(bw_bytes // 4, np.float32))
    samples: dict[str, list[float]] = {k: [] for k in (
        "bandwidth", "paged", "contiguous", "bf16", "hf", "quantized")}
    hf_threads = sorted({torch.get_num_threads(), 1}, reverse=True)
    for _ in range(rounds):
        samples["bandwidth"].append(measure_bandwidth(bw_array, repeats=3 if quick else 5))
        samples["paged"].append(ours_ms(model, prompt, new_tokens, "paged"))
        samples["contiguous"].append(ours_ms(model, prompt, new_tokens, "contiguous"))
        samples["bf16"].append(ours_ms(model_bf16, prompt, new_tokens, "paged"))
        if model_q is not None:
            samples["quantized"].append(ours_ms(model_q, prompt, new_tokens, "paged"))
        samples["hf"].append(min(hf_ms(hf_model, prompt, new_tokens, t) for t in hf_threads))
    samples["bandwidth"].append(measure_bandwidth(bw_array, repeats=3 if quick else 5))

    bandwidth = max(samples["bandwidth"])
    limit_ms = 1e3 * weight_bytes / bandwidth
    median_limit_ms = 1e3 * weight_bytes / statistics.median(samples["bandwidth"])
    best = {k: min(v) for k, v in samples.items() if k != "bandwidth" and v}
    ours = min(best["paged"], best["contiguous"])
    rows = [
        ("memory bandwidth (jnp.sum, f32)", f"{bandwidth / 1e9:.1f} GB/s",
         f"median {statistics.median(samples['bandwidth']) / 1e9:.1f}"),
        ("weights read per token", f"{weight_bytes / 1e6:.1f} MB", ""),
        ("limit (weights / bandwidth)", f"{limit_ms:.2f} ms/token",
         f"at the median bandwidth {median_limit_ms:.2f}"),
    ]
    for key, label in (("paged", "forge_jax, paged cache"),
                       ("contiguous", "forge_jax, contiguous cache"),
                       ("bf16", "forge_jax, bf16 checkpoint (paged)"),
                       ("hf", "HF transformers eager"),
                       ("quantized", f"forge_jax, {args.quantize} weights (paged)")):
        if key not in best:
            continue
        rows.append((label, f"{best[key]:.2f} ms/token",
                     f"median {statistics.median(samples[key]):.2f}; "
                     f"{1e3 / best[key]:.1f} tokens/s"))
    width = max(len(r[0]) for r in rows)
    print(f"\n| {'measurement':<{width}} | {'best':>15} | notes")
    print(f"|{'-' * (width + 2)}|{'-' * 17}|------")
    for name, value, note in rows:
        print(f"| {name:<{width}} | {value:>15} | {note}")
    print()
    for key in ("paged", "contiguous"):
        print(f"{key:>10}: {100 * limit_ms / best[key]:5.1f}% of limit, "
              f"{best['hf'] / best[key]:.2f}x HF")
    print(f"      bf16: {best['bf16'] / best['paged']:.2f}x the float32 paged time")
    if model_q is not None:
        q_bytes, f_bytes = (quantize_load.parameter_bytes(m) for m in (model_q, model))
        print(f"{args.quantize:>10}: {best['quantized'] / best['paged']:.2f}x the float32 paged "
              f"time; parameters {q_bytes / 1e6:.1f} MB, {q_bytes / f_bytes:.3f} of float32's "
              f"{f_bytes / 1e6:.1f} MB")
    print(f"best ours: {100 * limit_ms / ours:.1f}% of limit (target >= 80%), "
          f"{best['hf'] / ours:.2f}x HF (target >= 1.8x); "
          f"{100 * median_limit_ms / ours:.1f}% of the limit at the median bandwidth")
    print("bandwidth samples (GB/s): "
          + " ".join(f"{b / 1e9:.1f}" for b in samples["bandwidth"]))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
