"""Exported programs: a model's prefill and decode steps as ``jax.export`` artifacts, run
without the model code.

``forge-jax export`` (or :func:`forge_jax.generation.export.export`) writes a directory::

    manifest.json          shapes, dtypes, platforms, versions, eos ids, the files below
    prefill.jax_exported   jax.export's serialization (StableHLO) of the prefill step
    decode.jax_exported    ... of the decode step
    weights.safetensors    the weights, passed to both steps as arguments
    tokenizer.json         the checkpoint's tokenizer, when it has one
    prefill.cpu.executable, decode.cpu.executable
                           optional: the steps compiled for this machine's CPU
                           (``jax.experimental.serialize_executable``), valid only for the
                           JAX and jaxlib versions the manifest names. JAX's format for
                           them loads through pickle, and an executable is machine code
                           either way: load only programs you made or trust.
    prefill.h100.executable, decode.h100.executable, ...
                           optional: the steps compiled for a named target
                           (:mod:`forge_jax.targets`) without its device; they run only on
                           that device kind, with the JAX and jaxlib that compiled them.

:func:`load` reads it back with JAX, NumPy and safetensors alone (``forge_jax.models`` and
Flax are never imported) and :meth:`Program.generate` runs a generation loop over it::

    program = forge_jax.generation.exported.load("out/tiny")
    program.generate([[1, 5, 6]], max_new_tokens=8)      # token ids in, new ids out
    program.generate_text("12+34=", max_new_tokens=8)    # with the saved tokenizer

The weights are arguments of the steps rather than constants baked into the StableHLO: the
artifacts stay small (the steps are a few hundred KB whatever the model's size), one weights
file serves every exported shape and platform, and the weights are stored as safetensors
(never pickle) so any tool can read or replace them.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "forge-jax-program/1"
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
TOKENIZER = "tokenizer.json"
STEPS = ("prefill", "decode")
# The suffix of the directory an export writes before it moves it into place.
PARTIAL = ".partial"
# The sampling parameters the steps take, in order (SamplingParams.arrays()' names).
SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


class ProgramError(ValueError):
    """An exported program that cannot be loaded or run here (a missing or malformed file,
    another format, a platform or JAX version it was not built for, bad arguments)."""


def step_file(step: str) -> str:
    """The file of ``step``'s ``jax.export`` serialization."""
    return f"{step}.jax_exported"


def executable_file(step: str, platform: str) -> str:
    """The file of ``step``'s serialized executable compiled for ``platform``."""
    return f"{step}.{platform}.executable"


def step_trees(step: str, num_weights: int, num_cache: int) -> tuple[Any, Any]:
    """(input tree, output tree) of a step as exported: flat tuples, so that a reader needs
    no pytree class of the model's. Inputs: ``(weights, cache, tokens, lengths_or_active,
    key_data, [step,] sampling, seen)`` with weights, cache and sampling tuples of arrays;
    outputs ``(tokens, seen, cache)``. The input tree is jit's ``(args, kwargs)`` pair."""
    weights, cache = tuple(range(num_weights)), tuple(range(num_cache))
    sampling = tuple(range(len(SAMPLING)))
    if step == "prefill":
        args = (weights, cache, 0, 0, 0, sampling, 0)
    elif step == "decode":
        args = (weights, cache, 0, 0, 0, 0, sampling, 0)
    else:
        raise ValueError(f"step must be one of {STEPS}, got {step!r}")
    return (jax.tree_util.tree_structure((args, {})),
            jax.tree_util.tree_structure((0, 0, cache)))


def versions() -> dict[str, str]:
    """The JAX and jaxlib versions of this process (what an executable is tied to)."""
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def _spec(entry: dict) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(entry["shape"]), jnp.dtype(entry["dtype"]))


