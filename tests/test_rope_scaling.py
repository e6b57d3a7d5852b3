"""The context-extension RoPE kinds (yarn, longrope, dynamic NTK, proportional) against
float64 references written from the published formulas, and against transformers.

YaRN: Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models"
(2023), with the ramp over the pair index of its reference code (the correction range
``d ln(L / (2 pi r)) / (2 ln base)``), which is what checkpoints were trained with.
LongRoPE: Ding et al. (2024), Phi-3's per-frequency factors, the long set once the call
reaches the original context. Dynamic NTK: the base times
``(factor * len / L - (factor - 1)) ** (d / (d - 2))`` past the context ``L``.
Proportional (Gemma 4): the first ``int(p * d // 2)`` pairs rotate with the exponent
over the full ``d``; the rest do not rotate.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.calls import case_id, jcall
from cases.inputs import normal, rng
from cases.references import f64

import forge_jax as fj
from forge_jax import tolerances
from forge_jax.ops.rope import host_table_reason, inverse_frequencies, yarn_mscale

HEAD_DIM = 128
THETA = 1_000_000.0
ORIGINAL = 4096


def _factors(seed, lo, hi):
    return tuple(float(v) for v in np.random.default_rng(seed).uniform(lo, hi, HEAD_DIM // 2))


YARN = fj.RopeScaling("yarn", 4.0, original_max_position_embeddings=ORIGINAL)
YARN_UNTRUNCATED = fj.RopeScaling("yarn", 8.0, original_max_position_embeddings=ORIGINAL,
                                  beta_fast=16.0, beta_slow=2.0, truncate=False)
YARN_MSCALE = fj.RopeScaling("yarn", 40.0, original_max_position_embeddings=ORIGINAL,
                             mscale=1.0, mscale_all_dim=0.707)
YARN_GIVEN = fj.RopeScaling("yarn", 4.0, original_max_position_embeddings=ORIGINAL,
                            attention_factor=0.9)
LONGROPE = fj.RopeScaling("longrope", 32.0, original_max_position_embeddings=ORIGINAL,
                          short_factor=_factors(1, 1.0, 1.2), long_factor=_factors(2, 1.0, 40.0))
DYNAMIC = fj.RopeScaling("dynamic", 2.0, original_max_position_embeddings=ORIGINAL)
PROPORTIONAL = fj.RopeScaling("proportional", partial_rotary_factor=0.25)
SCALINGS = [YARN, YARN_UNTRUNCATED, YARN_MSCALE, YARN_GIVEN, LONGROPE, DYNAMIC, PROPORTIONAL]
SCALING_IDS = ["yarn", "yarn_untruncated", "yarn_mscale", "yarn_given", "longrope", "dynamic",
               "proportional"]


# --- float64 references -------------------------------------------------------------------


def inv_freq_ref(head_dim, theta, s, length):
    """float64 frequencies of a call whose largest position is ``length - 1``."""
    i = np.arange(head_dim // 2, dtype=np.float64)
    plain = theta ** (-2 * i / head_dim)
    if s.kind == "yarn":
        def dim_of(rotations):  # the pair index turning `rotations` times over the context
            return head_dim * math.log(s.original_max_position_embeddings
                                       / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = np.clip((i - low) / (high - low), 0, 1)  # 0: extrapolate, 1: interpolate
        return plain * (1 - ramp) + plain / s.factor * ramp
    if s.kind == "longrope":
        long_ = length > s.original_max_position_embeddings
        return plain / np.asarray(s.long_factor if long_ else s.short_factor)
    if s.kind == "dynamic":
        n = max(length, s.original_max_position_embeddings)
        base = theta * (s.factor * n / s.original_max_position_embeddings
                        - (s.factor - 1)) ** (head_dim / (head_dim - 2))
        return base ** (-2 * i / head_dim)
    assert s.kind == "proportional"
    rotated = int(s.partial_rotary_factor * head_dim // 2)
    return np.where(i < rotated, plain, 0.0) / s.factor


def attention_factor_ref(s):
    if s.attention_factor is not None:
        return s.attention_factor
    if s.kind == "yarn":
        def m(scale, k):
            return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1
        if s.mscale and s.mscale_all_dim:
            return m(s.factor, s.mscale) / m(s.factor, s.mscale_all_dim)
        return m(s.factor, 1.0)
    if s.kind == "longrope":
        return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))
    return 1.0


def cos_sin_ref(positions, head_dim, theta, s):
    positions = np.asarray(positions)
    angles = positions[..., None].astype(np.float64) * inv_freq_ref(
        head_dim, theta, s, int(positions.max()) + 1)
    a = attention_factor_ref(s)
    return a * np.cos(angles), a * np.sin(angles), angles


def assert_cos_sin_close(cos, sin, positions, head_dim, theta, s):
    cos_ref, sin_ref, angles = cos_sin_ref(positions, head_dim, theta, s)
    # float32 angles: the frequency (rtol ~1.5e-7 against float64) and the product (half
    # an ulp) each move the angle by a few 1e-7 of itself.
    slack = 4e-7 * np.abs(angles) * attention_factor_ref(s)
    tol = tolerances.tolerance(jnp.float32)
    for got, want in ((cos, cos_ref), (sin, sin_ref)):
        err = np.abs(f64(got) - want)
        assert (err <= tol.atol + tol.rtol * np.abs(want) + slack).all(), err.max()


# --- frequencies, factors and tables ------------------------------------------------------


def test_yarn_mscale():
    assert yarn_mscale(1.0) == 1.0 and yarn_mscale(0.5, 2.0) == 1.0
    assert yarn_mscale(40.0) == pytest.approx(0.1 * math.log(40.0) + 1, rel=1e-15)
    assert yarn_mscale(40.0, 0.707) == pytest.approx(0.0707 * math.log(40.0) + 1, rel=1e-15)


@pytest.mark.parametrize("scaling", SCALINGS, ids=SCALING_IDS)
@pytest.mark.parametrize("length", [1, ORIGINAL, ORIGINAL + 1, 5 * ORIGINAL], ids=case_id)
def test_call_frequencies_match_float64(scaling, length):
    """The frequencies at position 1 of a call whose largest position is ``length - 1``."""
    positions = jnp.asarray([[1, length - 1]], jnp.int32)
    cos, sin = jcall(fj.rope_cos_sin, positions, head_dim=HEAD_DIM, theta=THETA,
                     scaling=scaling)
    a = attention_factor_ref(scaling)
    got = np.arctan2(f64(sin)[0, 0] / a, f64(cos)[0, 0] / a)
    np.testing.assert_allclose(got, inv_freq_ref(HEAD_DIM, THETA, scaling, length),
                               rtol=1e-6, atol=1e-12)  # a few float32 ulps
    np.testing.assert_allclose(np.hypot(f64(sin), f64(cos)), a, rtol=3e-7)


@pytest.mark.parametrize("scaling", SCALINGS, ids=SCALING_IDS)
def test_cos_sin_past_the_original_context(scaling):
    g = rng(38)
    positions = np.concatenate([[0, ORIGINAL - 1, ORIGINAL, 4 * ORIGINAL - 1],
                                g.integers(ORIGINAL, 4 * ORIGINAL, 12)]).reshape(2, 8)
    cos, sin = jcall(fj.rope_cos_sin, jnp.asarray(positions, jnp.int32), head_dim=HEAD_DIM,
                     theta=THETA, scaling=scaling)
    assert cos.dtype == sin.dtype == jnp.float32 and cos.shape == (2, 8, HEAD_DIM // 2)
    assert_cos_sin_close(cos, sin, positions, HEAD_DIM, THETA, scaling)
    # The same call within the original context: short factors, the plain base.
    inside = positions % ORIGINAL
    cos, sin = jcall(fj.rope_cos_sin, jnp.asarray(inside, jnp.int32), head_dim=HEAD_DIM,
                     theta=THETA, scaling=scaling)
    assert_cos_sin_close(cos, sin, inside, HEAD_DIM, THETA, scaling)


def test_scalings_differ_where_they_should():
    """The references are not vacuous: each kind moves the frequencies it should."""
    plain = THETA ** (-2 * np.arange(HEAD_DIM // 2) / HEAD_DIM)
    yarn = inv_freq_ref(HEAD_DIM, THETA, YARN, 1)
    assert yarn[0] == plain[0] and yarn[-1] == pytest.approx(plain[-1] / 4, rel=1e-12)
    assert ((yarn < plain) & (yarn > plain / 4)).any()  # the ramp
    assert not np.allclose(inv_freq_ref(HEAD_DIM, THETA, LONGROPE, ORIGINAL),
                           inv_freq_ref(HEAD_DIM, THETA, LONGROPE, ORIGINAL + 1))
    np.testing.assert_allclose(inv_freq_ref(HEAD_DIM, THETA, DYNAMIC, ORIGINAL), plain)
    assert (inv_freq_ref(HEAD_DIM, THETA, DYNAMIC, 3 * ORIGINAL)[1:] < plain[1:]).all()
    assert (inv_freq_ref(HEAD_DIM, THETA, PROPORTIONAL, 1)[16:] == 0).all()


def rope_ref64(x, positions, scaling, interleaved):
    """float64 RoPE of ``x [batch, seq, heads, HEAD_DIM]`` with the tables of ``scaling``,
    and the slack its float32 angles are allowed."""
    cos, sin, angles = cos_sin_ref(positions, HEAD_DIM, THETA, scaling)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x64 = f64(x)
    if interleaved:
        x1, x2 = x64[..., 0::2], x64[..., 1::2]
    else:
        x1, x2 = x64[..., :HEAD_DIM // 2], x64[..., HEAD_DIM // 2:]
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if interleaved:
        want = np.stack([r1, r2], axis=-1).reshape(x.shape)
    else:
        want = np.concatenate([r1, r2], axis=-1)
    slack = 4e-7 * np.abs(angles).max() * np.abs(x64).max() * 2 * attention_factor_ref(scaling)
    return want, slack


ROPE_KINDS = pytest.mark.parametrize(
    "scaling", [YARN_MSCALE, LONGROPE, DYNAMIC, PROPORTIONAL],
    ids=["yarn_mscale", "longrope", "dynamic", "proportional"])


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@ROPE_KINDS
def test_rope_op_applies_the_tables(scaling, interleaved):
    g = rng(7)
    x = normal(g, (2, 6, 3, HEAD_DIM))
    positions = np.asarray(g.integers(0, 3 * ORIGINAL, (2, 6)))
    out = jcall(fj.rope, x, jnp.asarray(positions, jnp.int32), theta=THETA, scaling=scaling,
                interleaved=interleaved)
    x64 = f64(x)
    want, slack = rope_ref64(x, positions, scaling, interleaved)
    np.testing.assert_allclose(f64(out), want, rtol=1e-5, atol=1e-5 + slack)
    if scaling.kind == "proportional":  # the pairs that do not rotate pass through exactly
        still = np.arange(HEAD_DIM) >= 32 if interleaved else (np.arange(HEAD_DIM) % 64) >= 16
        np.testing.assert_array_equal(f64(out)[..., still], x64[..., still])
        assert not np.allclose(f64(out)[..., ~still], x64[..., ~still])


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas_gpu_interpret", "pallas_tpu_interpret"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@ROPE_KINDS
def test_rope_kernels_take_the_tables(scaling, interleaved, implementation):
    """The Pallas RoPE kernels (interpreted) read the call's frequencies (longrope's set by
    length, dynamic NTK's base) and multiply cos/sin by the attention factor."""
    g = rng(17)
    x = normal(g, (2, 16, 2, HEAD_DIM))
    for top in (ORIGINAL - 1, 3 * ORIGINAL):  # within and past the original context
        positions = np.sort(g.integers(0, top, (2, 16)), axis=1)
        positions[0, -1] = top
        out = jcall(fj.rope, x, jnp.asarray(positions, jnp.int32), theta=THETA,
                    scaling=scaling, interleaved=interleaved, implementation=implementation)
        want, slack = rope_ref64(x, positions, scaling, interleaved)
        np.testing.assert_allclose(f64(out), want, rtol=1e-5, atol=1e-5 + slack)


