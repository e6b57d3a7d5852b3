"""Exports a model's prefill and decode steps (:mod:`forge_jax.generation.steps`) as
``jax.export`` artifacts that :func:`forge_jax.generation.exported.load` runs without the
model code.

The steps are exported with greedy decoding over a contiguous KV cache of ``context``
positions per sequence, for ``batch`` sequences of prompts up to ``prompt_length`` tokens.
Their arguments are flat tuples of arrays (:func:`forge_jax.generation.exported.step_trees`): the
weights (saved beside the steps with safetensors), the cache's leaves, the inputs, so that
no pytree class of the model's is needed to call them.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import forge_jax as fj
from forge_jax import _compat, aot
from forge_jax import targets as targets_lib
from forge_jax.generation import exported as programs
from forge_jax.generation import loop as generation
from forge_jax.generation import steps
from forge_jax.kv_cache import ContiguousKVCache, cache_geometry
from forge_jax.models.llama_model import Llama

KEY_IMPL = "threefry2x32"
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def check_shapes(model: Llama, *, batch: int, context: int | None,
                 prompt_length: int | None) -> tuple[int, int, int]:
    """(batch, context, prompt_length) with the defaults filled in (context: the model's
    ``max_position_embeddings``; prompt_length: half the context); ValueError naming the
    argument for a value that does not fit."""
    limit = model.config.max_position_embeddings
    context = limit if context is None else context
    for name, value in (("batch", batch), ("context", context)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    if context > limit:
        raise ValueError(f"context={context} exceeds the model's max_position_embeddings="
                         f"{limit}")
    prompt_length = max(context // 2, 1) if prompt_length is None else prompt_length
    if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) \
            or not 0 < prompt_length < context:
        raise ValueError(f"prompt_length must be an int in [1, context={context}), got "
                         f"prompt_length={prompt_length!r}")
    return batch, context, prompt_length


def check_platforms(platforms: Sequence[str]) -> tuple[str, ...]:
    platforms = tuple(platforms)
    bad = [p for p in platforms if p not in PLATFORMS]
    if not platforms or bad or len(set(platforms)) != len(platforms):
        raise ValueError(f"platforms must be distinct names among {PLATFORMS}, got "
                         f"platforms={platforms!r}")
    return platforms


def _entry(name: str | None, x) -> dict:
    entry = {"shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name}
    return entry if name is None else {"name": name, **entry}


def export(model: Llama, out: str | pathlib.Path, *, batch: int = 1,
           context: int | None = None, prompt_length: int | None = None,
           platforms: Sequence[str] = ("cpu",), cache_dtype=None, executable: bool = False,
           targets: Sequence[str] = (),
           tokenizer: str | os.PathLike | Any | None = None) -> pathlib.Path:
    """Writes ``model``'s greedy prefill and decode steps to the directory ``out`` (see
    :mod:`forge_jax.generation.exported` for its files).

    The files are written into a temporary directory beside ``out``, moved into place only
    once all of them are: a failure (an error, Ctrl-C) leaves no half-written program.

    Args:
      model: an unsharded :class:`Llama`.
      out: the directory to write (``~`` expanded): a new or empty directory, or an earlier
        export, which is replaced whole. Any other directory is refused (ValueError).
      batch: sequences per call.
      context: KV cache positions per sequence (prompt plus new tokens); default the
        model's ``max_position_embeddings``.
      prompt_length: the prefill's padded prompt length; default ``context // 2``.
      platforms: ``jax.export`` lowering platforms. Ops are lowered with the
        implementations chosen for this machine when it is the only platform; for others
        every op uses its XLA implementation, which lowers for all of them.
      cache_dtype: the KV cache's dtype; default the model's compute dtype.
      executable: also write the steps compiled for this machine's CPU
        (``jax.experimental.serialize_executable``); needs ``"cpu"`` in ``platforms``.
      targets: names of :data:`forge_jax.targets.TARGETS` (e.g. ``"h100"``, ``"tpu-v5e"``):
        also write the steps compiled for each of them on this machine, without the
        device (:mod:`forge_jax.aot`'s deviceless compile, the ``aot`` extra), with the
        kernels auto selection picks there. Such an executable runs only on that device
        kind, with the JAX and jaxlib that compiled it (:func:`forge_jax.generation.exported.load`
        refuses it elsewhere).
      tokenizer: a ``tokenizer.json`` to copy beside the program, or a
        ``tokenizers.Tokenizer`` to save there (a GGUF file's, built from its metadata;
        a :class:`forge_jax.text.Tokenizer`'s ``backend``). None: none; then the program
        takes token ids only. Its post-processor decides whether a text prompt starts with
        a BOS token, for the program as for the live model
        (:func:`forge_jax.generation.prompts.encode_prompt`).

    Returns:
      The directory's path.
    """
    if model.mesh is not None:
        raise ValueError("export takes an unsharded model (model.mesh is "
                         f"{model.mesh.describe()}); load it without mesh=")
    batch, context, prompt_length = check_shapes(model, batch=batch, context=context,
                                                 prompt_length=prompt_length)
    platforms = check_platforms(platforms)
    if executable and "cpu" not in platforms:
        raise ValueError(f"executable=True compiles for CPU; platforms={platforms!r} has no "
                         f"'cpu'")
    targets = check_targets(targets)
    out = check_out(out)
    tokenizer = _check_tokenizer(tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=PARTIAL,
                                         dir=out.parent))
    try:
        _write(model, work, batch=batch, context=context, prompt_length=prompt_length,
               platforms=platforms, cache_dtype=cache_dtype, executable=executable,
               targets=targets, tokenizer=tokenizer)
        _move_into_place(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out


PARTIAL = programs.PARTIAL  # the temporary directory's suffix, which load recognizes


def check_out(out: str | os.PathLike) -> pathlib.Path:
    """``out`` (``~`` expanded) if an export may write it: absent, an empty directory or
    an earlier export (it has a ``manifest.json``); ValueError naming it otherwise."""
    path = pathlib.Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"out={str(out)!r} is a file; give a directory to write")
    if path.is_dir() and any(path.iterdir()) and not (path / programs.MANIFEST).is_file():
        raise ValueError(f"out={str(out)!r} is a non-empty directory that is not an exported "
                         f"program (no {programs.MANIFEST}); give a new or empty directory")
    return path


def _check_tokenizer(tokenizer):
    """A tokenizer file's path (checked to exist) or a ``tokenizers.Tokenizer`` (a
    :class:`forge_jax.text.Tokenizer` unwrapped to its backend), or None."""
    if tokenizer is None:
        return None
    tokenizer = getattr(tokenizer, "backend", tokenizer)
    if hasattr(tokenizer, "to_str"):
        return tokenizer
    if not isinstance(tokenizer, str | os.PathLike):
        raise TypeError(f"tokenizer must be a tokenizer.json path, a tokenizers.Tokenizer or "
                        f"None, got {tokenizer!r:.80}")
    path = pathlib.Path(tokenizer).expanduser()
    if not path.is_file():
        raise ValueError(f"tokenizer={str(tokenizer)!r} is not a file")
    return path


def _move_into_place(work: pathlib.Path, out: pathlib.Path) -> None:
    """Renames the complete program ``work`` to ``out``, replacing an earlier export
    (moved aside first, then deleted)."""
    if out.is_dir():
        old = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old",
                                            dir=out.parent))
        os.replace(out, old / out.name)
        try:
            os.replace(work, out)
        except BaseException:
            os.replace(old / out.name, out)
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(work, out)


def _write(model: Llama, out: pathlib.Path, *, batch, context, prompt_length, platforms,
           cache_dtype, executable, targets, tokenizer) -> None:
    """Writes the program's files into the directory ``out`` (the arguments checked)."""
    config = model.config
    graphdef, state = nnx.split(model)
    # XLA everywhere unless the program is for this machine's platform alone: a kernel
    # picked here (a Pallas GPU kernel) would not lower for the other platforms.
    here_only = platforms == (jax.default_backend(),)
    with fj.use_implementation(None if here_only else "xla"):
        statics = steps.step_statics(graphdef, greedy=True)
    cache = ContiguousKVCache.create(
        **cache_geometry(config), batch=batch, max_len=context, kv_heads=model.kv_heads,
        dtype=model.dtype if cache_dtype is None else cache_dtype)
    named_weights = jax.tree_util.tree_flatten_with_path(state)[0]
    state_tree = jax.tree_util.tree_structure(state)
    cache_leaves, cache_tree = jax.tree_util.tree_flatten(cache)

    spec = jax.ShapeDtypeStruct
    weights = tuple(spec(w.shape, w.dtype) for _, w in named_weights)
    kv = tuple(spec(x.shape, x.dtype) for x in cache_leaves)
    key = spec((2,), jnp.uint32)
    sampling = (spec((), jnp.float32), spec((), jnp.int32), spec((), jnp.float32),
                spec((), jnp.float32), spec((), jnp.float32))
    seen = spec((batch, config.vocab_size), jnp.bool_)
    rows_i32, rows_bool = spec((batch,), jnp.int32), spec((batch,), jnp.bool_)
    args = {"prefill": (weights, kv, spec((batch, prompt_length), jnp.int32), rows_i32, key,
                        sampling, seen),
            "decode": (weights, kv, rows_i32, rows_bool, key, spec((), jnp.int32), sampling,
                       seen)}
    fns = _step_fns(statics, state_tree, cache_tree)
    manifest_steps, cpu_files, target_entries = {}, {}, {}
    with fj.use_implementation(None if here_only else "xla"):
        for name in programs.STEPS:
            exported = _compat.export_for(fns[name], platforms, *args[name])
            (out / programs.step_file(name)).write_bytes(exported.serialize())
            manifest_steps[name] = {
                "file": programs.step_file(name),
                "in_shapes": [_entry(None, a) for a in exported.in_avals],
                "out_shapes": [_entry(None, a) for a in exported.out_avals]}
            if executable:
                cpu_files[name] = _serialize_cpu(fns[name], args[name], out, name,
                                                 len(weights), len(kv))
    for target in targets:
        target_entries[target.name] = _serialize_for_target(
            target, graphdef, state_tree, cache_tree, args, out, len(weights), len(kv))
    _save_weights(out, named_weights)
    if isinstance(tokenizer, pathlib.Path):
        shutil.copyfile(tokenizer, out / programs.TOKENIZER)
    elif tokenizer is not None:
        tokenizer.save(str(out / programs.TOKENIZER))
    manifest = {
        "format": programs.FORMAT,
        "forge_jax": fj.__version__,
        **programs.versions(),
        "platforms": list(platforms),
        "implementations": "auto" if here_only else "xla",
        "batch": batch, "context": context, "prompt_length": prompt_length,
        "vocab_size": config.vocab_size,
        "decoding": "greedy",
        "key_impl": KEY_IMPL,
        "eos_token_ids": list(generation.default_eos_token_ids(model)),
        "bos_token_id": config.bos_token_id,
        "tokenizer": programs.TOKENIZER if tokenizer is not None else None,
        "steps": manifest_steps,
        "cache": [_entry(None, x) for x in cache_leaves],
        "weights": {"file": programs.WEIGHTS,
                    "tensors": [_entry(jax.tree_util.keystr(p), w) for p, w in named_weights]},
    }
    if executable:
        target_entries["cpu"] = {"platform": "cpu", **programs.versions(), "files": cpu_files}
    if target_entries:
        manifest["executables"] = target_entries
    # The manifest last: a directory without one is not a program (load says so).
    (out / programs.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def check_targets(names: Sequence[str]) -> tuple[targets_lib.Target, ...]:
    """The named compile targets, each one this environment can compile for; ValueError
    naming the target otherwise (an unknown name, a repeated one, a missing extra)."""
    if isinstance(names, str):
        raise ValueError(f"targets must be a sequence of names, got the string {names!r}")
    found = tuple(targets_lib.get(n) for n in names)
    if len({t.name for t in found}) != len(found):
        raise ValueError(f"targets must be distinct, got {tuple(names)!r}")
    for t in found:
        reason = targets_lib.missing(t)
        if reason is not None:
            raise ValueError(f"cannot compile for target {t.name}: {reason}")
    return found


def _step_fns(statics, state_tree, cache_tree) -> dict[str, Any]:
    """The prefill and decode steps over the program's flat arguments
    (:func:`forge_jax.generation.exported.step_trees`)."""

    def prefill(weights, kv, tokens, lengths, key_data, sampling, seen):
        new, seen, kv = steps.prefill_step(
            state_tree.unflatten(weights), cache_tree.unflatten(kv), tokens, lengths,
            jax.random.wrap_key_data(key_data, impl=KEY_IMPL),
            dict(zip(programs.SAMPLING, sampling, strict=True)), seen, **statics)
        return new, seen, tuple(jax.tree_util.tree_leaves(kv))

    def decode(weights, kv, tokens, active, key_data, step, sampling, seen):
        new, seen, kv = steps.decode_step(
            state_tree.unflatten(weights), cache_tree.unflatten(kv), tokens, active,
            jax.random.wrap_key_data(key_data, impl=KEY_IMPL), step,
            dict(zip(programs.SAMPLING, sampling, strict=True)), seen, **statics)
        return new, seen, tuple(jax.tree_util.tree_leaves(kv))

    return {"prefill": prefill, "decode": decode}


# The cache (argument 1) is updated in place; decode's `seen` (its last argument) too.
_DONATE = {"prefill": (1,), "decode": (1, 7)}


def _serialize(compiled, out: pathlib.Path, name: str, file: str, num_weights: int,
               num_cache: int) -> str:
    """Writes a compiled step's serialized executable to ``out / file``; returns ``file``."""
    from jax.experimental import serialize_executable

    data, in_tree, out_tree = serialize_executable.serialize(compiled)
    # The loader rebuilds the trees from the manifest's counts: they must be these.
    expected = programs.step_trees(name, num_weights, num_cache)
    if (in_tree, out_tree) != expected:
        raise AssertionError(f"{name}: compiled trees {in_tree}, {out_tree} are not the "
                             f"program's {expected}")
    (out / file).write_bytes(data)
    return file


def _serialize_for_target(target, graphdef, state_tree, cache_tree, args, out: pathlib.Path,
                          num_weights: int, num_cache: int) -> dict[str, Any]:
    """Compiles both steps for ``target`` without its device, as auto selection would pick
    the kernels there, and writes their executables; returns the manifest's entry."""
    device = target.device
    files = {}
    with targets_lib.use(target), jax.default_device(device), fj.use_implementation(None):
        statics = steps.step_statics(graphdef, greedy=True)
        fns = _step_fns(statics, state_tree, cache_tree)
        for name in programs.STEPS:
            placed = aot.abstract(args[name], device)
            compiled = jax.jit(fns[name], donate_argnums=_DONATE[name]).lower(
                *placed).compile()
            files[name] = _serialize(compiled, out, name,
                                     programs.executable_file(name, target.name),
                                     num_weights, num_cache)
    return {"platform": target.platform, "device_kind": target.device_kind,
            **programs.versions(), "files": files}


def _save_weights(out: pathlib.Path, named_weights) -> None:
    """The weights with safetensors (never pickle), named by their path in the model's
    state; bfloat16 as its uint16 bits (safetensors' NumPy API has no bfloat16)."""
    from safetensors.numpy import save_file

    tensors = {}
    for path, w in named_weights:
        array = np.asarray(w)
        if array.dtype == jnp.bfloat16:
            array = array.view(np.uint16)
        tensors[jax.tree_util.keystr(path)] = np.ascontiguousarray(array)
    save_file(tensors, str(out / programs.WEIGHTS))


def _serialize_cpu(fn, args, out: pathlib.Path, name: str, num_weights: int,
                   num_cache: int) -> str:
    """Compiles ``fn`` for this machine's CPU and writes its serialized executable; returns
    the file's name."""
    placed = aot.abstract(args, jax.devices("cpu")[0])
    compiled = jax.jit(fn, donate_argnums=_DONATE[name]).lower(*placed).compile()
    return _serialize(compiled, out, name, programs.executable_file(name, "cpu"), num_weights,
                      num_cache)