@dataclasses.dataclass(frozen=True)
class Program:
    """A loaded exported program. ``prefill`` and ``decode`` are the steps (``jax.jit`` of
    the exported calls, or the deserialized executables) over the flat arguments that
    :func:`step_trees` describes; :meth:`generate` runs them.

    Attributes:
      path: the program's directory.
      manifest: ``manifest.json``, parsed.
      weights: the weights in the steps' order.
      source: ``"stablehlo"`` or ``"executable"``: what the steps were loaded from.
    """

    path: pathlib.Path
    manifest: dict
    weights: tuple[jax.Array, ...]
    prefill: Callable[..., Any]
    decode: Callable[..., Any]
    source: str

    @property
    def batch(self) -> int:
        return self.manifest["batch"]

    @property
    def prompt_length(self) -> int:
        return self.manifest["prompt_length"]

    @property
    def context(self) -> int:
        return self.manifest["context"]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.manifest["eos_token_ids"])

    def new_cache(self) -> tuple[jax.Array, ...]:
        """An empty KV cache (every leaf zeros, lengths 0), as the steps take it."""
        return tuple(jnp.zeros(s.shape, s.dtype) for s in map(_spec, self.manifest["cache"]))

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 eos_token_id: int | Sequence[int] | None = None, seed: int = 0,
                 repetition_penalty: float | None = None) -> list[list[int]]:
        """Greedy continuations of up to :attr:`batch` prompts (token ids), as
        ``forge_jax.generation.loop.generate`` gives them for the same model.

        Args:
          prompts: lists of token ids, each non-empty and at most :attr:`prompt_length`
            long, ids in ``[0, vocab_size)``.
          max_new_tokens: new tokens per prompt (>= 0); a prompt's length plus it must fit
            in :attr:`context`.
          eos_token_id: ids to stop at (included in the output); None: the manifest's.
            ``()``: never stop early.
          seed: the random key's seed (greedy decoding does not read it).
          repetition_penalty: transformers' penalty over each sequence's tokens (None: off).

        Returns:
          Each prompt's new token ids.
        """
        prompts = self._check(prompts, max_new_tokens)
        eos = frozenset(self.eos_token_ids if eos_token_id is None else
                        [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        batch, vocab = self.batch, self.manifest["vocab_size"]
        tokens = np.zeros((batch, self.prompt_length), np.int32)
        lengths = np.zeros((batch,), np.int32)
        seen = np.zeros((batch, vocab), bool)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)], lengths[b] = p, len(p)
            seen[b, p] = True
        active = np.arange(batch) < len(prompts)
        key = jax.random.key_data(jax.random.key(seed, impl=self.manifest["key_impl"]))
        sampling = (np.float32(0.0), np.int32(0), np.float32(1.0), np.float32(0.0),
                    np.float32(1.0 if repetition_penalty is None else repetition_penalty))
        if max_new_tokens == 0:
            return [[] for _ in prompts]
        new, seen, cache = self.prefill(self.weights, self.new_cache(), tokens, lengths, key,
                                        sampling, seen)
        outputs, done = [np.asarray(new)], np.isin(np.asarray(new)[:len(prompts)], list(eos))
        for step in range(1, max_new_tokens):
            if done.all():
                break
            new, seen, cache = self.decode(self.weights, cache, new, active, key,
                                           np.int32(step), sampling, seen)
            outputs.append(np.asarray(new))
            done |= np.isin(outputs[-1][:len(prompts)], list(eos))
        generated = np.stack(outputs, axis=1)[:len(prompts)]
        results = []
        for row in generated.tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            results.append(row[:cut])
        return results

    def tokenizer(self):
        """The saved ``tokenizers.Tokenizer``; ProgramError if the program has none."""
        name = self.manifest.get("tokenizer")
        if name is None:
            raise ProgramError(f"{self.path} has no tokenizer (exported from a checkpoint "
                               f"without tokenizer.json): pass token ids to generate()")
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.path / name))

    def generate_text(self, prompt: str, max_new_tokens: int, **kwargs: Any) -> str:
        """:meth:`generate` on ``prompt`` encoded with the saved tokenizer, decoded back to
        text. The ids are the live model's (:func:`forge_jax.generation.prompts.encode_prompt`):
        a BOS first exactly when the tokenizer adds one."""
        from forge_jax.generation.prompts import encode_prompt

        tokenizer = self.tokenizer()
        ids = encode_prompt(tokenizer, prompt)
        new = self.generate([ids], max_new_tokens, **kwargs)[0]
        return tokenizer.decode([t for t in new if t not in self.eos_token_ids])

    def _check(self, prompts, max_new_tokens) -> list[list[int]]:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 0:
            raise ProgramError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        prompts = [[int(t) for t in p] for p in prompts]
        vocab = self.manifest["vocab_size"]
        if not 0 < len(prompts) <= self.batch:
            raise ProgramError(f"this program runs 1 to {self.batch} prompts (exported with "
                               f"batch={self.batch}), got {len(prompts)}")
        for i, p in enumerate(prompts):
            if not 0 < len(p) <= self.prompt_length:
                raise ProgramError(f"prompts[{i}] has {len(p)} tokens; this program takes 1 "
                                   f"to {self.prompt_length} (prompt_length)")
            if min(p) < 0 or max(p) >= vocab:
                raise ProgramError(f"prompts[{i}] has ids outside [0, {vocab}): {p}")
            if len(p) + max_new_tokens > self.context:
                raise ProgramError(f"prompts[{i}] has {len(p)} tokens; with {max_new_tokens=} "
                                   f"that is beyond the exported context={self.context}")
        return prompts