def test_rope_scaling_under_jit_vmap_and_grad():
    g = rng(8)
    x = normal(g, (1, 4, 2, 64))
    positions = jnp.asarray([[0, 9000, 9001, 12000]], jnp.int32)
    scaling = fj.RopeScaling("yarn", 4.0, original_max_position_embeddings=2048)
    direct = fj.rope(x, positions, theta=THETA, scaling=scaling)
    mapped = jax.vmap(lambda xi, pi: fj.rope(xi[None], pi[None], theta=THETA,
                                             scaling=scaling)[0])(x, positions)
    np.testing.assert_allclose(f64(mapped), f64(direct), rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda v: jnp.sum(fj.rope(v, positions, theta=THETA, scaling=scaling)
                                      ** 2))(x)
    # Rotation times the attention factor a: |rope(x)|^2 = a^2 |x|^2, so the gradient is 2a^2 x.
    a = scaling.resolved_attention_factor
    np.testing.assert_allclose(f64(grad), 2 * a * a * f64(x), rtol=2e-5, atol=2e-5)


# --- Hugging Face parity ------------------------------------------------------------------


def _hf_config(params, max_position_embeddings):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4,
                                    head_dim=HEAD_DIM,
                                    max_position_embeddings=max_position_embeddings,
                                    rope_parameters=dict(params))


