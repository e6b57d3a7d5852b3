"""The text API: tokenizer loading, chat templates (against transformers'
apply_chat_template), generation_config.json, generate_text / chat and streaming, on a
small checkpoint with a real BPE tokenizer (tests/chat_checkpoint.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cases.chat_checkpoint import TEMPLATE, write_checkpoint

from forge_jax.generation import SamplingParams, sampling_params
from forge_jax.models import llama
from forge_jax.text import api as text

CONVERSATION = [{"role": "system", "content": "You are a helpful robot."},
                {"role": "user", "content": "Hello there! How are you today?"},
                {"role": "assistant", "content": "I am fine, thank you."},
                {"role": "user", "content": "Tell me a story about caf\u00e9 \U0001f642"}]


@pytest.fixture(scope="module")
def hf_tokenizer(chat_checkpoint):
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    return transformers.AutoTokenizer.from_pretrained(str(chat_checkpoint))


def _ids(out):
    """apply_chat_template(tokenize=True) returns ids or, in newer releases, a mapping."""
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def test_chat_template_matches_transformers(chat_tokenizer, hf_tokenizer):
    for messages in (CONVERSATION, CONVERSATION[1:2], CONVERSATION[:3]):
        for add in (True, False):
            want = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=add)
            assert chat_tokenizer.apply_chat_template(messages, add_generation_prompt=add) == want
            want_ids = _ids(hf_tokenizer.apply_chat_template(messages, tokenize=True,
                                                             add_generation_prompt=add))
            assert text.encode_chat(chat_tokenizer, messages, add_generation_prompt=add) == want_ids
    assert want.startswith("<s><|im_start|>system\n")  # bos_token reached the template
    prompt = "Caf\u00e9 \u65e5\u672c\u8a9e \U0001f680 fox"
    assert chat_tokenizer.encode(prompt) == hf_tokenizer(prompt)["input_ids"]
    assert chat_tokenizer.encode(prompt)[0] == chat_tokenizer.backend.token_to_id("<s>")


def test_template_from_chat_template_jinja_and_named_list(tmp_path, chat_tokenizer):
    path = write_checkpoint(tmp_path / "a", chat_template=False)
    (path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]"
                                              "{{ m['content'] | tojson }}{% endfor %}")
    tok = text.load_tokenizer(path)
    assert tok.apply_chat_template(CONVERSATION[1:2]) == '[user]"Hello there! How are you today?"'
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"},
                               {"name": "default", "template": TEMPLATE}]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink()
    assert text.load_tokenizer(path).apply_chat_template(CONVERSATION) == \
        chat_tokenizer.apply_chat_template(CONVERSATION)


def test_chat_errors_are_clear(tmp_path, chat_model, chat_tokenizer):
    no_template = text.load_tokenizer(write_checkpoint(tmp_path / "plain", chat_template=False))
    with pytest.raises(text.ChatTemplateError, match="has no chat template"):
        text.chat(chat_model, no_template, CONVERSATION[1:2], max_new_tokens=2)
    with pytest.raises(text.ChatTemplateError, match="must not start with the assistant"):
        chat_tokenizer.apply_chat_template(CONVERSATION[2:])  # the template's raise_exception
    bad = [([{"role": "usr", "content": "hi"}], r"messages\[0\]\['role'\] is 'usr'; known"),
           ([*CONVERSATION[:1], {"role": "user", "content": " "}], r"messages\[1\] .*empty"),
           ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a str"),
           ([], "non-empty list"), ("hello", "non-empty list"),
           (["hello"], r"messages\[0\] must be a dict")]
    for messages, match in bad:
        with pytest.raises((ValueError, TypeError), match=match):
            text.chat(chat_model, chat_tokenizer, messages, max_new_tokens=2)
    # A reply may be empty (the model said eos first); the conversation goes on.
    text.check_messages([*CONVERSATION[:2], {"role": "assistant", "content": ""}])
    with pytest.raises(llama.CheckpointError, match="no tokenizer.json"):
        text.load_tokenizer(tmp_path)
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a str"):
        text.generate_text(chat_model, chat_tokenizer, ["ok", 3])


def test_generate_text_and_chat_match_transformers(chat_checkpoint, chat_model, chat_tokenizer,
                                                   hf_tokenizer):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(chat_checkpoint), dtype=torch.float32)
    eos = chat_tokenizer.backend.token_to_id("<|im_end|>")

    def hf_generate(ids, n):
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
        return hf_tokenizer.decode(out, skip_special_tokens=True)

    prompt = "Hello there! How are"
    assert text.generate_text(chat_model, chat_tokenizer, prompt, max_new_tokens=12) == \
        hf_generate(hf_tokenizer(prompt)["input_ids"], 12)
    ids = _ids(hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=True,
                                                add_generation_prompt=True))
    assert text.chat(chat_model, chat_tokenizer, CONVERSATION,
                     max_new_tokens=12) == hf_generate(ids, 12)


def test_streaming_equals_non_streaming(chat_model, chat_tokenizer):
    prompts = ["The quick brown", "\u65e5\u672c\u8a9e\u306e caf\u00e9"]
    pieces = {0: [], 1: []}
    streamed = text.generate_text(chat_model, chat_tokenizer, prompts, max_new_tokens=16,
                                  stream=lambda i, piece: pieces[i].append(piece))
    assert streamed == text.generate_text(chat_model, chat_tokenizer, prompts, max_new_tokens=16)
    assert ["".join(pieces[i]) for i in (0, 1)] == streamed
    assert all(len(pieces[i]) > 1 for i in (0, 1)), pieces
    chat_pieces = []
    reply = text.chat(chat_model, chat_tokenizer, CONVERSATION, max_new_tokens=10,
                      stream=chat_pieces.append)
    assert "".join(chat_pieces) == reply == text.chat(chat_model, chat_tokenizer, CONVERSATION,
                                                      max_new_tokens=10)


def test_text_streamer_holds_back_split_characters(chat_tokenizer):
    """Characters of 2-4 bytes spread over several byte-level tokens come out whole."""
    sentence = "na\u00efve \u65e5\u672c\u8a9e\u306e\u6587\u7ae0 \U0001f642\U0001f680 fa\u00e7ade"
    ids = chat_tokenizer.encode(sentence, add_special_tokens=False)
    assert len(ids) > len(sentence.split())  # several tokens per word
    single = [chat_tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in s for s in single)  # some tokens hold a partial character
    pieces = []
    streamer = text.TextStreamer(chat_tokenizer, 1, eos=[], on_text=lambda b, p: pieces.append(p))
    for i, token in enumerate(ids):
        streamer(i, np.asarray([token]))
    assert "".join(pieces) == sentence
    assert not any("\ufffd" in p for p in pieces)


def test_generation_config_defaults_and_overrides(tmp_path, chat_model, chat_tokenizer):
    greedy = text.generate_text(chat_model, chat_tokenizer, "The quick brown", max_new_tokens=12)
    ids = text.generate_ids(chat_model, chat_tokenizer, [chat_tokenizer.encode("The quick brown")],
                            max_new_tokens=12)[1][0]
    # An eos id from generation_config.json: the first token that appears after position 0.
    stop = next(i for i, t in enumerate(ids) if i > 0 and t not in ids[:i])
    path = write_checkpoint(tmp_path / "g", generation_config={
        "eos_token_id": [ids[stop], 9999], "do_sample": True, "temperature": 0.7,
        "top_k": 5, "top_p": 0.9, "max_new_tokens": 12})
    tok = text.load_tokenizer(path)
    assert tok.generation_config.eos_token_id == (ids[stop], 9999)
    greedy_sampling = SamplingParams(temperature=0.0)
    out = text.generate_ids(chat_model, tok, [tok.encode("The quick brown")],
                            sampling=greedy_sampling)[1][0]
    assert out == ids[:stop + 1]  # its eos ids, its max_new_tokens
    pieces = []  # streaming stops at that eos too
    stopped = text.generate_text(chat_model, tok, "The quick brown", sampling=greedy_sampling,
                                 stream=lambda i, piece: pieces.append(piece))
    assert "".join(pieces) == stopped == chat_tokenizer.decode(ids[:stop]) != greedy
    assert text.generate_text(chat_model, tok, "The quick brown", sampling=greedy_sampling,
                              eos_token_id=[]) == greedy
    # Sampling defaults from the file, overridable one by one.
    sampled = text.generate_text(chat_model, tok, "The quick brown", eos_token_id=[],
                                 sampling=sampling_params(tok.generation_config, seed=3))
    explicit = dict(sampling=SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3),
                    max_new_tokens=12, generation_config=text.GenerationConfig())
    assert sampled == text.generate_text(chat_model, chat_tokenizer, "The quick brown", **explicit)
    assert sampled != greedy
    (path / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    with pytest.raises(llama.CheckpointError, match=r"generation_config.json: top_p"):
        text.load_tokenizer(path)