def read_manifest(path: str | pathlib.Path) -> dict:
    """``PATH/manifest.json``, checked to be this format's."""
    path = pathlib.Path(path).expanduser()
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        if not path.is_dir():
            raise ProgramError(f"{path} is not an exported program: no such "
                               f"directory") from None
        written = sorted(p.name for p in path.iterdir()
                         if p.name in (WEIGHTS, TOKENIZER) or p.name.endswith(
                             (".jax_exported", ".executable")))
        if written or path.name.endswith(PARTIAL):
            raise ProgramError(f"{path} is a partial export ({', '.join(written) or 'empty'}, "
                               f"no {MANIFEST}: the export was interrupted); export it "
                               f"again") from None
        raise ProgramError(f"{path} is not an exported program: no {MANIFEST}") from None
    except json.JSONDecodeError as e:
        raise ProgramError(f"{path / MANIFEST} is not valid JSON: {e}") from None
    if manifest.get("format") != FORMAT:
        raise ProgramError(f"{path / MANIFEST} has format {manifest.get('format')!r}; this "
                           f"forge_jax reads {FORMAT!r}")
    return manifest


def load(path: str | pathlib.Path, *, executable: bool | None = None) -> Program:
    """Loads an exported program (see the module's docstring) for this process' default
    backend.

    Args:
      path: the directory ``forge-jax export --out`` wrote.
      executable: True: run the serialized executables (ProgramError if there are none for
        this platform and device kind, or if this JAX or jaxlib is not the version that
        compiled them);
        False: the ``jax.export`` steps, compiled here; None (default): the executables
        when they match this process, else the exported steps.

    Raises:
      ProgramError: the directory is not a program of this format, it was not exported for
        this platform, or ``executable=True`` cannot be honoured.
    """
    path = pathlib.Path(path).expanduser()
    manifest = read_manifest(path)
    platform = jax.default_backend()
    device_kind = jax.devices()[0].device_kind
    reason = executable_mismatch(manifest, platform, device_kind)
    if platform not in manifest["platforms"] and (reason is not None or executable is False):
        raise ProgramError(f"{path} was exported for platforms {manifest['platforms']}; this "
                           f"process runs on {platform!r}: export again with --platforms "
                           f"including {platform}"
                           + (f" ({reason})" if manifest.get("executables") else ""))
    weights = _load_weights(path, manifest)
    steps = None
    if executable is not False:
        if reason is None:
            entry = executable_entry(manifest, platform, device_kind)
            steps = tuple(_load_executable(path, manifest, entry, s, platform) for s in STEPS)
        elif executable:
            raise ProgramError(f"{path}: {reason}")
    source = "executable" if steps else "stablehlo"
    if steps is None:
        steps = tuple(_load_exported(path, manifest, s) for s in STEPS)
    return Program(path, manifest, weights, *steps, source=source)