HF_CASES = {
    "yarn": (dict(rope_type="yarn", rope_theta=THETA, factor=4.0,
                  original_max_position_embeddings=ORIGINAL), 4 * ORIGINAL),
    "yarn_mscale": (dict(rope_type="yarn", rope_theta=THETA, factor=40.0, mscale=1.0,
                         mscale_all_dim=0.707, beta_fast=32, beta_slow=1,
                         original_max_position_embeddings=ORIGINAL), 40 * ORIGINAL),
    "yarn_untruncated": (dict(rope_type="yarn", rope_theta=THETA, factor=8.0, truncate=False,
                              original_max_position_embeddings=ORIGINAL), 8 * ORIGINAL),
    "longrope": (dict(rope_type="longrope", rope_theta=THETA,
                      short_factor=list(LONGROPE.short_factor),
                      long_factor=list(LONGROPE.long_factor),
                      original_max_position_embeddings=ORIGINAL), 32 * ORIGINAL),
    "dynamic": (dict(rope_type="dynamic", rope_theta=THETA, factor=2.0), ORIGINAL),
    "proportional": (dict(rope_type="proportional", rope_theta=THETA, partial_rotary_factor=0.25),
                     ORIGINAL),
}


@pytest.mark.parametrize("name", list(HF_CASES))
def test_matches_transformers_rotary_embedding(name):
    """cos/sin of transformers' rotary embedding (its init function, attention factor and
    the per-call longrope / dynamic update) at lengths inside and past the context."""
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    params, max_pos = HF_CASES[name]
    scaling = fj.RopeScaling.from_hf(params, max_position_embeddings=max_pos)
    config = _hf_config(params, max_pos)
    for length in (ORIGINAL // 2, ORIGINAL, ORIGINAL + 1, 3 * ORIGINAL):
        rotary = llama.LlamaRotaryEmbedding(config)  # fresh: dynamic NTK keeps state
        positions = np.arange(length - 8, length)[None]
        cos_hf, sin_hf = rotary(torch.zeros(1, dtype=torch.float32),
                                torch.as_tensor(positions))
        cos, sin = jcall(fj.rope_cos_sin, jnp.asarray(positions, jnp.int32), head_dim=HEAD_DIM,
                         theta=THETA, scaling=scaling)
        half = HEAD_DIM // 2
        # float32 on both sides; the angles at ~1e4 rad carry ~1e-3 of rounding between
        # two float32 pow implementations.
        np.testing.assert_allclose(f64(cos), cos_hf.double().numpy()[..., :half], atol=4e-3)
        np.testing.assert_allclose(f64(sin), sin_hf.double().numpy()[..., :half], atol=4e-3)
        np.testing.assert_allclose(np.hypot(f64(cos), f64(sin)),
                                   np.hypot(cos_hf.double().numpy(),
                                            sin_hf.double().numpy())[..., :half], rtol=1e-6)


@pytest.mark.parametrize("name", list(HF_CASES))
def test_frequencies_match_transformers_init_functions(name):
    pytest.importorskip("torch")
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    params, max_pos = HF_CASES[name]
    scaling = fj.RopeScaling.from_hf(params, max_position_embeddings=max_pos)
    init = rope_utils.ROPE_INIT_FUNCTIONS[params["rope_type"]]
    inv_hf, factor_hf = init(_hf_config(params, max_pos), None)
    np.testing.assert_allclose(inverse_frequencies(HEAD_DIM, THETA, scaling),
                               inv_hf.double().numpy(), rtol=3e-7)
    assert scaling.resolved_attention_factor == pytest.approx(factor_hf, rel=1e-12)
    if scaling.kind == "longrope":
        inv_hf, _ = init(_hf_config(params, max_pos), None, seq_len=ORIGINAL + 1)
        np.testing.assert_allclose(inverse_frequencies(HEAD_DIM, THETA, scaling, long=True),
                                   inv_hf.double().numpy(), rtol=3e-7)


# --- reading Hugging Face configs ---------------------------------------------------------


def test_from_hf_defaults_as_transformers():
    # yarn: beta defaults, factor and original context derived from max_position_embeddings.
    s = fj.RopeScaling.from_hf({"rope_type": "yarn", "factor": 4.0, "beta_fast": None},
                               max_position_embeddings=32768)
    assert (s.beta_fast, s.beta_slow, s.original_max_position_embeddings) == (32.0, 1.0, 32768)
    s = fj.RopeScaling.from_hf({"rope_type": "yarn", "original_max_position_embeddings": 4096},
                               max_position_embeddings=163840)
    assert s.factor == 40.0
    # longrope: factor from the two lengths; a top-level original context wins (Phi-3).
    s = fj.RopeScaling.from_hf(
        {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
         "original_max_position_embeddings": 2048},
        max_position_embeddings=131072, original_max_position_embeddings=4096)
    assert (s.factor, s.original_max_position_embeddings) == (32.0, 4096)
    assert s.resolved_attention_factor == pytest.approx(
        math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-15)
    s = fj.RopeScaling.from_hf({"type": "dynamic", "factor": 2.0}, max_position_embeddings=2048)
    assert s == fj.RopeScaling("dynamic", 2.0, original_max_position_embeddings=2048)
    assert fj.RopeScaling.from_hf({"rope_type": "default", "rope_theta": 1e4}) is None


def test_from_hf_per_layer_type():
    """Gemma 4's rope_parameters: one dict per layer type."""
    params = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                 "rope_theta": 1000000.0}}
    assert fj.RopeScaling.from_hf(params, "sliding_attention") is None
    assert fj.RopeScaling.from_hf(params, "full_attention") == PROPORTIONAL
    assert fj.RopeScaling.layer_parameters(params, "full_attention")["rope_theta"] == 1e6
    flat = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    assert fj.RopeScaling.from_hf(flat, "full_attention") == fj.RopeScaling("linear", 2.0)
    with pytest.raises(ValueError, match=r"keyed by layer type \['full_attention', "
                                         r"'sliding_attention'\]: pass layer_type="):
        fj.RopeScaling.from_hf(params)
    with pytest.raises(ValueError, match=r"no entry for layer_type='chunked_attention'"):
        fj.RopeScaling.from_hf(params, "chunked_attention")


