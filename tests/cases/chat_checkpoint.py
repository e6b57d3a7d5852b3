"""A small Llama chat checkpoint written by the tests: random weights, a byte-level BPE
tokenizer trained with ``tokenizers`` on a few sentences (accents, CJK and an emoji among
them, so that characters span several tokens), special tokens, a ChatML chat template
with ``bos_token`` and ``raise_exception``, and a generation_config.json."""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from forge_jax.models import llama

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('Conversations must not start with the assistant') }}{% endif %}"
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello there! How are you today? I am fine, thank you.",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve fa\u00e7ade, \u00fcber gro\u00df.",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3002\u4e2d\u6587\u53e5\u5b50\u3002"
    " \U0001f642 \U0001f680",
    "user assistant system: tell me a story about a small robot who learns to paint.",
    "Numbers 0123456789 and symbols (){}[]<>+-*/=_.,;:!?",
] * 20


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return tok


def write_checkpoint(directory: pathlib.Path, *, chat_template: bool = True,
                     generation_config: dict | None = None, seed: int = 0,
                     sizes: dict | None = None) -> pathlib.Path:
    """Writes the checkpoint to ``directory`` (``sizes``: config.json entries replaced, e.g.
    a smaller draft model of the same vocabulary); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(directory / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    eos_token = {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False,
                 "normalized": False, "rstrip": False, "single_word": False, "special": True}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                        "eos_token": eos_token,
                        "model_max_length": 512}
    if chat_template:
        tokenizer_config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, bos_token_id=tok.token_to_id("<s>"),
                  eos_token_id=eos, torch_dtype="float32")
    config.update(sizes or {})
    (directory / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    model = llama.Llama(llama.LlamaConfig.from_hf(config), rngs=nnx.Rngs(seed))
    gen = np.random.default_rng(seed)
    # Weights large enough that the logits are far from uniform (no near-ties in argmax).
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param):
            shape = param[...].shape
            scale = 0.3 if len(shape) > 1 else 0.1
            value = gen.normal(0.0, scale, shape) + (1.0 if "norm" in str(path) else 0.0)
            param.set_value(jnp.asarray(value, jnp.float32))
    save_file({k: np.ascontiguousarray(v) for k, v in llama.hf_state_dict(model).items()},
              str(directory / "model.safetensors"))
    return directory
