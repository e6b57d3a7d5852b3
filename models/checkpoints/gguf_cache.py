"""A GGUF file's converted pieces kept on disk, so that a later process reads them instead of
converting the file again.

Reading a GGUF file costs seconds a start: parsing its metadata (a 49k-token vocabulary is
hundreds of thousands of fields), building the tokenizer from it, and turning its quantized
blocks into the layout the model reads (nibbles reordered, q/k rows permuted back,
projections fused, the embedding dequantized). Inside ``with use_gguf_cache(directory):``
(``forge-jax chat`` / ``generate`` / ``serve`` open it in their compilation cache's
``gguf`` folder) :mod:`forge_jax.models.checkpoints.gguf` keeps, per file:

* ``entry.json``: the file's identity (its resolved path, size, modification time and a
  SHA-256 of its first bytes, which hold the header), forge_jax's version and a fingerprint
  of the converting code's sources, the JAX version; the metadata the config is made from
  (every field but the arrays); the tokenizer's special tokens, chat template and EOS; and,
  per parameter dtype, the weights file's size, CRC-32 and quantized layouts;
* ``tokenizer.json``: the converted tokenizer (``tokenizers``' own format);
* ``weights-<dtype>.safetensors``: the loaded weight layout (safetensors: never pickle).

An entry whose identity differs (the file changed, or another forge_jax or JAX wrote it) is
ignored with one log line and replaced; one that does not read (bad JSON, a weights file of
another size or checksum, a safetensors header that does not parse) is ignored likewise and
never trusted. Every file is written to a temporary name and renamed into place.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pathlib
import tempfile
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

logger = logging.getLogger("forge_jax.models.checkpoints.gguf_cache")

FORMAT = "forge-jax-gguf-conversion/1"
HEADER_BYTES = 16 << 20  # the bytes hashed: a GGUF header (metadata, tensor table) and more
_DIRECTORY: list[pathlib.Path] = []  # the active cache directory (innermost last)
# (entry directory, identity) -> entry read in this process (None: none usable), so that
# a stale entry is reported once.
_ENTRIES: dict[tuple, dict | None] = {}


@contextlib.contextmanager
def use_gguf_cache(directory: str | os.PathLike | None) -> Iterator[None]:
    """Within the block, GGUF files' conversions are read from and kept in ``directory``
    (created if missing; one that cannot be is no cache, with one log line); ``None``
    leaves things as they are."""
    path = None if directory is None else pathlib.Path(directory).expanduser()
    if path is not None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            logger.warning("not keeping GGUF conversions in %s: %s", path, e)
            path = None
    if path is None:
        yield
        return
    _DIRECTORY.append(path)
    try:
        yield
    finally:
        _DIRECTORY.pop()


def active_directory() -> pathlib.Path | None:
    return _DIRECTORY[-1] if _DIRECTORY else None


@functools.cache
def _code_fingerprint() -> str:
    """forge_jax's version and the sizes and modification times of the modules that convert
    a GGUF file (the checkpoint readers, the quantized formats, the config): an edit there
    makes every entry stale."""
    import forge_jax
    import forge_jax.models as models

    here = pathlib.Path(__file__).resolve().parent
    files = sorted(here.glob("*.py")) + [
        pathlib.Path(forge_jax.__file__).resolve().parent / "quant.py",
        pathlib.Path(models.__file__).resolve().parent / "llama_config.py"]
    parts = [getattr(forge_jax, "__version__", "?")]
    for f in files:
        with contextlib.suppress(OSError):
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


@functools.cache
def _identity(path: str, size: int, mtime_ns: int) -> dict:
    import jax

    with open(path, "rb") as f:
        header = hashlib.sha256(f.read(HEADER_BYTES)).hexdigest()
    return {"format": FORMAT, "path": path, "size": size, "mtime_ns": mtime_ns,
            "header_sha256": header, "forge_jax": _code_fingerprint(),
            "jax": jax.__version__}


def identity(file: str | os.PathLike) -> dict:
    """What an entry for ``file`` must have been written for (see the module docstring)."""
    resolved = pathlib.Path(file).expanduser().resolve()
    st = resolved.stat()
    return _identity(str(resolved), st.st_size, st.st_mtime_ns)


def _entry_dir(directory: pathlib.Path, key: dict) -> pathlib.Path:
    return directory / hashlib.sha256(key["path"].encode()).hexdigest()[:24]


def _read(file: str | os.PathLike) -> tuple[pathlib.Path, dict, dict | None] | None:
    """(entry directory, identity, the entry or None) for ``file``, or None with no cache
    active (or a file that cannot be read: its reader reports that)."""
    directory = active_directory()
    if directory is None:
        return None
    try:
        key = identity(file)
    except OSError:
        return None
    where = _entry_dir(directory, key)
    memo = (str(where), json.dumps(key, sort_keys=True))
    if memo not in _ENTRIES:
        _ENTRIES[memo] = _read_entry(where, key)
    return where, key, _ENTRIES[memo]


def _read_entry(where: pathlib.Path, key: dict) -> dict | None:
    file = where / "entry.json"
    if not file.is_file():
        return None
    try:
        entry = json.loads(file.read_text())
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), dict):
            raise ValueError("not an entry")
    except (OSError, ValueError) as e:
        logger.warning("ignoring the kept GGUF conversion %s: unreadable (%s)", file, e)
        return None
    if entry["key"] != key:
        differ = sorted(k for k in key if entry["key"].get(k) != key[k])
        logger.warning("ignoring the kept GGUF conversion %s: written for another %s",
                       file, ", ".join(differ) or "entry format")
        return None
    return entry


def _write_json(file: pathlib.Path, value: Any) -> None:
    _write_bytes(file, json.dumps(value).encode())


def _write_bytes(file: pathlib.Path, data: bytes) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def get(file: str | os.PathLike, part: str) -> Any:
    """The kept ``part`` (``"metadata"``, ``"tokenizer"``) of ``file``'s entry, or None."""
    found = _read(file)
    if found is None or found[2] is None:
        return None
    return found[2].get(part)


