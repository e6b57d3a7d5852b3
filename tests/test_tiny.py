"""The embedded tiny model (models/tiny): the shipped artifact, its tokenizer and its task.

The model is loaded from the committed files, never trained here (``python -m
forge_jax.models.tiny.train`` takes minutes). Accuracy is measured on fresh held-out problems (ones
training never saw), with greedy decoding through the real ``generate``, both caches.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import forge_jax as fj
from forge_jax.models import llama
from forge_jax.models.tiny import task as tasks
from forge_jax.models.tiny import train as train_tiny

TINY = train_tiny.TINY_DIR
TASK = tasks.AdditionTask(max_digits=3)


@pytest.fixture(scope="module")
def model():
    return llama.from_pretrained(TINY)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TINY / "tokenizer.json"))


@pytest.fixture(scope="module")
def problems():
    return TASK.sample(np.random.default_rng(1234), 64, split="test")


# ------------------------------------------------------------------------------ task


def test_problem_text():
    p = tasks.Problem(123, 459)
    assert (p.prompt, p.answer) == ("123+459=", "285")
    assert tasks.read_answer(p.answer) == 582
    assert tasks.read_answer("") is None and tasks.read_answer("1+") is None


def test_answer_check_needs_exact_digits_and_eos():
    p = tasks.Problem(95, 7)  # 102 -> "201"
    digits = [tasks.VOCAB[c] for c in "201"]
    assert tasks.is_correct(p, digits + [tasks.EOS_ID])
    assert not tasks.is_correct(p, digits)  # no eos: the answer might go on
    assert not tasks.is_correct(p, digits + [tasks.VOCAB["0"], tasks.EOS_ID])
    assert not tasks.is_correct(p, [tasks.VOCAB[c] for c in "102"] + [tasks.EOS_ID])
    assert tasks.decode(digits + [tasks.EOS_ID, tasks.VOCAB["5"]]) == ("201", True)


def test_splits_are_disjoint_and_cover_every_operand_length():
    rng = np.random.default_rng(0)
    train = TASK.sample(rng, 2000, split="train")
    test = TASK.sample(rng, 300, split="test")
    assert not any(p.held_out for p in train) and all(p.held_out for p in test)
    lengths = {(len(str(p.a)), len(str(p.b))) for p in train}
    assert lengths == {(i, j) for i in (1, 2, 3) for j in (1, 2, 3)}
    held_out_fraction = np.mean([p.held_out for p in TASK.sample(rng, 4000, split="train")
                                 + TASK.sample(rng, 400, split="test")])
    assert 0.05 < held_out_fraction < 0.2  # the rejection sampler drew both kinds



@pytest.mark.parametrize("n", [-1, 2.0, True, None])
def test_sample_rejects_a_bad_count(n):
    with pytest.raises(ValueError, match=rf"n={n!r}"):
        tasks.AdditionTask().sample(np.random.default_rng(), n)


def test_training_batch_masks_the_answer_and_eos_only():
    ids, mask = tasks.encode_problems([tasks.Problem(7, 5), tasks.Problem(123, 459)],
                                      with_answer=True)
    # Row 0: <bos> 7 + 5 = 2 1 <eos>; the loss scores the predictions of "2", "1", <eos>,
    # made at the positions of "=", "2" and "1".
    assert ids[0, :8].tolist() == [tasks.BOS_ID] + [tasks.VOCAB[c] for c in "7+5=21"] + [
        tasks.EOS_ID]
    assert ids.shape[1] == 1 + len("123+459=285") + 1
    assert ids[0, 8:].tolist() == [tasks.PAD_ID] * (ids.shape[1] - 8)
    assert mask[0].tolist() == [0, 0, 0, 0, 1, 1, 1] + [0] * (ids.shape[1] - 7)
    assert mask[1].sum() == 4


# ------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips(tokenizer, problems):
    assert tokenizer.get_vocab() == tasks.VOCAB
    for p in problems[:20]:
        text = p.prompt + p.answer
        enc = tokenizer.encode(text)
        assert enc.ids[0] == tasks.BOS_ID and len(enc.ids) == 1 + len(text)
        assert tokenizer.decode(enc.ids) == text
        assert tokenizer.encode(p.prompt).ids == tasks.encode_prompt(p)
    assert tokenizer.decode([tasks.BOS_ID, tasks.VOCAB["4"], tasks.EOS_ID, tasks.PAD_ID]) == "4"


def test_shipped_tokenizer_is_the_tasks_tokenizer(tokenizer):
    assert json.loads(tokenizer.to_str()) == json.loads(tasks.build_tokenizer().to_str())


# -------------------------------------------------------------------------- artifact


def test_artifact_is_a_small_hf_llama_checkpoint():
    raw = json.loads((TINY / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["model_type"] == "llama"
    assert tasks.task_from_config(raw) == TASK
    config = llama.LlamaConfig.from_hf(raw)
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    tensors = load_file(TINY / "model.safetensors")
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (
        config.num_key_value_heads * config.head_dim, config.hidden_size)  # HF [out, in]
    assert (TINY / "model.safetensors").stat().st_size < 5e6


def test_export_reproduces_the_shipped_tensors(model):
    shipped = load_file(TINY / "model.safetensors")
    exported = train_tiny.hf_state_dict(model)
    assert sorted(exported) == sorted(shipped)
    for name, array in exported.items():
        np.testing.assert_array_equal(array, shipped[name], err_msg=name)


# -------------------------------------------------------------------------- accuracy


@pytest.fixture(scope="module")
def solved(model, problems):
    """Greedy answers to ``problems`` with the paged cache: (generated ids, stats)."""
    return tasks.solve(model, problems, cache="paged")


def forward(model, ids):
    """The full uncached forward (what training used), jitted: float32 logits as NumPy."""
    return np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))


def test_accuracy_on_fresh_problems_and_caches_agree(model, problems, solved):
    paged, stats = solved
    accuracy = tasks.accuracy(problems, paged)
    assert accuracy >= 0.9, f"{accuracy=:.3f} on {len(problems)} held-out problems"
    assert stats.decode_steps > 0
    contiguous, _ = tasks.solve(model, problems, cache="contiguous")
    assert paged == contiguous


def test_full_forward_agrees_with_generation(model, problems, solved):
    """Teacher-forced argmax of the uncached forward says the same right/wrong as generation."""
    ids, mask = tasks.encode_problems(problems, with_answer=True)
    pred = forward(model, ids).argmax(-1)
    teacher_forced = np.all((pred[:, :-1] == ids[:, 1:]) | (mask[:, :-1] == 0), axis=-1)
    by_generation = [tasks.is_correct(p, g) for p, g in zip(problems, solved[0], strict=True)]
    assert teacher_forced.tolist() == by_generation


# --------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def hf_model():
    torch = pytest.importorskip("torch", reason="needs torch (pip install .[parity])")
    transformers = pytest.importorskip(
        "transformers", reason="needs transformers (pip install .[parity])")
    hf = transformers.LlamaForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    return torch, transformers, hf


def test_transformers_loads_the_artifact_and_agrees(hf_model, model, problems, solved):
    torch, transformers, hf = hf_model
    hf_tok = transformers.AutoTokenizer.from_pretrained(TINY)
    for p, generated in list(zip(problems, solved[0], strict=True))[:4]:
        prompt = tasks.encode_prompt(p)
        assert hf_tok(p.prompt)["input_ids"] == prompt
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=len(generated),
                              do_sample=False, eos_token_id=tasks.EOS_ID,
                              pad_token_id=tasks.PAD_ID)
        assert out[0, len(prompt):].tolist() == generated, p.prompt
    # Logits of a right-padded batch: causal, so every real position is unaffected by padding.
    ids, _ = tasks.encode_problems(problems[:16], with_answer=True)
    with torch.no_grad():
        hf_logits = hf(torch.tensor(ids)).logits.numpy()
    tol = fj.tolerances.scaled(fj.tolerances.tolerance(jnp.float32), 20)
    np.testing.assert_allclose(forward(model, ids), hf_logits, **tol.as_kwargs())