def executable_mismatch(manifest: dict, platform: str,
                        device_kind: str | None = None) -> str | None:
    """None if the manifest has executables this process can run on ``platform`` (a device
    of ``device_kind``, for executables compiled for a named target), else why not (none
    for the platform or device, or compiled by another JAX or jaxlib)."""
    entry = executable_entry(manifest, platform, device_kind)
    if entry is None:
        others = {name: e.get("device_kind", name)
                  for name, e in manifest.get("executables", {}).items()
                  if e.get("platform", name) == platform}
        if others:
            return (f"the {platform} executables were compiled for "
                    f"{', '.join(f'{n} ({k})' for n, k in others.items())}, this device is "
                    f"{device_kind!r}: load with executable=False (the exported StableHLO)")
        return f"no serialized executable for {platform!r} (export with --executable)"
    here = versions()
    if (entry["jax"], entry["jaxlib"]) != (here["jax"], here["jaxlib"]):
        return (f"the {platform} executables were compiled by jax {entry['jax']} / jaxlib "
                f"{entry['jaxlib']}, this is jax {here['jax']} / jaxlib {here['jaxlib']}: "
                f"load with executable=False (the exported StableHLO) or export again")
    return None


def executable_entry(manifest: dict, platform: str,
                     device_kind: str | None = None) -> dict | None:
    """The manifest's executables for ``platform`` and a device of ``device_kind``: those
    compiled for this machine's CPU (named ``"cpu"``), or those of a named target whose
    device kind is ``device_kind``; None if it has none."""
    for name, entry in manifest.get("executables", {}).items():
        if entry.get("platform", name) != platform:
            continue
        if "device_kind" not in entry or entry["device_kind"] == device_kind:
            return entry
    return None


def _load_weights(path: pathlib.Path, manifest: dict) -> tuple[jax.Array, ...]:
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(path / manifest["weights"]["file"]))
    except FileNotFoundError:
        raise ProgramError(f"{path} is missing {manifest['weights']['file']}") from None
    except Exception as e:  # safetensors raises its own SafetensorError (a truncated file)
        raise ProgramError(f"cannot read {path / manifest['weights']['file']}: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    weights = []
    for entry in manifest["weights"]["tensors"]:
        array = tensors.get(entry["name"])
        if array is None:
            raise ProgramError(f"{manifest['weights']['file']} has no tensor {entry['name']!r}")
        # bfloat16 is stored as its uint16 bits (safetensors' NumPy API has no bfloat16).
        array = jnp.asarray(np.asarray(array).view(jnp.dtype(entry["dtype"])))
        if array.shape != tuple(entry["shape"]):
            raise ProgramError(f"weight {entry['name']!r} has shape {array.shape}, the manifest "
                               f"says {tuple(entry['shape'])}")
        weights.append(array)
    return tuple(weights)


def _load_exported(path: pathlib.Path, manifest: dict, step: str) -> Callable[..., Any]:
    try:
        data = (path / step_file(step)).read_bytes()
    except FileNotFoundError:
        raise ProgramError(f"{path} is missing {step_file(step)}") from None
    exported = jax.export.deserialize(bytearray(data))
    # The cache (argument 1) is updated in place; decode's `seen` (its last argument) too.
    donate = (1, 7) if step == "decode" else (1,)
    return jax.jit(exported.call, donate_argnums=donate)


def _load_executable(path: pathlib.Path, manifest: dict, entry: dict, step: str,
                     platform: str) -> Callable[..., Any]:
    from jax.experimental import serialize_executable

    file = path / entry["files"][step]
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise ProgramError(f"{path} is missing {file.name}") from None
    in_tree, out_tree = step_trees(step, len(manifest["weights"]["tensors"]),
                                   len(manifest["cache"]))
    # Compiled for one device: run on this platform's first (whatever the device count).
    device = jax.devices(platform)[0]
    return serialize_executable.deserialize_and_load(data, in_tree, out_tree, backend=platform,
                                                     execution_devices=[device])