def put(file: str | os.PathLike, part: str, value: Any, *, extra_files=()) -> None:
    """Keeps ``value`` (JSON) as ``part`` of ``file``'s entry, with ``extra_files``
    (``(name, bytes)``) beside it, written before the entry names them; a cache that
    cannot be written is one log line, not an error."""
    found = _read(file)
    if found is None:
        return
    where, key, entry = found
    entry = dict(entry) if entry is not None else {"key": key}
    entry[part] = value
    try:
        for name, data in extra_files:
            _write_bytes(where / name, data)
        _write_json(where / "entry.json", entry)
    except OSError as e:
        logger.warning("could not keep the GGUF conversion of %s in %s: %s", file, where, e)
        return
    _ENTRIES[(str(where), json.dumps(key, sort_keys=True))] = entry


def read_file(file: str | os.PathLike, name: str) -> bytes | None:
    """The bytes of ``name`` in ``file``'s entry (a file :func:`put` wrote), or None."""
    found = _read(file)
    if found is None or found[2] is None:
        return None
    try:
        return (found[0] / name).read_bytes()
    except OSError as e:
        logger.warning("ignoring the kept GGUF conversion %s: %s", found[0] / name, e)
        return None


# --------------------------------------------------------------------------------------
# Weights: name -> array or QuantizedArray, kept as NumPy arrays (safetensors) and, per name,
# what rebuilds it (JSON).


def save_weights(file: str | os.PathLike, dtype: str, weights: dict[str, Any]) -> None:
    """Keeps ``weights`` (arrays and QuantizedArrays) as those of ``file`` loaded in
    parameter dtype ``dtype``."""
    if active_directory() is None:
        return
    from safetensors.numpy import save

    arrays, layouts = _to_arrays(weights)
    try:
        data = save(arrays)
    except Exception as e:  # noqa: BLE001  (a dtype safetensors lacks: nothing kept)
        logger.warning("could not keep the GGUF conversion of %s: %s", file, e)
        return
    name = f"weights-{dtype}.safetensors"
    kept = dict(get(file, "weights") or {})
    kept[dtype] = {"file": name, "bytes": len(data), "crc32": zlib.crc32(data),
                   "layouts": layouts}
    put(file, "weights", kept, extra_files=[(name, data)])


