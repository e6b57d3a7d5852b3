"""Trains the embedded tiny model on the addition task and writes it to ``models/tiny/``.

    pip install -e ".[train]"
    python -m forge_jax.models.tiny.train                  # ~4 minutes on 2 shared CPU cores
    python -m forge_jax.models.tiny.train --out /tmp/tiny --steps 300

The model is :class:`forge_jax.models.llama.Llama` itself, trained through its full causal forward
(``model(tokens)``), so the shipped weights are exactly what the library computes with. The
loss is the cross-entropy of the answer digits and the eos (the prompt is given, not learned).
Everything is seeded (model initialisation, problem sampling), so a rerun reproduces the
artifact (bit for bit on the machine that made it; other CPUs or XLA versions may round
differently). Training never sees the ~10% of problems that ``forge_jax.models.tiny.task`` holds
out, and every accuracy reported (here, in tests, by ``forge-jax generate``) is measured on those.

The output directory is a Hugging Face Llama checkpoint: ``config.json``, ``model.safetensors``
(float32, HF tensor names and ``[out, in]`` layout), ``tokenizer.json`` (the character-level
tokenizer of :mod:`forge_jax.models.tiny.task`) and ``tokenizer_config.json``, so transformers'
``LlamaForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load it too.
``config.json`` also carries a ``forge_jax_task`` entry (ignored by transformers and by
``LlamaConfig.from_hf``) that tells ``forge-jax generate`` which task the model solves.
After saving, the script reloads the directory with
``forge_jax.models.llama.from_pretrained`` and reports the greedy exact-match accuracy on
held-out problems.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forge_jax.models import llama
from forge_jax.models.tiny import task as tasks

TINY_DIR = pathlib.Path(__file__).resolve().parent  # the checkpoint sits beside this file

# The tiny model, as its config.json states it: GQA (4 query heads, 2 KV heads), ~0.5M
# parameters, ~2 MB in float32.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": len(tasks.VOCAB),
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "bos_token_id": tasks.BOS_ID,
    "eos_token_id": tasks.EOS_ID,
    "pad_token_id": tasks.PAD_ID,
    "torch_dtype": "float32",
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Training hyper-parameters (the defaults produce the shipped ``models/tiny``)."""

    max_digits: int = 3
    steps: int = 1600
    batch_size: int = 128
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    seed: int = 0
    eval_every: int = 200
    eval_problems: int = 2000


def _batch(task: tasks.AdditionTask, rng: np.random.Generator, n: int, split: str):
    """A training batch at one fixed width (so the step compiles once): ids, loss mask."""
    width = 1 + task.max_prompt_chars + task.max_answer_chars + 1
    ids, mask = tasks.encode_problems(task.sample(rng, n, split=split), with_answer=True)
    out_ids = np.full((n, width), tasks.PAD_ID, np.int32)
    out_mask = np.zeros((n, width), np.float32)
    out_ids[:, :ids.shape[1]], out_mask[:, :mask.shape[1]] = ids, mask
    return jnp.asarray(out_ids), jnp.asarray(out_mask)


def train(cfg: TrainConfig = TrainConfig(), *, log=print) -> llama.Llama:
    """Trains a :class:`forge_jax.models.llama.Llama` with the ``TINY_CONFIG`` shape; returns it."""
    try:
        import optax
    except ImportError:
        raise SystemExit(
            "forge_jax.models.tiny.train needs optax: pip install -e '.[train]'") from None

    task = tasks.AdditionTask(cfg.max_digits)
    config = llama.LlamaConfig.from_hf(TINY_CONFIG)
    model = llama.Llama(config, rngs=nnx.Rngs(cfg.seed))
    graphdef, params = nnx.split(model)

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, cfg.warmup_steps, cfg.steps, end_value=0.05 * cfg.learning_rate)
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # matrices only, not norms
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decay_mask))
    opt_state = optimizer.init(params)

    def loss_fn(params, ids, mask):
        logits = nnx.merge(graphdef, params)(ids[:, :-1])  # [batch, seq - 1, vocab]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
        return (nll * mask[:, :-1]).sum() / mask[:, :-1].sum()

    @jax.jit
    def step(params, opt_state, ids, mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids, mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def exact_match(params, ids, mask):
        """Teacher-forced: the fraction of rows whose every answer token is the argmax."""
        pred = jnp.argmax(nnx.merge(graphdef, params)(ids[:, :-1]), axis=-1)
        return jnp.mean(jnp.all((pred == ids[:, 1:]) | (mask[:, :-1] == 0), axis=-1))

    rng = np.random.default_rng(cfg.seed)
    eval_ids, eval_mask = _batch(task, np.random.default_rng(cfg.seed + 1), 512, "test")
    start = time.perf_counter()
    for i in range(1, cfg.steps + 1):
        params, opt_state, loss = step(params, opt_state, *_batch(task, rng, cfg.batch_size,
                                                                  "train"))
        if i % cfg.eval_every == 0 or i == cfg.steps:
            acc = float(exact_match(params, eval_ids, eval_mask))
            log(f"step {i:5d}  loss {float(loss):.4f}  held-out exact match (teacher-forced) "
                f"{acc:.3f}  {time.perf_counter() - start:.0f} s")
    return nnx.merge(graphdef, params)


def hf_state_dict(model: llama.Llama) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face names, in HF's layout (float32 NumPy)."""
    return llama.hf_state_dict(model)


def save_pretrained(model: llama.Llama, path: str | pathlib.Path, *,
                    config: dict, task: tasks.AdditionTask) -> None:
    """Writes the HF checkpoint directory described in the module docstring."""
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(config, forge_jax_task={"name": "addition", "max_digits": task.max_digits,
                                          "answer": "digits of the sum, least significant first"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(hf_state_dict(model), str(path / "model.safetensors"), metadata={"format": "pt"})
    tasks.build_tokenizer().save(str(path / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tasks.BOS,
                        "eos_token": tasks.EOS, "pad_token": tasks.PAD,
                        "model_max_length": config["max_position_embeddings"]}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m forge_jax.models.tiny.train", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(TINY_DIR), help="output directory (%(default)s)")
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(getattr(defaults,
                            field.name)), default=getattr(defaults, field.name))
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    print(f"training {cfg} on {jax.devices()[0].platform}")
    start = time.perf_counter()
    model = train(cfg)
    elapsed = time.perf_counter() - start
    task = tasks.AdditionTask(cfg.max_digits)
    save_pretrained(model, args.out, config=TINY_CONFIG, task=task)
    size = (pathlib.Path(args.out) / "model.safetensors").stat().st_size
    print(f"trained in {elapsed:.0f} s; wrote {args.out} (model.safetensors {size / 1e6:.1f} MB)")

    reloaded = llama.from_pretrained(args.out)
    problems = task.sample(np.random.default_rng(cfg.seed + 2), cfg.eval_problems, split="test")
    generated, _ = tasks.solve(reloaded, problems)
    print(f"greedy exact-match accuracy on {len(problems)} held-out problems "
          f"(reloaded from {args.out}): {tasks.accuracy(problems, generated):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
