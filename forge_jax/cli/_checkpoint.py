"""The checkpoint a command runs: read without its weights (so that the inputs are checked
before the model is loaded), and the loaded model described in one line."""

from __future__ import annotations

import argparse

from forge_jax.cli._run import UsageError


def _tiny_dir():
    import pathlib

    import forge_jax.models

    return pathlib.Path(forge_jax.models.__file__).parent / "tiny"


def add_flags(parser: argparse.ArgumentParser, *, required: bool = False, help: str) -> None:
    parser.add_argument("--checkpoint", metavar="DIR|ORG/NAME", required=required,
                        help=help + "; or a llama.cpp GGUF file (.gguf, loaded as it is "
                             "quantized, with its own tokenizer); or a Hugging Face Hub "
                             "repository id, fetched into (with "
                             "HF_HUB_OFFLINE=1: read from) the huggingface_hub cache (a local "
                             "directory of that name wins)")
    parser.add_argument("--revision", default=None,
                        help="the Hub revision of --checkpoint ORG/NAME (branch, tag or commit; "
                             "default main)")
    parser.add_argument("--quantize", choices=("int8", "int4", "fp8"), default=None,
                        help="quantize the linear layers' weights (and a mixture of experts' "
                             "experts) as they load (the embedding, norms and routers stay as "
                             "they are); on CPU the quantized products are "
                             "slower than float32's (BENCHMARKS.md), so it is never a default")
    parser.add_argument("--group-size", type=int, default=None, metavar="N",
                        help="values per scale along a weight's in axis with --quantize "
                             "(int4 default 32; int8 and fp8: one scale per output channel)")


def quantize_kwargs(args: argparse.Namespace, config) -> dict:
    """``from_pretrained``'s ``quantize`` and ``group_size`` from ``--quantize`` and
    ``--group-size``, checked against the config before the model loads."""
    quantize, group = getattr(args, "quantize", None), getattr(args, "group_size", None)
    if quantize is None:
        if group is not None:
            raise UsageError(f"--group-size {group} needs --quantize")
        return {}
    if str(getattr(args, "checkpoint", None) or "").endswith(".gguf"):
        raise UsageError(f"--quantize: {args.checkpoint} is a GGUF file, loaded as it is "
                         f"quantized")
    if group is not None:
        ins = _quantized_in_features(config)
        if group <= 0 or group % 2 or any(n % group for n in ins):
            raise UsageError(f"--group-size {group} must be a positive even number dividing "
                             f"the layers' in features {sorted(ins)}")
    return {"quantize": quantize, "group_size": group}


def _quantized_in_features(config) -> set[int]:
    """The in features of the weights ``--quantize`` quantizes: a family of its own says
    (``config.quantized_in_features``: DeepSeek-V3, Gemma 4, the delta-rule hybrids); the
    Llama family's from its sizes."""
    own = getattr(config, "quantized_in_features", None)
    if own is not None:
        return set(own)
    ins = {config.hidden_size, config.intermediate_size,
           config.num_attention_heads * config.head_dim}
    if config.num_experts:  # the experts' (and a shared expert's) in features too
        ins |= {n for n in (config.moe_intermediate_size,
                            config.shared_expert_intermediate_size) if n}
    return ins


def checkpoint_path(args: argparse.Namespace):
    """The local directory of ``--checkpoint`` (a Hub name resolved through the cache);
    ``--quantize`` with a GGUF file is refused here, before the file is read."""
    from forge_jax.models.checkpoints import gguf, hub

    if getattr(args, "quantize", None) and gguf.is_gguf(args.checkpoint):
        raise UsageError(f"--quantize: {args.checkpoint} is a GGUF file, loaded as it is "
                         f"quantized")
    return hub.resolve_checkpoint(args.checkpoint, revision=args.revision)


def read_checkpoint(args: argparse.Namespace):
    """(config, raw config dict, tokenizer or None, checkpoint path) for ``args.checkpoint``
    (default: the embedded tiny model): everything but the weights."""
    import json

    from forge_jax.models import llama

    path = checkpoint_path(args) if args.checkpoint else _tiny_dir()
    config = llama.load_config(path)  # errors name the problem
    if path.is_file():  # a GGUF file (load_config refuses other files): its own tokenizer
        from forge_jax.text import api as text

        if getattr(args, "quantize", None):
            raise UsageError(f"--quantize: {path} is a GGUF file, loaded as it is quantized")
        try:
            tokenizer = text.load_tokenizer(path).backend
        except llama.CheckpointError:
            tokenizer = None
        return config, {}, tokenizer, path
    raw = json.loads((path / "config.json").read_text())
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises its own exception types
            raise UsageError(f"cannot read {path / 'tokenizer.json'}: {e}") from None
    return config, raw, tokenizer, path


def require_llama(config, path, command: str) -> None:
    """Refuses, in one line naming the model type, a model of its own family (DeepSeek-V3,
    Gemma 4, Qwen3-Next): ``command`` (export, compile) builds Llama-family steps only."""
    from forge_jax.models.llama_config import LlamaConfig

    if not isinstance(config, LlamaConfig):
        kind = getattr(config, "model_type", None) or _MODEL_TYPES.get(type(config).__name__,
                                                                        type(config).__name__)
        raise UsageError(f"{path} is a {kind} model; {command} builds Llama-family models "
                         f"only (generate, chat and serve run it)")


_MODEL_TYPES = {"DeepseekV3Config": "deepseek_v3"}  # configs without a model_type field


def describe(model, path, args: argparse.Namespace) -> str:
    """``DIR: llama, 2 layers, hidden 64, ... M parameters, float32, paged cache`` (the
    family: config.json's model_type), and the mesh it is sharded over, if any."""
    import math

    import jax
    from flax import nnx

    from forge_jax.models.checkpoints import quantize as quantize_load

    c = model.config
    variables = jax.tree.leaves(nnx.state(model, nnx.Param),
                                is_leaf=lambda v: isinstance(v, nnx.Variable))
    params = sum(math.prod(v.get_value().shape) for v in variables)  # quantized: logical
    quantized = getattr(args, "quantize", None)
    # Beyond the model contract (protocol.ModelConfig) every field is optional.
    kind = getattr(c, "model_type", None) or _MODEL_TYPES.get(type(c).__name__, type(c).__name__)
    heads, kv_heads = (getattr(c, "num_attention_heads", None),
                       getattr(c, "num_key_value_heads", None))
    experts = getattr(c, "num_experts", None) or getattr(c, "n_routed_experts", None)
    return (f"{path}: {kind}, {c.num_hidden_layers} layers, "
            + (f"hidden {c.hidden_size}, " if getattr(c, "hidden_size", None) else "")
            + (f"{heads} heads / {kv_heads} KV heads, " if heads and kv_heads else "")
            + (f"{experts} experts (top {c.num_experts_per_tok}), " if experts else "")
            + "vocab "
            f"{c.vocab_size}, {params / 1e6:.2f} M parameters "
            f"({quantize_load.parameter_bytes(model) / 1e6:.1f} MB"
            + (f", {quantized} linear layers" if quantized else "") + f"), {args.dtype}, "
            f"{getattr(args, 'cache', 'paged')} cache"
            + ("" if model.mesh is None else
               f", sharded over {model.mesh.describe()} ({len(model.mesh.mesh.devices.flat)} "
               f"{model.mesh.mesh.devices.flat[0].platform.upper()} devices)"))
