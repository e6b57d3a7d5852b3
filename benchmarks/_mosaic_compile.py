"""What the Mosaic GPU compile reports share (``compile_mosaic_paged.py`` for an H100,
``compile_mosaic_blackwell.py`` for a B200): the shapes of paged attention's arguments and
the report itself, each case compiled without a device with ``implementation="mosaic_gpu"``.

Imported by the scripts beside it, after they set ``JAX_PLATFORMS``; importing it puts the
repository root on ``sys.path``.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import forge_jax as fj  # noqa: E402
from forge_jax.ops import kv_quant  # noqa: E402
from forge_jax.pallas_kernels.gpu import _mosaic  # noqa: E402

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def pool(shape, kv_format=None):
    """A page pool's shape: bfloat16, or ``kv_format``'s quantized values and scales."""
    if kv_format is None:
        return S(shape, BF16)
    return jax.eval_shape(lambda: kv_quant.empty_pool(shape, kv_format, BF16))


def paged_args(batch, context, q_heads, kv_heads, head_dim, page, q_len=None, kv_format=None):
    """``fj.paged_attention``'s arguments: ``batch`` sequences of ``context`` keys in pages
    of ``page``, decode (``q_len`` None) or ``q_len`` positions each."""
    per_seq = context // page
    pages = pool((kv_heads, batch * per_seq, page, head_dim), kv_format)
    q = (batch, q_heads, head_dim) if q_len is None else (batch, q_len, q_heads, head_dim)
    return (S(q, BF16), pages, pages, S((batch, per_seq), jnp.int32), S((batch,), jnp.int32))


def report(target: str,
           cases: Sequence[tuple[str, Callable[..., Any], tuple, Callable[[], int | None]]]
           ) -> int:
    """Prints each case's compile report for ``target`` (``fj.aot.compile``), ptxas'
    registers and spills, and the shared memory its ``smem()`` reads from the lowering.
    Returns the exit status: 0, 1 if a case did not compile, 2 if nothing can compile for
    ``target`` here."""
    missing = fj.targets.missing(target)
    if missing:
        print(f"cannot compile for {target} here: {missing}", file=sys.stderr)
        return 2
    print(f"# jax {jax.__version__}; compiled for {target} without a device, not run")
    failed = False
    for title, fn, args, smem in cases:
        with _mosaic.ptxas_report() as lines:
            compiled = fj.aot.compile(fn, *args, target=target, implementation="mosaic_gpu")
        failed |= not compiled.compiled
        smem_bytes = smem()
        print(f"### {title}\n{compiled}")
        print("  ptxas: " + " | ".join(ln for ln in lines if "spill stores" in ln
                                         or "registers" in ln))
        if smem_bytes is not None:
            print(f"  Mosaic GPU shared memory (lowering): {smem_bytes} B = "
                  f"{smem_bytes / 1024:.1f} KiB")
        print()
    return 1 if failed else 0
