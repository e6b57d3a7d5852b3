"""ChatSession turns that end early or overlap: a stream closed mid-reply, a new message
sent while an earlier stream is still open, a Ctrl-C inside a step; and what later turns
compile (nothing: the prefill runs in chunks of one shape, compiled in the first turn)."""

from __future__ import annotations

import jax
import pytest

from forge_jax.generation import loop as generation
from forge_jax.generation import steps as steps_lib
from forge_jax.text import api as text
from forge_jax.text.chat_session import ChatSession

TURNS = ["Hello there! How are you today?", "Tell me a story about a small robot.",
         "Caf\u00e9 cr\u00e8me? \U0001f642 na\u00efve fa\u00e7ade"]
# Later turns whose new tokens fall in different power-of-two buckets (32 to 128).
VARIED = ["Hi", "Tell me a story about a small robot who learns to paint.",
          "The quick brown fox jumps over the lazy dog. " * 3,
          "Numbers 0123456789 and symbols (){}[]<>+-*/=_.,;:!? " * 4, "Thanks!"]


def _fresh_reply(chat_model, chat_tokenizer, history, max_new_tokens):
    """The reply to ``history`` prefilled from scratch (greedy), as the session must give."""
    return text.chat(chat_model, chat_tokenizer, history, max_new_tokens=max_new_tokens)


@pytest.fixture
def backend_compiles():
    """A list that collects one entry per XLA backend compilation while the test runs."""
    compiles = []

    def listener(name, duration, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield compiles
    jax.monitoring.unregister_event_duration_listener(listener)


def test_send_while_a_stream_is_open_ends_that_turn_first(chat_model, chat_tokenizer):
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=8)
    stream = session.stream(TURNS[0])
    partial = next(stream)
    reply = session.send(TURNS[1])  # the open stream is closed, its reply so far kept
    history = [{"role": "user", "content": TURNS[0]},
               {"role": "assistant", "content": partial},
               {"role": "user", "content": TURNS[1]}]
    assert session.messages == [*history, {"role": "assistant", "content": reply}]
    assert reply == _fresh_reply(chat_model, chat_tokenizer, history, 8)
    assert session.last_turn.reused_tokens > 0
    with pytest.raises(StopIteration):
        next(stream)  # the old turn is over
    # A stream that was never started is dropped, its message with it.
    unstarted = session.stream(TURNS[2])
    session.reset()  # closes it too
    assert list(unstarted) == [] and session.messages == []
    assert session.send(TURNS[0]) == _fresh_reply(
        chat_model, chat_tokenizer, [{"role": "user", "content": TURNS[0]}], 8)


@pytest.mark.parametrize("pieces", [1, 2, 5])
def test_closing_a_stream_keeps_the_reply_so_far_and_the_cache_consistent(
        chat_model, chat_tokenizer, pieces):
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=12)
    session.send(TURNS[0])
    stream = session.stream(TURNS[1])
    taken = [next(stream) for _ in range(pieces)]
    stream.close()
    stats = session.last_turn
    assert stats.stopped and 0 < stats.new_tokens < 12
    assert session.messages[-1] == {"role": "assistant", "content": "".join(taken)}
    history = [*session.messages, {"role": "user", "content": TURNS[2]}]
    assert session.send(TURNS[2]) == _fresh_reply(chat_model, chat_tokenizer, history, 12)
    assert not session.last_turn.stopped and session.last_turn.reused_tokens > 0


@pytest.mark.parametrize("at_call", [1, 3])
def test_an_interrupt_inside_a_step_leaves_the_session_usable(chat_model, chat_tokenizer,
                                                              monkeypatch, at_call):
    """Ctrl-C while a decode step runs: its inputs were donated (deleted) and its outputs
    are lost. The turn ends with the reply so far; the next turn is the reply a fresh
    prefill of the conversation gives."""
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=10)
    session.send(TURNS[0])
    real, calls = steps_lib.decode_step, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        out = real(*args, **kwargs)
        if len(calls) == at_call:
            jax.block_until_ready(out)
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(steps_lib, "decode_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.send(TURNS[1])
    monkeypatch.setattr(steps_lib, "decode_step", real)
    assert session.last_turn.stopped
    assert session.messages[-2] == {"role": "user", "content": TURNS[1]}
    history = [*session.messages, {"role": "user", "content": TURNS[2]}]
    assert session.send(TURNS[2]) == _fresh_reply(chat_model, chat_tokenizer, history, 10)


def test_later_turns_compile_nothing(chat_model, chat_tokenizer, backend_compiles):
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=4)
    session.send(TURNS[0])
    first = session.last_turn
    prefilled, compiled, stats = [], [], []
    for turn in VARIED:
        before = len(backend_compiles)
        session.send(turn)
        compiled.append(len(backend_compiles) - before)
        prefilled.append(session.last_turn.prefilled_tokens)
        stats.append(session.last_turn)
    assert len({generation.prompt_bucket(n) for n in prefilled}) >= 3  # several buckets
    assert compiled == [0] * len(VARIED), f"turns prefilling {prefilled} tokens compiled"
    assert all(s.compile_seconds == 0.0 for s in stats)
    # The first turn compiled (or, compiled earlier in this process, warmed up) the steps,
    # timed apart from its time to first token and decode steps.
    assert first.compile_seconds > 0 and first.decode_steps == 3


def test_warm_up_compiles_before_the_first_turn(chat_model, chat_tokenizer, backend_compiles):
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=4, prefill_chunk=8)
    assert session.warm_up() > 0
    history = [{"role": "user", "content": VARIED[2]}]
    want = _fresh_reply(chat_model, chat_tokenizer, history, 4)  # (generate's own compiles)
    before = len(backend_compiles)
    assert session.send(VARIED[2]) == want
    assert session.last_turn.compile_seconds == 0.0 and len(backend_compiles) == before
    assert session.last_turn.prefilled_tokens > 3 * 8  # several chunks of 8


def test_chunked_prefill_gives_the_replies_of_one_prefill(chat_model, chat_tokenizer):
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=6, prefill_chunk=8,
                          system="You are a helpful robot.")
    history = [{"role": "system", "content": "You are a helpful robot."}]
    for turn in VARIED[1:4]:
        history.append({"role": "user", "content": turn})
        reply = session.send(turn)
        assert reply == _fresh_reply(chat_model, chat_tokenizer, history, 6)
        history.append({"role": "assistant", "content": reply})
    with pytest.raises(ValueError, match="prefill_chunk"):
        ChatSession(chat_model, chat_tokenizer, prefill_chunk=0)
