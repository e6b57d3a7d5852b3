"""Time to first token, streaming and a chat's kept KV cache, on CPU.

By default builds a Llama with random weights in SmolLM2-135M's shape (30 layers, hidden
576, 9 query / 3 KV heads, intermediate 1536, vocab 49152, tied output head) with a small
byte-level BPE tokenizer and a ChatML template (its ids all lie in the model's vocabulary);
``--checkpoint DIR`` measures a real instruct checkpoint instead. Measures, in one process:

1. a 5-token prompt's prefill: its first run after compiling (what a fresh process pays
   without the warm-up), then warmed up, against one decode step;
2. decode ms/step with an eos id (tokens read on the host one step behind), with and
   without streaming text through ``TextStreamer``, and without eos (no reads at all);
3. a chat: the time to first token of a later turn with the KV cache kept
   (``ChatSession``) against a fresh session that prefills the whole conversation;

and, with ``--starts``, runs ``forge-jax generate`` twice in fresh processes with an empty
persistent compilation cache: the first and the second start.

Usage::

    python benchmarks/chat_cpu.py [--checkpoint DIR] [--starts]
    python benchmarks/chat_cpu.py --quick     # tiny shape, seconds: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from _cpu import QUICK, SMOL, hf_config, random_llama

from forge_jax.models import llama
from forge_jax.text import api as text
from forge_jax.text.chat_session import ChatSession

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + "
            "m['content'] + '<|im_end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TURNS = ["Hello! Could you tell me about the history of the printing press?",
         "Interesting. And how did it change the way people read and learn?",
         "Give me three short facts about paper making, please.",
         "Thanks. Now summarise everything we talked about in two sentences."]
# A conversation whose turns' new tokens span several power-of-two sizes (a short "Thanks!"
# to a pasted paragraph), as a real one does: each size was a new prefill shape to compile.
CHAT = [TURNS[0], TURNS[1],
        "Here is a passage I am reading; please explain it: " + " ".join(TURNS[1:3]) * 2,
        "Thanks!", TURNS[2], TURNS[3] + " Keep it simple, clear and short, please."]


def build_checkpoint(directory: pathlib.Path, shape: dict) -> pathlib.Path:
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((TURNS + CHAT) * 10, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    extra = dict(torch_dtype="float32", eos_token_id=tok.token_to_id("<|im_end|>"))
    (directory / "config.json").write_text(json.dumps(hf_config(shape, **extra)))
    model = random_llama(shape, **extra)
    save_file({k: np.ascontiguousarray(v) for k, v in llama.hf_state_dict(model).items()},
              str(directory / "model.safetensors"))
    return directory


def prefill_first_run(model, prompt, rounds):
    """(first-run TTFT, warmed-up TTFTs, decode ms/step): a prompt length no call used
    before, so that the first call compiles and runs a new prefill executable."""
    _, first = llama.generate_with_stats(model, [prompt], 8)
    warm = [llama.generate_with_stats(model, [prompt], 8)[1] for _ in range(rounds)]
    return first, warm


def decode_rates(model, tokenizer, prompt, new_tokens, rounds):
    eos = [model.config.vocab_size - 1]  # an id greedy decoding does not reach here
    out = {"no eos (no host reads)": [], "eos, not streaming": [], "eos, streaming text": []}
    for _ in range(rounds):
        for name in out:
            kw = {"eos_token_id": () if name.startswith("no eos") else eos}
            if name.endswith("streaming text"):
                kw["on_tokens"] = text.TextStreamer(tokenizer, 1, eos, lambda b, piece: None)
            _, stats = llama.generate_with_stats(model, [prompt], new_tokens, **kw)
            out[name].append(stats.decode_ms_per_step)
    return {name: min(v) for name, v in out.items()}, out


def chat_turns(model, tokenizer, max_new_tokens):
    """Per turn: (prompt tokens, prefilled, compile, TTFT kept cache, TTFT fresh prefill,
    tokens it prefilled), and the kept conversation's TTFTs on a second pass.

    The kept conversation runs first, in a process that has compiled nothing for a chat,
    as ``forge-jax chat`` runs it (the fresh sessions' prefills would compile shapes the
    kept one uses)."""
    kept = ChatSession(model, tokenizer, max_new_tokens=max_new_tokens, max_context=2048)
    kept_stats, histories = [], []
    for turn in CHAT:
        histories.append(list(kept.messages))
        kept.send(turn)
        kept_stats.append(kept.last_turn)
    rows = []
    for turn, history, stats in zip(CHAT, histories, kept_stats, strict=True):
        # The same conversation in a fresh session: everything is prefilled. Run twice so
        # that the timed one has its prefill compiled and warmed up, like the kept one's.
        for _ in range(2):
            fresh = ChatSession(model, tokenizer, max_new_tokens=1, max_context=2048)
            fresh.messages = list(history)
            fresh.send(turn)
        rows.append((stats.prompt_tokens, stats.prefilled_tokens, stats.compile_seconds,
                     stats.first_token_seconds, fresh.last_turn.first_token_seconds,
                     fresh.last_turn.prefilled_tokens))
    # The conversation once more, now that every prefill shape it uses is compiled and warm.
    kept = ChatSession(model, tokenizer, max_new_tokens=max_new_tokens, max_context=2048)
    warm = []
    for turn in CHAT:
        kept.send(turn)
        warm.append(kept.last_turn.first_token_seconds)
    return rows, warm


def prefill_and_decode(model, tokenizer, rounds, quick):
    """Sections 1 and 2: a short prompt's prefill, and decode ms/step."""
    prompt = tokenizer.encode("Hello there, friend")[:5]
    first, warm = prefill_first_run(model, prompt, rounds)
    best = min(warm, key=lambda s: s.prefill_seconds)
    print(f"\n1. {len(prompt)}-token prompt, prefill bucket {best.prompt_bucket}")
    print(f"   first run after compiling : {first.prefill_seconds * 1e3:8.1f} ms "
          f"(compile {first.compile_seconds:.2f} s)")
    print(f"   warmed up (best of {rounds})   : {best.prefill_seconds * 1e3:8.1f} ms "
          f"(median {statistics.median(s.prefill_seconds for s in warm) * 1e3:.1f})")
    print(f"   one decode step            : {best.decode_ms_per_step:8.2f} ms")

    long_prompt = tokenizer.encode(" ".join(TURNS))[:32]
    best_rates, all_rates = decode_rates(model, tokenizer, long_prompt,
                                         32 if quick else 64, rounds)
    print(f"\n2. decode ms/step, {len(long_prompt)}-token prompt (best of {rounds}; all runs)")
    for name, ms in best_rates.items():
        runs = ", ".join(f"{x:.2f}" for x in all_rates[name])
        print(f"   {name:26s}: {ms:7.2f}   ({runs})")


