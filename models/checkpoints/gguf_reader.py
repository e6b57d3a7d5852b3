"""Opening a GGUF file (llama.cpp's single-file format) with the ``gguf`` package (ggml's own
reader, imported only when a file is opened) and reading its metadata: a missing, foreign
or truncated file is one :class:`CheckpointError` naming what is wrong (for a file cut
short, the tensor cut)."""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
from typing import Any

import numpy as np

from forge_jax.models.checkpoints.generation_config import CheckpointError

# The last file read, by (path, size, modification time) -> its reader: a command reads one
# file's config, tokenizer and weights, and parsing its metadata (a 49k-token vocabulary:
# hundreds of thousands of fields) costs seconds each time.
_LAST_READER: dict[tuple, Any] = {}


def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` of ``path``; CheckpointError for a missing, foreign or
    truncated file. The last file's reader is reused while the file is unchanged."""
    with contextlib.suppress(OSError):
        st = pathlib.Path(path).stat()
        key = (str(pathlib.Path(path).resolve()), st.st_size, st.st_mtime_ns)
        if key in _LAST_READER:
            return _LAST_READER[key]
        reader = _open_gguf(path)
        _LAST_READER.clear()
        _LAST_READER[key] = reader
        return reader
    return _open_gguf(path)


def _open_gguf(path: str | os.PathLike):
    try:
        import gguf
    except ImportError:
        raise CheckpointError(f"reading {path} needs the gguf package: pip install gguf") from None
    path = pathlib.Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (it starts with {magic!r}, not "
                              f"b'GGUF')")
    try:
        return _fast_reader(gguf)(path)
    except Exception as e:  # the reader raises ValueError, IndexError, ... on a short file
        cut = _cut_tensor(gguf, path)
        if cut is not None:
            raise CheckpointError(f"cannot read {path}: {cut} (truncated or corrupt?)") from None
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e} (truncated or "
                              f"corrupt?)") from None


@functools.cache
def _fast_reader(gguf):
    """``gguf.GGUFReader`` reading its fields from a plain array over the file's memory map:
    slicing the ``np.memmap`` itself runs Python (``memmap.__array_finalize__``) for each
    of the hundreds of thousands of fields a vocabulary makes (4.5 s for SmolLM2's 49k
    tokens against 1.0 s). Tensor data stay views of the map, never copies."""

    class FastReader(gguf.GGUFReader):
        _sizes: dict = {}

        def _get(self, offset, dtype, count=1, override_order=None):
            if self.__dict__.get("_map") is not self.data:  # the map, as a plain array
                self._map, self._plain = self.data, self.data.view(np.ndarray)
            size = self._sizes.get(dtype)
            if size is None:
                size = self._sizes[dtype] = np.dtype(dtype).itemsize
            count = int(count)
            arr = self._plain[offset:offset + size * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    return FastReader


def _cut_tensor(gguf, path: pathlib.Path) -> str | None:
    """Names the first tensor whose data runs past the end of ``path``, or None (the header
    itself is cut or corrupt, or the gguf package reads differently).

    The header is read again by a reader whose short reads come back zero-filled (overriding
    ``GGUFReader._get``), so that every tensor's offset and size are known; its data is
    never used."""

    class _Padded(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            got = super()._get(offset, dtype, count, override_order)
            return got if len(got) == int(count) else np.zeros(int(count), got.dtype)

    size = path.stat().st_size
    try:
        tensors = _Padded(path).tensors
        for t in tensors:
            if t.data_offset + t.n_bytes > size:
                shape = tuple(int(n) for n in reversed(t.shape))
                return (f"GGUF tensor {t.name!r} ({t.tensor_type.name}, shape {shape}) is cut "
                        f"short: its {t.n_bytes} bytes at offset {t.data_offset} run past the "
                        f"file's end ({size} bytes)")
    except Exception:
        return None
    return None


def field(reader, key: str, default: Any = None) -> Any:
    """The value of metadata key ``key`` of an open file (``default`` when absent)."""
    found = reader.fields.get(key)
    return default if found is None else found.contents()
