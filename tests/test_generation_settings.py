"""Generation settings passed whole (``SamplingParams``, ``CacheSpec``, ``Callbacks``), the
one front door that resolves the eos ids and the token limit (``settings.stopping``), and the
loose keywords of earlier releases, which still work for one release and warn."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import numpy as np
import pytest

from forge_jax import generation, text
from forge_jax.generation import Callbacks, SamplingParams, loop, settings, steps
from forge_jax.kv_cache import CacheSpec
from forge_jax.models import TINY_DIR, llama
from forge_jax.models.checkpoints.generation_config import GenerationConfig

PROMPTS = [[1, 2, 3, 4], [5, 6]]


@pytest.fixture(scope="module")
def tiny():
    return llama.from_pretrained(TINY_DIR)


def test_stopping_resolves_eos_in_transformers_order(tiny):
    config = tiny.config
    assert settings.stopping(config, GenerationConfig(eos_token_id=[7, 9])).eos_token_ids \
        == (7, 9)
    assert settings.stopping(config).eos_token_ids == tuple(config.eos_token_ids)
    bare = dataclasses.replace(config, eos_token_id=None)
    assert settings.stopping(bare).eos_token_ids == ()
    assert settings.stopping(bare, tokenizer_eos_id=4).eos_token_ids == (4,)
    # The caller's wins, whatever its collection; () means none.
    assert settings.stopping(config, GenerationConfig(eos_token_id=[7]),
                             eos_token_id={3, 1}).eos_token_ids == (1, 3)
    assert settings.stopping(config, eos_token_id=()).eos_token_ids == ()
    with pytest.raises(TypeError, match="eos_token_id must be an int"):
        settings.stopping(config, eos_token_id="2")


def test_stopping_resolves_max_new_tokens_once(tiny):
    config = tiny.config
    assert settings.stopping(config).max_new_tokens == settings.DEFAULT_MAX_NEW_TOKENS == 256
    room = config.max_position_embeddings - 10
    assert settings.stopping(config, longest_prompt=10).max_new_tokens == min(256, room)
    full = config.max_position_embeddings
    assert settings.stopping(config, longest_prompt=full).max_new_tokens == 1
    assert settings.stopping(config, GenerationConfig(max_new_tokens=7),
                             longest_prompt=10).max_new_tokens == 7
    assert settings.stopping(config, GenerationConfig(max_new_tokens=7),
                             max_new_tokens=3).max_new_tokens == 3
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -1"):
        settings.stopping(config, max_new_tokens=-1)


def test_every_caller_asks_the_front_door(tiny, monkeypatch):
    """The loop's default eos, the text API's and the chat session's come from stopping."""
    tokenizer = text.load_tokenizer(TINY_DIR)
    calls = []
    real = settings.stopping

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(settings, "stopping", spy)
    assert loop.default_eos_token_ids(tiny) == real(
        tiny.config, tiny.generation_config).eos_token_ids
    assert text.eos_ids(tiny, tokenizer, None) == real(tiny.config).eos_token_ids
    generation.generate(tiny, PROMPTS, 2)
    text.generate_text(tiny, tokenizer, "12+34=", max_new_tokens=2)
    assert len(calls) >= 5


def test_sampling_params_carry_the_seed_and_greedy():
    params = SamplingParams(temperature=0.5, seed=7)
    assert params.seed == 7 and not params.greedy
    assert dataclasses.replace(params, temperature=0.0).greedy
    with pytest.raises(ValueError, match="seed must be an int"):
        SamplingParams(seed=2**63)
    with pytest.raises(ValueError, match="seed must be an int"):
        SamplingParams(seed=True)
    assert settings.sampling_params(GenerationConfig(temperature=0.3, do_sample=True),
                                    seed=5) == SamplingParams(0.3, seed=5)
    with pytest.warns(DeprecationWarning, match="SamplingParams.greedy"):
        assert SamplingParams().mode is True


def test_step_statics_name_greedy():
    statics = steps.step_statics(None, greedy=True)
    assert statics["greedy"] is True and "mode" not in statics
    assert "greedy" in inspect.signature(steps.prefill_step).parameters


