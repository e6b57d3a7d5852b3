"""The ``"triton"`` implementations: plain Triton kernels launched through jax-triton
(pallas_kernels/gpu/jax_triton_elementwise.py).

On CPU: everything around the kernels: why they are unavailable (not installed, a release
for another JAX, no GPU), the launch plans (argument order, outputs, grid, the tuning
table), both ``triton_call`` signatures, and the plumbing (reshapes, residual, vmap, VJP)
with the launch replaced by a NumPy emulation of the kernels' contract.
:class:`TestRmsNormTriton`, :class:`TestSiluMulTriton` and :class:`TestRopeTriton` run the real
kernels through the behaviours of :mod:`cases.elementwise_base` and are skipped where they
cannot run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.calls import by_id, case_id
from cases.checks import assert_close
from cases.elementwise_base import RmsNormCases, RopeCases, SiluMulCases
from cases.inputs import normal, rng
from cases.references import rms_norm_ref, rope_ref, silu_mul_ref

import forge_jax as fj
from forge_jax import _compat, backends, dispatch
from forge_jax.pallas_kernels.gpu import jax_triton_elementwise as tk


@pytest.mark.parametrize("jt,jax_version,words", [
    (None, "0.10.2", "not installed"),
    ("0.3.1", "0.11.0", "built for JAX 0.10"),
    ("0.4.1", "0.10.2", "built for JAX 0.11 or 0.12"),
    ("0.2.0", "0.10.2", "not a release forge_jax supports"),
])
def test_version_reasons(jt, jax_version, words, monkeypatch):
    monkeypatch.setattr(_compat, "jax_triton_version", lambda: jt)
    reason = _compat.jax_triton_reason(jax_version=jax_version)
    assert words in reason, reason


@pytest.mark.parametrize("jt,jax_version", [("0.3.1", "0.10.2"), ("0.4.1", "0.11.3"),
                                            ("0.4.1", "0.12.0.1")])
def test_matching_releases(jt, jax_version):
    assert _compat.jax_triton_reason(jt, jax_version) is None


def test_unavailable_here_says_why(monkeypatch):
    """Not installed on this machine; installed and matching, still no GPU."""
    impls = dispatch.implementations("rms_norm", "gpu")
    if _compat.jax_triton_version() is None:
        assert "not installed" in impls["triton"].available()
    monkeypatch.setattr(_compat, "jax_triton_reason", lambda *a: None)
    if backends.gpu_compute_capability() is None:
        assert "no GPU" in impls["triton"].available()
    summary = str(backends.summary())
    assert "rms_norm: triton (gpu) -> unavailable" in summary
    assert "silu_mul: triton (gpu) -> unavailable" in summary
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "7.5")
    assert "compute capability >= 8.0" in tk.available()


def test_import_failure_is_the_reason(monkeypatch):
    monkeypatch.setattr(_compat, "jax_triton_reason", lambda *a: None)
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "9.0")
    monkeypatch.setattr(tk, "_import_reason_once", lambda: "jax-triton does not import: boom")
    assert tk.available() == "jax-triton does not import: boom"
    if _compat.jax_triton_version() is None:
        assert "jax-triton does not import: " in tk.import_reason()


def test_not_chosen_and_explained_on_a_gpu(monkeypatch):
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "8.0")
    x, w = jnp.ones((2, 64), jnp.bfloat16), jnp.ones((64,), jnp.bfloat16)
    args = dispatch.bind("rms_norm", x, w)
    rejected = dispatch.select("rms_norm", args, platform="gpu").rejected
    assert "not yet verified" in rejected["triton"] and tk.VERIFIED == {}


def test_supports():
    with jax.enable_x64(True):
        x = jnp.ones((2, 8), jnp.float64)
        assert "float64" in tk.rms_norm_supports(dict(x=x, weight=x[0], residual=None))
        assert "float64" in tk.silu_mul_supports(dict(gate=x, up=x))
    wide = jax.ShapeDtypeStruct((1, tk.MAX_HIDDEN + 1), jnp.bfloat16)
    assert "hidden size" in tk.rms_norm_supports(dict(x=wide, weight=wide, residual=None))
    ok = jax.ShapeDtypeStruct((3, 4096), jnp.bfloat16)
    assert tk.rms_norm_supports(dict(x=ok, weight=ok, residual=ok)) is None


def test_rms_norm_launch():
    plan = tk.rms_norm_launch((2, 3, 576), jnp.bfloat16, eps=1e-5, residual=True)
    assert plan.kernel == "add_rms_norm_kernel" and plan.grid == (6,)
    assert plan.scalars == (576, 1e-5) and plan.meta == {"BLOCK": 1024}
    assert [o.shape for o in plan.out] == [(6, 576), (6, 576)]
    assert plan.num_warps == tk.RMS_NORM_TUNED["default"][1024]["num_warps"]
    plan = tk.rms_norm_launch((5, 4096), jnp.float32, eps=1e-6, residual=False,
                              device_kind="NVIDIA H100 80GB HBM3", num_warps=2)
    assert plan.kernel == "rms_norm_kernel" and len(plan.out) == 1 and plan.num_warps == 2


def test_silu_mul_launch():
    plan = tk.silu_mul_launch(9216, jnp.bfloat16)
    block = tk.SILU_MUL_TUNED["default"]["block_size"]
    assert plan.grid == (-(-9216 // block),) and plan.scalars == (9216,)
    assert plan.meta == {"BLOCK": block}
    assert tk.silu_mul_launch(1000, jnp.float32, block_size=256).grid == (4,)
    with pytest.raises(ValueError, match="block_size=100 must be a power of two"):
        tk.silu_mul_launch(1000, jnp.float32, block_size=100)


@pytest.mark.parametrize("param", ["out_shape", "out_type"])
def test_triton_call_signatures(param):
    """jax-triton 0.3 takes ``out_shape``, 0.4 ``out_type``: the shim passes the right one."""
    seen = {}
    if param == "out_shape":
        def call(*args, kernel, out_shape, grid, **kw):
            seen.update(args=args, kernel=kernel, out=out_shape, grid=grid, **kw)
    else:
        def call(*args, kernel, out_type=None, grid, **kw):
            seen.update(args=args, kernel=kernel, out=out_type, grid=grid, **kw)
    _compat.triton_call(1, 2, kernel="k", out="o", grid=(3,), call=call, num_warps=4, BLOCK=8)
    assert seen == dict(args=(1, 2), kernel="k", out="o", grid=(3,), num_warps=4, BLOCK=8)


def _emulate(launch, *arrays):
    """What the Triton kernels compute, from the launch's arguments, in NumPy: checks the
    argument order and outputs that the wrapper hands jax-triton."""
    def host(*arrays):
        a = [np.asarray(x, np.float32) for x in arrays]
        if launch.kernel == "rope_kernel":
            x, pos, inv = a
            heads, head_dim = launch.scalars
            assert x.shape == launch.out[0].shape == (pos.shape[0], heads, head_dim)
            assert launch.grid == (pos.shape[0], -(-heads // launch.meta["BLOCK_HEADS"]))
            angle = (pos[:, None] * inv[None, :])[:, None, :]  # float32, as the kernel
            if launch.meta["INTERLEAVED"]:
                x1, x2 = x[..., 0::2], x[..., 1::2]
            else:
                x1, x2 = np.split(x, 2, axis=-1)
            r1 = x1 * np.cos(angle) - x2 * np.sin(angle)
            r2 = x2 * np.cos(angle) + x1 * np.sin(angle)
            out = (np.stack([r1, r2], -1).reshape(x.shape) if launch.meta["INTERLEAVED"]
                   else np.concatenate([r1, r2], -1))
            return out.astype(launch.out[0].dtype)
        if launch.kernel == "silu_mul_kernel":
            (size,) = launch.scalars
            g, u = a
            assert g.shape == u.shape == (size,)
            return (g / (1 + np.exp(-g)) * u).astype(launch.out[0].dtype)
        n_cols, eps = launch.scalars
        h = a[0] if launch.kernel == "rms_norm_kernel" else a[0] + a[1]
        h = h.astype(launch.out[0].dtype)
        assert h.shape == launch.out[0].shape and h.shape[1] == n_cols
        assert launch.grid == (h.shape[0],)
        h32 = h.astype(np.float32)
        y = (h32 / np.sqrt((h32 * h32).mean(-1, keepdims=True) + eps) * a[-1]).astype(h.dtype)
        return (y, h) if len(launch.out) == 2 else y

    shapes = launch.out if len(launch.out) > 1 else launch.out[0]
    return jax.pure_callback(host, shapes, *arrays)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(tk, "_launch", _emulate)


CASES = [((2, 3, 576), jnp.bfloat16), ((5, 64), jnp.float32), ((0, 64), jnp.float16)]


@pytest.mark.parametrize("shape,dtype", CASES, ids=case_id)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_plumbing(emulated, shape, dtype, with_residual):
    gen = rng(len(shape), shape[-1])
    x, r, w = normal(gen, shape, dtype), normal(gen, shape, dtype), normal(gen, shape[-1:], dtype)
    residual = r if with_residual else None
    out = jax.jit(lambda x, w, r: tk.rms_norm(x, w, eps=1e-5, residual=r))(x, w, residual)
    want = rms_norm_ref(x, w, eps=1e-5, residual=residual)
    if with_residual:
        assert_close(out[0], want[0], implementation="triton", allow_zero_ref=not x.size)
        assert_close(out[1], want[1], implementation="triton", allow_zero_ref=not x.size)
    else:
        assert_close(out, want, implementation="triton", allow_zero_ref=not x.size)


def test_rms_norm_vmap_and_grad(emulated):
    gen = rng(7)
    x, r = normal(gen, (3, 4, 32)), normal(gen, (3, 4, 32))
    w, ws = normal(gen, (32,)), normal(gen, (3, 32))

    def ours(x, w, r):
        return tk.rms_norm(x, w, eps=1e-6, residual=r)

    def xla(x, w, r):
        return fj.rms_norm(x, w, eps=1e-6, residual=r, implementation="xla")

    for in_axes, args in (((0, None, 0), (x, w, r)), ((0, None, None), (x, w, r[0])),
                          ((0, 0, 0), (x, ws, r))):
        got = jax.vmap(ours, in_axes)(*args)
        want = jax.vmap(xla, in_axes)(*args)
        for g, v in zip(got, want, strict=True):
            np.testing.assert_allclose(g, v, rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda x, w, r: jnp.sum(jnp.sin(f(x, w, r)[0]))  # noqa: E731
    for g, v in zip(jax.grad(loss(ours), (0, 1, 2))(x, w, r),
                    jax.grad(loss(xla), (0, 1, 2))(x, w, r), strict=True):
        np.testing.assert_allclose(g, v, rtol=1e-5, atol=1e-5)


def test_silu_mul_plumbing_vmap_and_grad(emulated):
    gen = rng(8)
    gate, up = normal(gen, (3, 5, 200), scale=4.0), normal(gen, (3, 5, 200))
    out = jax.jit(lambda g, u: tk.silu_mul(g, u, block_size=256))(gate, up)
    assert_close(out, silu_mul_ref(gate, up), implementation="triton")
    got = jax.vmap(tk.silu_mul, (0, None))(gate, up[0])
    np.testing.assert_allclose(got, jax.vmap(fj.silu_mul, (0, None))(gate, up[0]), rtol=1e-6)
    loss = lambda f: lambda g, u: jnp.sum(jnp.sin(f(g, u)))  # noqa: E731
    for g, v in zip(jax.grad(loss(tk.silu_mul), (0, 1))(gate, up),
                    jax.grad(loss(fj.silu_mul), (0, 1))(gate, up), strict=True):
        np.testing.assert_allclose(g, v, rtol=1e-4, atol=1e-5)
    assert tk.silu_mul(gate[:0], up[:0]).shape == (0, 5, 200)


def test_rope_launch():
    plan = tk.rope_launch((2, 5, 3, 80), jnp.bfloat16, interleaved=True)
    assert plan.kernel == "rope_kernel" and plan.scalars == (3, 80)
    assert plan.meta == {"BLOCK_HEADS": 4, "HALF": 64, "INTERLEAVED": True}
    assert plan.grid == (10, 1) and plan.out[0].shape == (10, 3, 80)
    plan = tk.rope_launch((1, 7, 32, 128), jnp.float32, interleaved=False, block_heads=8)
    assert plan.grid == (7, 4) and plan.meta["BLOCK_HEADS"] == 8
    with pytest.raises(ValueError, match="block_heads=3 must be a power of two"):
        tk.rope_launch((1, 7, 32, 128), jnp.float32, interleaved=False, block_heads=3)
    assert "head_dim 1024 > 512" in tk.rope_supports(
        dict(x=jax.ShapeDtypeStruct((1, 2, 1, 1024), jnp.bfloat16)))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=case_id)
def test_rope_plumbing_vmap_and_grad(emulated, interleaved, dtype):
    gen = rng(10)
    x = normal(gen, (2, 6, 3, 16), dtype)
    positions = jnp.asarray(gen.integers(0, 300, (2, 6)), jnp.int32)
    kw = dict(theta=10000.0, scaling=None, interleaved=interleaved)
    out = jax.jit(lambda x, p: tk.rope(x, p, **kw))(x, positions)
    assert_close(out, rope_ref(x, positions, interleaved=interleaved), implementation="triton")
    xs = normal(gen, (4, 2, 6, 3, 16), dtype)
    got = jax.vmap(lambda x: tk.rope(x, positions, **kw))(xs)
    want = jax.vmap(lambda x: fj.rope(x, positions, **kw, implementation="xla"))(xs)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2, atol=1e-2)
    if dtype == jnp.float32:
        loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x)))  # noqa: E731
        g = jax.grad(loss(lambda x: tk.rope(x, positions, **kw)))(x)
        w = jax.grad(loss(lambda x: fj.rope(x, positions, **kw, implementation="xla")))(x)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


class Triton:
    """The skip rule of the real kernels: jax-triton installed for this JAX, and a GPU."""

    IMPLEMENTATION = "triton"
    INTERPRET = False

    @classmethod
    def skip_reason(cls):
        return (reason := tk.available()) and f"jax-triton kernels: {reason}"


class TestRmsNormTriton(Triton, RmsNormCases):
    CASES = by_id([(shape, dtype, dtype, with_residual)
                   for shape, dtype in [*CASES, ((4, 4096), jnp.bfloat16),
                                        ((3, 5000), jnp.float16)]
                   for with_residual in (False, True)])
    # The VJP is the XLA reference's (custom_vjp), checked with the launch emulated:
    # test_rms_norm_vmap_and_grad.
    test_grad_matches_xla_vjp_and_float64 = None


class TestSiluMulTriton(Triton, SiluMulCases):
    CASES = by_id([((2, 3, 1536), jnp.bfloat16), ((7, 999), jnp.float32)])


class TestRopeTriton(Triton, RopeCases):
    # Positions up to 5000.
    CASES = by_id([(shape, dtype, 1e4, None, interleaved, 4950)
                   for shape, dtype in [((2, 37, 9, 128), jnp.bfloat16),
                                        ((1, 5, 3, 80), jnp.float32)]
                   for interleaved in (False, True)])