def load_weights(file: str | os.PathLike, dtype: str) -> dict[str, Any] | None:
    """The weights kept for ``file`` in parameter dtype ``dtype`` (as :func:`save_weights`
    was given them), or None: none kept, or a weights file whose size or CRC-32 is not the
    one recorded, or that does not rebuild (one log line)."""
    record = (get(file, "weights") or {}).get(dtype)
    if not isinstance(record, dict):
        return None
    data = read_file(file, str(record.get("file")))
    if data is None:
        return None
    where = _read(file)[0] / str(record.get("file"))
    if len(data) != record.get("bytes") or zlib.crc32(data) != record.get("crc32"):
        logger.warning("ignoring the kept GGUF conversion %s: its size or checksum is not the "
                       "one recorded (a corrupted file)", where)
        return None
    try:
        return _from_arrays(_views(data), record["layouts"])
    except Exception as e:  # noqa: BLE001  (any entry that does not rebuild is not trusted)
        logger.warning("ignoring the kept GGUF conversion %s: %s", where, e)
        return None


# safetensors' dtype names (the ones a conversion writes)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "U16": "uint16", "U32": "uint32", "BOOL": "bool"}


def _views(data: bytes) -> dict[str, np.ndarray]:
    """The arrays of safetensors bytes ``data`` as read-only views of it, not copies (the
    bytes are checked against their CRC-32 first; a header or an extent that does not fit
    them is a ValueError)."""
    import jax.numpy as jnp  # bfloat16's NumPy dtype

    (n,) = np.frombuffer(data, np.uint64, 1)
    header = json.loads(data[8:8 + int(n)])
    base, out = 8 + int(n), {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = jnp.dtype(_DTYPES[info["dtype"]])
        lo, hi = (base + int(i) for i in info["data_offsets"])
        count = int(np.prod(info["shape"], dtype=np.int64))
        if not base <= lo <= hi <= len(data) or hi - lo != count * dtype.itemsize:
            raise ValueError(f"tensor {name!r}'s extent {info['data_offsets']} does not fit "
                             f"its shape {info['shape']} and the file")
        out[name] = np.frombuffer(data, dtype, count, lo).reshape(info["shape"])
    return out


def _to_arrays(weights: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """NumPy arrays and, per weight, what rebuilds it: None for an array as it is, else a
    QuantizedArray's format, block, dtype and whether it has minimums."""
    import forge_jax as fj

    arrays, layouts = {}, {}
    for k, x in weights.items():
        if isinstance(x, fj.QuantizedArray):
            arrays[f"{k}:values"] = np.ascontiguousarray(x.values)
            arrays[f"{k}:scales"] = np.ascontiguousarray(x.scales)
            if x.minimums is not None:
                arrays[f"{k}:minimums"] = np.ascontiguousarray(x.minimums)
            layouts[k] = {"format": x.format, "block": list(x.block),
                          "dtype": np.dtype(x.dtype).name, "minimums": x.minimums is not None}
        else:
            arrays[k], layouts[k] = np.ascontiguousarray(x), None
    return arrays, layouts


def _from_arrays(arrays: dict[str, np.ndarray], layouts: dict[str, Any]) -> dict[str, Any]:
    import jax

    import forge_jax as fj

    names = sorted(arrays)
    on_device = dict(zip(names, jax.device_put([arrays[k] for k in names]), strict=True))
    out = {}
    for k, layout in layouts.items():
        if layout is None:
            out[k] = on_device[k]
        else:
            out[k] = fj.quant.from_parts(
                on_device[f"{k}:values"], on_device[f"{k}:scales"],
                on_device[f"{k}:minimums"] if layout["minimums"] else None,
                format=layout["format"], block=tuple(layout["block"]),
                dtype=jax.numpy.dtype(layout["dtype"]))
    return out