def starts(checkpoint: pathlib.Path, cache_dir: pathlib.Path):
    """Two fresh `forge-jax generate` processes sharing an empty compilation cache."""
    out = []
    for _ in range(2):
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "forge_jax.cli", "generate", "--checkpoint",
             str(checkpoint), "--prompt", "Hello! Could you tell me", "--max-new-tokens", "16",
             "--compilation-cache", str(cache_dir)],
            capture_output=True, text=True, check=True)
        wall = time.perf_counter() - start
        compile_s = float(re.search(r"warmed up before it in ([\d.]+) s", result.stdout)[1])
        ttft_ms = float(re.search(r"time to first token: ([\d.]+) ms", result.stdout)[1])
        out.append((wall, compile_s, ttft_ms))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", metavar="DIR")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--starts", action="store_true",
                        help="also time two fresh `forge-jax generate` processes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chat-only", action="store_true",
                        help="only section 3, the chat turns")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(args.checkpoint) if args.checkpoint else build_checkpoint(
            pathlib.Path(tmp), QUICK if args.quick else SMOL)
        model = llama.from_pretrained(path)
        tokenizer = text.load_tokenizer(path)
        c = model.config
        print(f"model: {path if args.checkpoint else 'random weights'}, "
              f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}; "
              f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
              f"load average {os.getloadavg()[0]:.2f}")

        if not args.chat_only:
            prefill_and_decode(model, tokenizer, rounds, args.quick)

        rows, warm_turns = chat_turns(model, tokenizer, 8 if args.quick else 24)
        print("\n3. chat turns: time to first token, kept cache vs the whole conversation "
              "prefilled")
        print("   turn | prompt tokens | prefilled (kept) | compile + warm-up | TTFT kept | "
              "TTFT fresh prefill (tokens) | kept, 2nd pass")
        for i, (n, pre, compile_s, kept, fresh, fresh_pre) in enumerate(rows):
            print(f"   {i + 1:4d} | {n:13d} | {pre:16d} | {compile_s:15.2f} s | "
                  f"{kept * 1e3:7.1f} ms | {fresh * 1e3:9.1f} ms ({fresh_pre:4d}) | "
                  f"{warm_turns[i] * 1e3:7.1f} ms")

        if args.starts:
            cache = pathlib.Path(tmp) / "jax_cache"
            print("\n4. forge-jax generate, two fresh processes, one compilation cache")
            for i, (wall, compile_s, ttft) in enumerate(starts(path, cache)):
                print(f"   start {i + 1}: process {wall:6.2f} s, compile + warm-up "
                      f"{compile_s:5.2f} s, time to first token {ttft:6.1f} ms")


if __name__ == "__main__":
    main()