BAD = {
    "unknown_key": (lambda: fj.RopeScaling.from_hf(
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8,
         "extrapolation_factor": 1.0}), r"unsupported yarn rope parameters "
                                        r"\['extrapolation_factor'\]"),
    "yarn_no_context": (lambda: fj.RopeScaling.from_hf({"rope_type": "yarn", "factor": 2.0}),
                        r"yarn rope scaling needs original_max_position_embeddings"),
    "longrope_missing": (lambda: fj.RopeScaling.from_hf(
        {"rope_type": "longrope", "short_factor": [1.0], "factor": 2.0,
         "original_max_position_embeddings": 8}), r"needs \['long_factor'\]"),
    "dynamic_no_length": (lambda: fj.RopeScaling.from_hf({"rope_type": "dynamic", "factor": 2.0}),
                          r"dynamic rope scaling needs max_position_embeddings="),
    "longrope_lengths": (lambda: fj.RopeScaling("longrope", 2.0, short_factor=(1.0, 1.0),
                                                long_factor=(1.0,)),
                         r"len\(self.short_factor\)=2, len\(self.long_factor\)=1"),
    "longrope_factor_value": (lambda: fj.RopeScaling("longrope", 2.0, short_factor=(1.0, 0.0),
                                                     long_factor=(1.0, 1.0)),
                              r"short_factor entries must be finite and > 0"),
    "longrope_head_dim": (lambda: fj.rope_cos_sin(jnp.arange(3), 8, scaling=fj.RopeScaling(
        "longrope", 2.0, short_factor=(1.0,) * 3, long_factor=(2.0,) * 3)),
                          r"head_dim // 2 = 4 entries, got 3"),
    "yarn_betas": (lambda: fj.RopeScaling("yarn", 2.0, beta_fast=1.0, beta_slow=32.0),
                   r"beta_fast > beta_slow"),
    "yarn_attention_factor": (lambda: fj.RopeScaling("yarn", 2.0, attention_factor=-1.0),
                              r"attention_factor=-1\.0"),
    "proportional_fraction": (lambda: fj.RopeScaling("proportional", partial_rotary_factor=1.5),
                              r"partial_rotary_factor=1\.5"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_scaling_is_refused_in_one_line(name):
    make, pattern = BAD[name]
    with pytest.raises((ValueError, TypeError), match=pattern) as info:
        make()
    assert "\n" not in str(info.value)


def test_host_table_reasons():
    """What a kernel that reads one host table alone could not carry (the jax-triton RoPE
    kernel refuses with these)."""
    assert host_table_reason(None) is None and host_table_reason(PROPORTIONAL) is None
    assert host_table_reason(fj.RopeScaling("yarn", 1.0, attention_factor=1.0)) is None
    assert "attention factor 1.13863" in host_table_reason(YARN)
    assert "largest position" in host_table_reason(LONGROPE)
    assert "largest position" in host_table_reason(DYNAMIC)