def test_settings_passed_whole_give_the_same_tokens_as_the_old_keywords(tiny):
    sampling = SamplingParams(temperature=0.8, top_k=5, seed=3)
    cache = CacheSpec(kind="contiguous", kv_dtype="int8")
    new = generation.generate(tiny, PROMPTS, 5, sampling=sampling, cache=cache)
    with pytest.warns(DeprecationWarning) as record:
        old = generation.generate(tiny, PROMPTS, 5, temperature=0.8, top_k=5, seed=3,
                                  cache="contiguous", kv_cache_dtype="int8")
    assert old == new
    messages = " ".join(str(w.message) for w in record)
    assert "sampling=SamplingParams(temperature=..., top_k=..., seed=...)" in messages
    assert "cache=CacheSpec(kv_dtype=...)" in messages
    assert "cache=CacheSpec(kind='contiguous')" in messages


def test_callbacks_stream_and_report_progress(tiny):
    seen, progress = [], []
    ids, stats = generation.generate_with_stats(
        tiny, PROMPTS, 4, eos_token_id=(),
        callbacks=Callbacks(progress=lambda d, t: progress.append((d, t)),
                            on_tokens=lambda i, toks: seen.append((i, toks.tolist()))))
    assert [i for i, _ in seen] == [0, 1, 2, 3]
    assert [list(r) for r in zip(*(t for _, t in seen), strict=True)] == ids
    assert progress[-1] == (4, 4)
    with pytest.warns(DeprecationWarning, match="callbacks="):
        old, _ = generation.generate_with_stats(tiny, PROMPTS, 4, eos_token_id=(),
                                                progress=lambda d, t: None)
    assert old == ids


def test_a_setting_given_twice_or_unknown_is_refused(tiny):
    with pytest.raises(TypeError, match="sampling= and temperature="):
        generation.generate(tiny, PROMPTS, 2, sampling=SamplingParams(), temperature=0.5)
    with pytest.raises(TypeError, match=r"cache=CacheSpec\(...\) and page_size="):
        generation.generate(tiny, PROMPTS, 2, cache=CacheSpec(), page_size=8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        generation.generate(tiny, PROMPTS, 2, temprature=0.5)
    with pytest.raises(TypeError, match="cache must be a forge_jax.kv_cache.CacheSpec"):
        generation.generate(tiny, PROMPTS, 2, cache=16)


def test_text_api_and_chat_session_take_settings_whole(tiny):
    tokenizer = text.load_tokenizer(TINY_DIR)
    sampling = SamplingParams(temperature=0.7, seed=2)
    new = text.generate_text(tiny, tokenizer, ["12+34=", "5+6="], max_new_tokens=4,
                             sampling=sampling, cache=CacheSpec(page_size=8))
    with pytest.warns(DeprecationWarning, match="generate_text"):
        old = text.generate_text(tiny, tokenizer, ["12+34=", "5+6="], max_new_tokens=4,
                                 temperature=0.7, seed=2, page_size=8)
    assert old == new
    ids, stats = text.generate_ids(tiny, None, [[1, 2, 3]], max_new_tokens=3)[1:]
    assert len(ids[0]) <= 3 and stats.max_new_tokens == 3


def test_no_public_generation_function_takes_more_than_ten_parameters():
    from forge_jax.text.chat_session import ChatSession

    for fn in (generation.generate, generation.generate_with_stats, text.generate_text,
               text.chat, text.generate_ids, ChatSession.__init__,
               generation.check_generation_fits):
        named = [p for p in inspect.signature(fn).parameters.values()
                 if p.kind is not p.VAR_KEYWORD and p.name != "self"]
        assert len(named) <= 10, (fn.__qualname__, [p.name for p in named])


def test_the_new_arguments_do_not_warn(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        out = generation.generate(tiny, np.asarray(PROMPTS[:1]), 2, sampling=SamplingParams(),
                                  cache=CacheSpec())
    assert len(out[0]) <= 2
