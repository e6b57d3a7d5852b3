"""The implementation registry: auto choice, override precedence, fallback reasons,
strict errors, and trace-time selection.

A fake implementation that returns a recognisable constant (42) proves which
implementation ran; the ``fake`` fixture registers it and restores the registry.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.inputs import normal, rng
from cases.references import rms_norm_ref, softmax_ref

import forge_jax as fj
from forge_jax import dispatch
from forge_jax.ops.norm import rms_norm_xla

MARK = 42.0
PLATFORM = jax.default_backend()  # "cpu" here; the GPU machine runs the same tests


class Fake:
    """A registered fake implementation; counts its calls (i.e. its traces under jit)."""

    def __init__(self, op, *, priority=None, reason=None, unavailable=None):
        self.op, self.calls, self.reason, self.unavailable = op, [], reason, unavailable
        dispatch.register(op, "fake", priority=priority, supports=self._supports,
                          available=lambda: self.unavailable, description="test fake")(self)

    def _supports(self, args, platform):
        self.seen = (dict(args), platform)
        return self.reason

    def __call__(self, **args):
        self.calls.append(args)
        x = args.get("x")
        out = jnp.full(x.shape, MARK, x.dtype)
        return (out, out) if args.get("residual") is not None else out


def auto_rejected(selection):
    """The rejections of implementations auto selection considered (the by-name-only ones,
    e.g. the interpret-mode kernels, are listed too, with that reason)."""
    return {name: reason for name, reason in selection.rejected.items()
            if "ask for it by name" not in reason}


@pytest.fixture
def fake():
    """``fake(op, priority=..., reason=..., unavailable=...)`` registers a fake."""
    registered = []

    def make(op="rms_norm", **kw):
        impl = Fake(op, **kw)
        registered.append(op)
        return impl

    yield make
    for op in set(registered):
        if "fake" in dispatch.implementations(op):
            dispatch.unregister(op, "fake")
    for op in registered:
        assert "fake" not in dispatch.implementations(op)


@pytest.fixture
def xw():
    g = rng(60)
    return normal(g, (3, 8)), normal(g, (8,))


def is_fake(out):
    return np.all(np.asarray(out, np.float64) == MARK)


def test_auto_picks_xla_on_cpu(xw):
    x, w = xw
    sel = fj.explain("rms_norm", x, w)
    assert (sel.implementation, sel.source, sel.platform) == ("xla", "auto", PLATFORM)
    out = fj.rms_norm(x, w)
    assert_close(out, rms_norm_ref(x, w))
    assert dispatch.last_selection("rms_norm").implementation == "xla"
    for op in ("matmul", "rms_norm", "silu_mul", "softmax", "rope", "attention", "embedding"):
        assert "xla" in dispatch.implementations(op)
        assert PLATFORM in dispatch.implementations(op)["xla"].priority


def test_higher_priority_implementation_wins_auto(fake, xw):
    impl = fake(priority={PLATFORM: 10})
    x, w = xw
    assert is_fake(fj.rms_norm(x, w))
    assert len(impl.calls) == 1
    sel = dispatch.last_selection("rms_norm")
    assert (sel.implementation, sel.source) == ("fake", "auto")
    # explain() also says why the others did not run.
    assert auto_rejected(sel) == {"xla": f"lower priority on {PLATFORM} than 'fake'"}
    # The implementation receives the validated arguments, and sees them in supports().
    assert impl.calls[0]["eps"] == 1e-6 and impl.calls[0]["residual"] is None
    assert impl.seen[1] == PLATFORM and impl.seen[0]["x"] is x


def test_fake_on_another_op_needs_no_op_code(fake):
    impl = fake("softmax", priority={PLATFORM: 5})
    x = normal(rng(61), (2, 5))
    assert is_fake(fj.softmax(x))
    assert impl.calls[0]["axis"] == 1  # axis arrives normalised
    assert_close(fj.softmax(x, implementation="xla"), softmax_ref(x))


def test_rejecting_supports_falls_back_with_reason(fake, xw, capsys, caplog):
    reason = "needs head_dim % 128 == 0, got 8"
    impl = fake(priority={PLATFORM: 10}, reason=reason)
    x, w = xw
    with caplog.at_level(logging.DEBUG, logger="forge_jax.dispatch"):
        out = fj.rms_norm(x, w)
    assert_close(out, rms_norm_ref(x, w))  # the XLA result, not the fake's 42s
    assert not impl.calls
    sel = dispatch.last_selection("rms_norm")
    assert sel.implementation == "xla" and auto_rejected(sel) == {"fake": reason}
    explained = fj.explain("rms_norm", x, w)
    assert explained.implementation == "xla" and explained.rejected["fake"] == reason
    assert reason in str(explained) and "'fake'" in str(explained)
    assert any(reason in r.getMessage() for r in caplog.records)  # the debug log has it
    captured = capsys.readouterr()  # ...and nothing is printed, no traceback
    assert captured.out == "" and captured.err == ""


def test_unavailable_toolchain_is_a_fallback_reason(fake, xw):
    fake(priority={PLATFORM: 10}, unavailable="jax-triton not importable: needs a GPU jaxlib")
    sel = fj.explain("rms_norm", *xw)
    assert sel.implementation == "xla"
    assert "jax-triton not importable" in sel.rejected["fake"]


def test_by_name_only_implementation_is_never_automatic(fake, xw):
    impl = fake(priority=None)
    x, w = xw
    assert not is_fake(fj.rms_norm(x, w))
    assert not impl.calls
    assert "not chosen automatically" in fj.explain("rms_norm", x, w).rejected["fake"]
    assert is_fake(fj.rms_norm(x, w, implementation="fake"))


def test_precedence_call_beats_context_beats_env(fake, xw, monkeypatch):
    fake(priority=None)
    x, w = xw

    def ran():
        out = fj.rms_norm(x, w)
        sel = dispatch.last_selection("rms_norm")
        return ("fake" if is_fake(out) else "xla"), sel.implementation, sel.source

    assert ran() == ("xla", "xla", "auto")
    monkeypatch.setenv(dispatch.ENV_VAR, "fake")
    assert ran() == ("fake", "fake", "env")
    with fj.use_implementation("xla"):
        assert ran() == ("xla", "xla", "context")
        with fj.use_implementation("fake"):  # the innermost block wins
            assert ran() == ("fake", "fake", "context")
        out = fj.rms_norm(x, w, implementation="fake")
        assert is_fake(out) and dispatch.last_selection("rms_norm").source == "call"
        with fj.use_implementation(None):  # back to auto, even with the env var set
            assert ran() == ("xla", "xla", "auto")
    with fj.use_implementation("fake"):
        out = fj.rms_norm(x, w, implementation="xla")
        assert not is_fake(out) and dispatch.last_selection("rms_norm").source == "call"
    monkeypatch.delenv(dispatch.ENV_VAR)
    assert ran() == ("xla", "xla", "auto")


def test_env_and_context_preferences_fall_back(fake, xw, monkeypatch, capsys):
    fake(priority=None, reason="fake cannot do this")
    x, w = xw
    monkeypatch.setenv(dispatch.ENV_VAR, "fake")
    assert not is_fake(fj.rms_norm(x, w))
    sel = dispatch.last_selection("rms_norm")
    assert sel.implementation == "xla" and sel.rejected["fake"] == "fake cannot do this"
    assert "env preference 'fake' rejected" in sel.source
    # An op without an implementation of that name falls back too (e.g. "pallas" for a
    # model whose ops do not all have a kernel), as long as some op has it.
    fake("softmax", priority=None)
    dispatch.unregister("rms_norm", "fake")
    assert_close(fj.rms_norm(x, w), rms_norm_ref(x, w))
    assert "no implementation 'fake'" in dispatch.last_selection("rms_norm").rejected["fake"]
    fake(priority=None, reason="fake cannot do this")
    monkeypatch.delenv(dispatch.ENV_VAR)
    with fj.use_implementation("fake"):
        assert not is_fake(fj.rms_norm(x, w))
    with fj.use_implementation("fake", strict=True), pytest.raises(
            fj.ImplementationError, match="fake cannot do this"):
        fj.rms_norm(x, w)
    assert capsys.readouterr().out == ""


def test_explicit_unsupported_implementation_raises(fake, xw):
    fake(priority={PLATFORM: 10}, reason="head_dim 8 is not a multiple of 128")
    x, w = xw
    with pytest.raises(fj.ImplementationError,
                       match=r"'fake'.*implementation=.*head_dim 8 is not a multiple of 128"):
        fj.rms_norm(x, w, implementation="fake")
    with pytest.raises(fj.ImplementationError, match=r"no implementation 'nope'.*'xla'"):
        fj.rms_norm(x, w, implementation="nope")
    with pytest.raises(fj.ImplementationError, match="head_dim 8"):
        fj.explain("rms_norm", x, w, implementation="fake")
    # ImplementationError is a ValueError, so generic handlers still catch it.
    assert issubclass(fj.ImplementationError, ValueError)


def test_selection_happens_once_at_trace_time(fake, xw):
    impl = fake(priority={PLATFORM: 10})
    x, w = xw
    f = jax.jit(lambda x, w: fj.rms_norm(x, w) * 2)
    for i in range(3):
        assert np.all(np.asarray(f(x + i, w)) == 2 * MARK)
    assert len(impl.calls) == 1  # traced once, dispatched once
    # The choice is baked into the trace: a later preference does not change the
    # compiled function, a new shape (a new trace) does.
    with fj.use_implementation("xla"):
        assert is_fake(f(x, w) / 2)
        out = f(x[:2], w)
    assert not is_fake(out / 2)
    assert len(impl.calls) == 1


def test_registry_guards(fake):
    fake(priority=None)
    with pytest.raises(ValueError, match="already registered"):
        dispatch.register("rms_norm", "fake")(lambda **kw: None)
    with pytest.raises(KeyError, match="no implementation 'ghost'"):
        dispatch.unregister("rms_norm", "ghost")
    with pytest.raises(KeyError, match="unknown op"):
        dispatch.implementations("no_such_op")
    assert {"matmul", "rms_norm", "attention"} <= set(dispatch.ops())


def test_selection_under_transformations_uses_the_default_platform(fake):
    impl = fake(priority={PLATFORM: 10})
    g = rng(62)
    x, w = normal(g, (4, 3, 8)), normal(g, (8,))
    out = jax.vmap(lambda x: fj.rms_norm(x, w))(x)
    assert is_fake(out) and impl.seen[1] == PLATFORM
    grad = jax.grad(lambda w: jnp.sum(fj.rms_norm(x, w, implementation="xla")))(w)
    assert np.isfinite(np.asarray(grad)).all()
    assert dispatch.last_selection("rms_norm").implementation == "xla"


def test_a_probe_that_raises_is_a_reason_not_a_crash(fake, xw, capsys):
    x, w = xw
    impl = fake(priority={PLATFORM: 100})

    def broken(args, platform):
        raise RuntimeError("probe exploded")

    dispatch.register("rms_norm", "fake", priority={PLATFORM: 100}, supports=broken,
                      replace=True)(impl)
    sel = fj.explain("rms_norm", x, w)
    assert sel.implementation == "xla"
    assert "RuntimeError: probe exploded" in sel.rejected["fake"]
    assert_close(fj.rms_norm(x, w), rms_norm_ref(x, w))
    with pytest.raises(fj.ImplementationError, match="probe exploded"):
        fj.rms_norm(x, w, implementation="fake")
    assert capsys.readouterr() == ("", "")


def test_current_preference_and_clear_selections(xw, monkeypatch):
    x, w = xw
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.current_preference() == (None, "auto", False)
    with fj.use_implementation("xla", strict=True):
        assert dispatch.current_preference() == ("xla", "context", True)
    monkeypatch.setenv(dispatch.ENV_VAR, "xla")
    assert dispatch.current_preference() == ("xla", "env", False)
    fj.rms_norm(x, w)
    assert "rms_norm" in dispatch.last_selections()
    dispatch.clear_selections()
    assert dispatch.last_selections() == {}


def test_a_name_no_op_registered_is_a_typo(xw, monkeypatch):
    x, w = xw
    typo = r"'palas' is not registered by any op; registered: .*xla"
    with pytest.raises(ValueError, match=typo), fj.use_implementation("palas"):
        pass
    monkeypatch.setenv(dispatch.ENV_VAR, "palas")
    with pytest.raises(ValueError, match=r"FORGE_JAX_IMPLEMENTATION= 'palas' is not registered"):
        fj.rms_norm(x, w)


class PlatformVariant:
    def __init__(self, mark):
        self.mark = mark

    def __call__(self, **args):
        return jnp.full(args["x"].shape, self.mark, args["x"].dtype)


def test_one_name_serves_several_platforms_each_with_its_own_supports(xw):
    x, w = xw
    other = "tpu" if PLATFORM != "tpu" else "gpu"
    dispatch.register("rms_norm", "variant", platforms=(PLATFORM,),
                      supports=lambda a, p: None)(PlatformVariant(1.0))
    dispatch.register("rms_norm", "variant", platforms=(other,),
                      supports=lambda a, p: "never")(PlatformVariant(2.0))
    try:
        with pytest.raises(ValueError, match="already registered"):
            dispatch.register("rms_norm", "variant", platforms=(PLATFORM,))(PlatformVariant(3.0))
        assert float(fj.rms_norm(x, w, implementation="variant")[0, 0]) == 1.0
        assert {i.platforms for i in dispatch.registrations("rms_norm")
                if i.name == "variant"} == {frozenset({PLATFORM}), frozenset({other})}
        assert dispatch.implementations("rms_norm", other)["variant"].supports({}, other) == "never"
    finally:
        dispatch.unregister("rms_norm", "variant")
    dispatch.register("rms_norm", "variant", platforms=(other,))(PlatformVariant(2.0))
    try:
        with pytest.raises(fj.ImplementationError, match=f"serves \\['{other}'\\], not {PLATFORM}"):
            fj.rms_norm(x, w, implementation="variant")
    finally:
        dispatch.unregister("rms_norm", "variant")


def test_an_unverified_kernel_runs_by_name_and_explain_says_why_not_auto(xw):
    x, w = xw
    dispatch.register("rms_norm", "kernel", priority={PLATFORM: 100}, verified={})(
        PlatformVariant(MARK))
    try:
        sel = fj.explain("rms_norm", x, w)
        assert sel.implementation == "xla"
        assert f"not yet verified on a {PLATFORM.upper()}" in sel.rejected["kernel"]
        assert float(fj.rms_norm(x, w, implementation="kernel")[0, 0]) == MARK
        info = {(i.op, i.name): i for i in fj.backends.summary().implementations}
        assert info["rms_norm", "kernel"].unverified_on == (PLATFORM,)
        assert info["rms_norm", "kernel"].auto_on == ()
    finally:
        dispatch.unregister("rms_norm", "kernel")
    dispatch.register("rms_norm", "kernel", priority={PLATFORM: 100},
                      verified={PLATFORM: "test machine, JAX x, today"})(PlatformVariant(MARK))
    try:
        assert fj.explain("rms_norm", x, w).implementation == "kernel"
    finally:
        dispatch.unregister("rms_norm", "kernel")


def test_one_record_is_read_by_dispatch_autotuning_explain_and_info(xw, tmp_path, monkeypatch):
    """Everything about an implementation is one registry record: dispatch ranks it by its
    priority and verification, autotuning times its configurations, explain and info read
    its description and state; nothing else has to agree with it by name."""
    x, w = xw
    calls = []

    def kernel(*, x, weight, eps, residual, block=0):  # block: a launch knob
        calls.append(block)
        return rms_norm_xla(x, weight, eps=eps, residual=residual)

    record = fj.registry.Implementation(
        op="rms_norm", name="kernel", fn=kernel, priority={PLATFORM: 100},
        verified={PLATFORM: "test machine, JAX x, today"}, description="a recorded kernel",
        configs=lambda args: [dict(block=1), dict(block=2), dict(block=1)])
    fj.registry.add(record)
    monkeypatch.setenv(fj.autotune_cache.CACHE_ENV, str(tmp_path / "autotune.json"))
    try:
        assert fj.registry.registrations("rms_norm", "kernel") == (record,)
        assert record.ranked(PLATFORM) and not record.unverified(PLATFORM)
        assert fj.explain("rms_norm", x, w).implementation == "kernel"
        assert record.candidate_configs(dispatch.bind("rms_norm", x, w)) == [
            {}, dict(block=1), dict(block=2)]
        result = fj.autotune("rms_norm", x, w, implementations=["kernel"], iters=1)
        assert sorted(c.config.get("block", 0) for c in result.candidates) == [0, 1, 2]
        assert {0, 1, 2} <= set(calls)
        info = {(i.op, i.name): i for i in fj.backends.summary().implementations}
        assert info["rms_norm", "kernel"].description == "a recorded kernel"
        assert info["rms_norm", "kernel"].auto_on == (PLATFORM,)
    finally:
        dispatch.unregister("rms_norm", "kernel")


def test_a_record_refuses_a_priority_for_a_platform_it_does_not_serve():
    with pytest.raises(ValueError, match="priority names platforms it does not serve"):
        fj.registry.Implementation(op="rms_norm", name="kernel", fn=lambda **kw: None,
                                   priority={"gpu": 1}, platforms=("tpu",))


def test_an_op_record_holds_its_binder_and_partition_rule(xw):
    x, w = xw
    record = fj.registry.op_record("rms_norm")
    assert record.bind(x, w) == dispatch.bind("rms_norm", x, w)
    assert record.partition is not None and fj.sharding.has_rule("rms_norm")
    assert fj.registry.op_record("matmul").partition is None
    with pytest.raises(KeyError, match="unknown op 'nope'"):
        fj.registry.op_record("nope")


def test_select_can_ask_about_another_platform(xw):
    x, w = xw
    sel = dispatch.select("rms_norm", dispatch.bind("rms_norm", x, w), platform="tpu")
    assert sel.platform == "tpu" and sel.implementation == "xla"
