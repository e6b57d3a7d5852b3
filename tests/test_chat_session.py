"""ChatSession: a multi-turn chat that keeps its paged KV cache between turns gives the
replies of a fresh prefill of the whole conversation, while prefilling only the new
tokens."""

from __future__ import annotations

import pytest
from cases.chat_checkpoint import write_checkpoint

from forge_jax.generation import sampling_params
from forge_jax.text import api as text
from forge_jax.text.chat_session import ChatSession, ContextFullError

TURNS = ["Hello there! How are you today?", "Tell me a story about a small robot.",
         "Caf\u00e9 cr\u00e8me? \U0001f642 na\u00efve fa\u00e7ade"]


def test_multi_turn_equals_one_generate_over_the_conversation(chat_model, chat_tokenizer):
    session = ChatSession(chat_model, chat_tokenizer, system="You are a helpful robot.",
                          max_new_tokens=10)
    history = [{"role": "system", "content": "You are a helpful robot."}]
    previous_prompt = 0
    for i, turn in enumerate(TURNS):
        history.append({"role": "user", "content": turn})
        pieces = []
        reply = session.send(turn, on_text=pieces.append)
        assert reply == "".join(pieces)
        # The same conversation prefilled from scratch (greedy) gives the same reply.
        assert reply == text.chat(chat_model, chat_tokenizer, history, max_new_tokens=10)
        history.append({"role": "assistant", "content": reply})
        assert session.messages == history
        stats = session.last_turn
        assert stats.prompt_tokens == len(text.encode_chat(chat_tokenizer, history[:-1]))
        assert stats.prefilled_tokens == stats.prompt_tokens - stats.reused_tokens
        assert stats.new_tokens == 10 and stats.decode_steps == 9
        if i == 0:
            assert stats.reused_tokens == 0
        else:  # at least the previous prompt stayed in the cache
            assert stats.reused_tokens >= previous_prompt
        previous_prompt = stats.prompt_tokens
    assert stats.first_token_seconds > 0 and stats.decode_ms_per_step > 0


def test_stream_reset_and_early_close(chat_model, chat_tokenizer):
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=8)
    first = "".join(session.stream(TURNS[0]))
    session.reset()
    assert session.messages == []
    assert session.send(TURNS[0]) == first  # from scratch again: nothing reused
    assert session.last_turn.reused_tokens == 0
    # Closing a stream early keeps the reply so far; the next turn goes on from there.
    stream = session.stream(TURNS[1])
    partial = next(stream)
    stream.close()
    assert session.messages[-1] == {"role": "assistant", "content": partial}
    history = [*session.messages, {"role": "user", "content": TURNS[2]}]
    assert session.send(TURNS[2]) == text.chat(chat_model, chat_tokenizer, history,
                                               max_new_tokens=8)
    assert session.last_turn.reused_tokens > 0


def test_context_full_is_clear(chat_model, chat_tokenizer):
    session = ChatSession(chat_model, chat_tokenizer, max_context=40, max_new_tokens=30)
    session.send("Hi")
    assert session.last_turn.context_full  # the reply stopped at the end of the context
    assert session.last_turn.prompt_tokens + session.last_turn.new_tokens - 1 <= 40
    with pytest.raises(ContextFullError, match=r"has \d+ tokens and the context holds 40"):
        session.send(TURNS[1])
    session.reset()
    session.send("Hi")  # fits again after /reset


def test_bad_inputs(tmp_path, chat_model, chat_tokenizer):
    no_template = text.load_tokenizer(write_checkpoint(tmp_path / "plain", chat_template=False))
    with pytest.raises(text.ChatTemplateError, match="no chat template"):
        ChatSession(chat_model, no_template)
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"empty content"):
        session.send("   ")
    with pytest.raises(TypeError, match=r"content'\] must be a str"):
        session.send(None)
    with pytest.raises(ValueError, match="max_context"):
        ChatSession(chat_model, chat_tokenizer, max_context=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ChatSession(chat_model, chat_tokenizer, max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        ChatSession(chat_model, chat_tokenizer,
                    sampling=sampling_params(chat_tokenizer.generation_config, top_p=0.0))
    assert session.messages == []  # nothing was added by the refused turns
