"""Hugging Face fine-grained FP8 checkpoints (``quantization_config.quant_method == "fp8"``,
the layout of DeepSeek-V3's and Qwen3's ``-FP8`` releases), loaded as they are stored.

Each quantized linear layer's ``weight`` is ``float8_e4m3fn`` ``[out, in]`` beside a
``weight_scale_inv`` ``[ceil(out / 128), ceil(in / 128)]``: ``w = weight * scale_inv`` block
by block (the name is transformers'; the scale multiplies). They load into fp8
:class:`forge_jax.QuantizedArray` kernels, the bytes as they are in the file (read through
a memory map: safetensors' NumPy API has no float8), never dequantized. A fused projection
(q/k/v, gate/up) stacks its parts' rows; where a part's rows, or a layer's in features, are
not a multiple of 128 (the last block is partial), the scales are repeated onto the
largest finer block that tiles the kernel (e.g. 64 x 128 for a 64-row k_proj), which is
exact. Activations stay in the compute dtype (weight-only: transformers on a GPU also
quantizes activations to fp8, 128 values a scale; on a CPU it dequantizes the weights).

The file decides which layers are quantized: a linear weight stored as ``F8_E4M3`` with its
``weight_scale_inv`` loads quantized, one stored as a float (``lm_head``, usually listed in
``modules_to_not_convert``) loads as a float. Refused, naming the field: an
``activation_scheme`` other than ``"dynamic"``, a ``weight_block_size`` other than
``[128, 128]``, a ``fmt`` other than ``"e4m3"``, a ``scale_fmt`` other than ``"float"``,
``modules_to_convert`` (fp8 embeddings), a module ``modules_to_not_convert`` names stored as
fp8; and, naming the tensor, an fp8 weight without its scales (or the reverse), scales of
the wrong shape, an fp8 tensor that is not a linear layer's weight, NaN in either.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
from typing import Any

import ml_dtypes
import numpy as np

import forge_jax as fj
from forge_jax.models.checkpoints.generation_config import CheckpointError

BLOCK = 128
SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
FP8 = "F8_E4M3"
# safetensors' dtype names -> NumPy's, for the tensors read through a memory map.
_DTYPES = {FP8: np.dtype(ml_dtypes.float8_e4m3fn), "F32": np.dtype(np.float32),
           "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """The parts of a ``quantization_config`` forge_jax reads (see the module docstring)."""

    not_converted: tuple[str, ...] = ()


def quantization(raw: dict[str, Any], file: str | pathlib.Path) -> Fp8Config | None:
    """The :class:`Fp8Config` of a ``config.json`` dict whose ``quantization_config`` is
    fine-grained FP8; None for one without a ``quantization_config`` or with another
    ``quant_method`` (:mod:`forge_jax.models.families` refuses those by name).
    CheckpointError naming the field for an FP8 setting forge_jax does not read."""
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    allowed = {"activation_scheme": ("dynamic",), "fmt": (None, "e4m3"),
               "scale_fmt": (None, "float"), "modules_to_convert": (None, [])}
    for key, values in allowed.items():
        value = qc.get(key, values[0])
        if value not in values:
            raise CheckpointError(
                f"{file}: quantization_config.{key}={value!r} is not supported; forge_jax "
                f"reads fp8 checkpoints with {key} in {[v for v in values if v is not None]}")
    block = qc.get("weight_block_size")
    if block is None or list(block) != [BLOCK, BLOCK]:
        raise CheckpointError(f"{file}: quantization_config.weight_block_size={block!r} is not "
                              f"supported; forge_jax reads [{BLOCK}, {BLOCK}] blocks")
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise CheckpointError(f"{file}: quantization_config.modules_to_not_convert={skip!r} "
                              f"must be a list of module names")
    return Fp8Config(tuple(skip))


def _skipped(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``modules_to_not_convert`` names ``module`` (transformers' rule: a prefix or a
    regex ending at a module boundary, or a suffix)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


class RawTensors:
    """Tensors of safetensors files read through a memory map (by the format's header:
    a little-endian u64 length, then JSON ``{name: {dtype, shape, data_offsets}}``)."""

    def __init__(self):
        self._where: dict[str, tuple[pathlib.Path, dict, int]] = {}
        self._headers: dict[pathlib.Path, tuple[dict, int]] = {}

    def add(self, file: pathlib.Path, name: str) -> None:
        if file not in self._headers:
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._headers[file] = (json.loads(f.read(size)), 8 + size)
        header, start = self._headers[file]
        self._where[name] = (file, header[name], start)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(self, name: str) -> np.ndarray:
        file, info, start = self._where[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"tensor {name!r} in {file.name} has dtype {info['dtype']}; "
                                  f"an fp8 checkpoint's weights are {FP8} and its scales float")
        begin, end = info["data_offsets"]
        raw = np.memmap(file, np.uint8, "r", offset=start + begin, shape=(end - begin,))
        return raw.view(dtype).reshape(info["shape"])


def _check(name: str, x: np.ndarray, file: str) -> None:
    if x.dtype == _DTYPES[FP8]:  # e4m3fn's NaN: all exponent and mantissa bits set
        bad = int(np.count_nonzero((x.view(np.uint8) & 0x7F) == 0x7F))
    else:
        bad = int(np.count_nonzero(~np.isfinite(x.astype(np.float32))))
    if bad:
        raise CheckpointError(f"tensor {name!r} in {file} holds {bad} non-finite values of "
                              f"{x.size}: the checkpoint is corrupt")


def _row_block(row_scales: np.ndarray) -> int:
    """The largest power of two up to 128 that divides the rows and within whose blocks of
    rows every column's scale is one value (so the scales can be stored per block)."""
    rows = row_scales.shape[0]
    for b in (128, 64, 32, 16, 8, 4, 2, 1):
        if rows % b == 0:
            blocks = row_scales.reshape(rows // b, b, -1)
            if np.array_equal(blocks, np.broadcast_to(blocks[:, :1], blocks.shape)):
                return b
    return 1


def kernel(param_shape: tuple[int, int], parts: list[tuple[str, Any]], raw: RawTensors,
           file_of: dict[str, str], dtype) -> fj.QuantizedArray:
    """One linear kernel ``[out, in]`` from its fp8 HF tensors: ``parts`` lists each HF
    weight's name and rows (None: all of them; else (stored rows, HF rows), a fused
    projection's part)."""
    out, cols = param_shape
    values = np.empty((out, cols), _DTYPES[FP8])
    row_scales = None  # [out, ceil(in / 128)]: each stored row's scales
    for name, rows in parts:
        w = raw.get(name)
        s = raw.get(name + SCALE_SUFFIX)
        want = (math.ceil(w.shape[0] / BLOCK), math.ceil(w.shape[1] / BLOCK))
        if tuple(s.shape) != want:
            raise CheckpointError(f"tensor {name + SCALE_SUFFIX!r} in {file_of[name]} has shape "
                                  f"{tuple(s.shape)}; {want} scales {name!r} of shape "
                                  f"{tuple(w.shape)} in {BLOCK} x {BLOCK} blocks")
        _check(name, w, file_of[name])
        _check(name + SCALE_SUFFIX, s, file_of[name])
        stored, source = (np.arange(out), np.arange(out)) if rows is None else rows
        if row_scales is None:
            row_scales = np.empty((out, s.shape[1]), s.dtype)
        elif s.dtype != row_scales.dtype:
            raise CheckpointError(f"tensor {name + SCALE_SUFFIX!r} is {s.dtype.name}, unlike the "
                                  f"other parts of its fused projection ({row_scales.dtype.name})")
        values[stored] = w[source]
        row_scales[stored] = s[source // BLOCK]
    br = _row_block(row_scales)
    bc = math.gcd(BLOCK, cols)
    scales = np.repeat(row_scales[::br], BLOCK // bc, axis=1)[:, : cols // bc]
    return fj.quant.from_parts(values, scales, format="fp8", block=(br, bc), dtype=dtype)


def load_kernels(model, expected: dict, raw: RawTensors, file_of: dict[str, str],
                 config: Fp8Config, linear_kernels: list) -> set[int]:
    """Sets the model's fp8 kernels from ``raw`` (the fp8 weights and their scales found in
    the files); returns the ids of the parameters it set.

    ``expected``: :func:`forge_jax.models.checkpoints.hf_names.hf_parameters` of the model;
    ``linear_kernels``: the parameters that may hold a quantized kernel."""
    linear = {id(k) for k in linear_kernels}
    weights = [n for n in raw.names() if not n.endswith(SCALE_SUFFIX)]
    for name in raw.names():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] not in raw:
            weight = name[: -len(SCALE_SUFFIX)]
            raise CheckpointError(f"tensor {name!r} in {file_of[name]} scales {weight!r}, which "
                                  f"is not stored as {FP8}")
    by_param: dict[int, list[tuple[str, Any]]] = {}
    for name in weights:
        param, _, _, _ = expected[name]
        module = name.rsplit(".", 1)[0]
        if id(param) not in linear:
            raise CheckpointError(
                f"tensor {name!r} in {file_of[name]} is {FP8} but is not a linear layer's "
                f"weight; forge_jax reads fp8 linear layers only (not modules_to_convert)")
        if name + SCALE_SUFFIX not in raw:
            raise CheckpointError(f"tensor {name!r} in {file_of[name]} is {FP8} but the "
                                  f"checkpoint has no {name + SCALE_SUFFIX!r}")
        if _skipped(module, config.not_converted):
            raise CheckpointError(
                f"tensor {name!r} in {file_of[name]} is {FP8}, but quantization_config."
                f"modules_to_not_convert={list(config.not_converted)} lists {module!r}")
        by_param.setdefault(id(param), [])
    for name, (param, _, _, rows) in expected.items():
        if id(param) not in by_param:
            continue
        if name not in raw:
            raise CheckpointError(f"tensor {name!r} is not {FP8} but other parts of its fused "
                                  f"projection are; forge_jax cannot mix them in one kernel")
        by_param[id(param)].append((name, rows))
    params = {id(p): p for p, _, _, _ in expected.values()}
    for key, parts in by_param.items():
        param = params[key]
        param.set_value(kernel(tuple(param.shape), parts, raw, file_of, param.dtype))
    return set(by_param)


# Models with loaders of their own (DeepSeek-V3) read fp8 tensors one weight at a time.

def open_files(files) -> tuple[RawTensors, dict[str, str]]:
    """Every tensor of the safetensors ``files``, read through a memory map, and the file
    name holding each (for the messages)."""
    raw, file_of = RawTensors(), {}
    for file in files:
        file = pathlib.Path(file)
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name in header:
            if name != "__metadata__":
                raw.add(file, name)
                file_of[name] = file.name
    return raw, file_of


def is_fp8(raw: RawTensors, name: str) -> bool:
    """Whether tensor ``name`` is stored as ``F8_E4M3``."""
    _, info, _ = raw._where[name]
    return info["dtype"] == FP8


def linear_kernel(name: str, raw: RawTensors, file_of: dict[str, str], config: Fp8Config,
                  dtype) -> fj.QuantizedArray:
    """The fp8 kernel ``[out, in]`` of one linear layer's ``weight`` ``name`` and its
    ``weight_scale_inv`` (CheckpointError naming the tensor: no scales, or a module
    ``modules_to_not_convert`` lists)."""
    if name + SCALE_SUFFIX not in raw:
        raise CheckpointError(f"tensor {name!r} in {file_of[name]} is {FP8} but the "
                              f"checkpoint has no {name + SCALE_SUFFIX!r}")
    module = name.rsplit(".", 1)[0]
    if _skipped(module, config.not_converted):
        raise CheckpointError(
            f"tensor {name!r} in {file_of[name]} is {FP8}, but quantization_config."
            f"modules_to_not_convert={list(config.not_converted)} lists {module!r}")
    shape = tuple(raw.get(name).shape)
    if len(shape) != 2:
        raise CheckpointError(f"tensor {name!r} in {file_of[name]} is {FP8} of shape {shape}; "
                              f"forge_jax reads fp8 linear layers [out, in] only")
    return kernel(shape, [(name, None)], raw, file_of, dtype)


def stack_kernels(kernels: list[fj.QuantizedArray]) -> fj.QuantizedArray:
    """Experts' fp8 kernels ``[out, in]`` as one ``[experts, out, in]`` kernel (each its own
    scales), their blocks brought to the finest row block among them (exact: a coarser
    block's scale repeated)."""
    rows = min(k.block[0] for k in kernels)
    cols = {k.block[1] for k in kernels}
    if len(cols) != 1 or {tuple(k.values.shape) for k in kernels} != {kernels[0].values.shape}:
        raise CheckpointError(f"experts of one layer differ in shape or column blocks: "
                              f"{sorted({tuple(k.values.shape) for k in kernels})}, {sorted(cols)}")
    scales = [np.repeat(np.asarray(k.scales), k.block[0] // rows, axis=0) for k in kernels]
    return fj.quant.from_parts(np.stack([np.asarray(k.values) for k in kernels]),
                               np.stack(scales), format="fp8", block=(rows, cols.pop()),
                               dtype=kernels[0].dtype)
