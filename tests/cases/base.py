"""The base of every implementation's test class (JAX's ``tests/pallas`` and tokamax's
``test_base.py`` pattern).

An op family's base class (``cases.attention_base.AttentionCases``, ...) holds the
behaviours every implementation of the op must show, written once and run through the
public op with ``implementation=IMPLEMENTATION``. Each implementation's test file
subclasses it as ``Test<Op><Implementation>``, naming:

* ``IMPLEMENTATION``: the registered implementation name ("pallas", "pallas_gpu_interpret",
  "pallas_tpu_interpret", "triton", "cudnn", ...);
* ``INTERPRET``: whether it runs the kernel in Pallas' interpreter (kernel knobs are called
  with ``interpret=INTERPRET``);
* :meth:`ImplementationCases.skip_reason`: why it cannot run on this machine (no GPU, no
  TPU, no toolchain), or None;
* its case tables: class attributes of ``{case id: case}`` that the base's tests are
  parametrized with (:func:`parametrize_from`), so that each implementation runs the cases
  its hardware accepts and no more;

and keeps its kernel-specific tests (knobs, ``supports()`` rejections) in that subclass.
A behaviour an implementation does not offer is switched off by setting the test to None
in the subclass, with the reason beside it.
"""

from __future__ import annotations

import jax
import pytest

from forge_jax import _compat, dispatch


def parametrize_from(table: str, argnames: str = "case"):
    """Parametrizes a base-class test with the concrete class's ``table``: a dict from case
    id to the case (a tuple of values when ``argnames`` names several)."""

    def mark(test):
        test.case_table = (table, argnames)
        return test

    return mark


class ImplementationCases:
    IMPLEMENTATION: str
    INTERPRET: bool = False

    @classmethod
    def skip_reason(cls) -> str | None:
        """Why this implementation cannot run here, or None if it can."""
        return None

    def after_test(self) -> None:
        """Runs after each test of the class (e.g. to reset the TPU interpreter's state)."""

    @pytest.fixture(autouse=True)
    def _runs_here(self):
        if (reason := self.skip_reason()) is not None:
            pytest.skip(f"{self.IMPLEMENTATION}: {reason}")
        yield
        self.after_test()

    def pytest_generate_tests(self, metafunc):
        table, argnames = getattr(metafunc.function, "case_table", (None, None))
        if table is not None:
            cases = getattr(metafunc.cls, table)
            metafunc.parametrize(argnames, list(cases.values()), ids=list(cases))


class PallasGpu:
    """The skip rule of the Pallas GPU (Triton lowering) kernels: compiled only on a GPU the
    lowering supports, in Pallas' interpreter (``INTERPRET``) anywhere. Mixed in before the
    op family's base: ``class TestXPallasGpu(PallasGpu, XCases)``."""

    @classmethod
    def skip_reason(cls) -> str | None:
        from forge_jax.pallas_kernels.gpu import _common

        if cls.INTERPRET or (reason := _common.gpu_reason(jax.default_backend())) is None:
            return None
        return f"compiled Pallas GPU kernel: {reason} (the interpret subclass runs here)"


class PallasTpu:
    """The skip rule of the Pallas TPU (Mosaic) kernels: compiled only on a TPU, in the TPU
    interpreter (``INTERPRET``) anywhere; the interpreter's state is reset after each test.
    Mixed in before the op family's base: ``class TestXPallasTpu(PallasTpu, XCases)``."""

    @classmethod
    def skip_reason(cls) -> str | None:
        if not cls.INTERPRET and jax.default_backend() != "tpu":
            return (f"compiled Mosaic TPU kernel: backend is {jax.default_backend()} (the "
                    "interpret subclass runs the same tests here)")
        return None

    def after_test(self) -> None:
        if self.INTERPRET:
            _compat.reset_tpu_interpreter()


class MosaicGpu:
    """The skip rule of the Mosaic GPU kernels: compiled only on a GPU of compute capability
    9.0+, in the Mosaic GPU interpreter (``INTERPRET``) anywhere, where each test also asserts
    that the interpreter's race detection found no race. Mixed in before the op family's
    base: ``class TestXMosaicGpu(MosaicGpu, XCases)``."""

    # The matrix unit the class's kernel multiplies with: "wgmma" (Hopper) or "tcgen05"
    # (Blackwell); compiled, it runs only on a GPU that has it.
    MMA = "wgmma"

    @classmethod
    def skip_reason(cls) -> str | None:
        from forge_jax.pallas_kernels.gpu import _mosaic

        if cls.INTERPRET:
            if cls.MMA == "tcgen05" and not _mosaic.interpreter_has_tmem():
                return (f"JAX {jax.__version__}'s Mosaic GPU interpreter has no tensor memory "
                        "(TMEM) or tcgen05 MMA: JAX 0.12 or newer runs these")
            return None
        if (reason := _mosaic.mosaic_reason(jax.default_backend())) is not None:
            return f"compiled Mosaic GPU kernel: {reason} (the interpret subclass runs here)"
        if _mosaic.mma_kind() != cls.MMA:
            return (f"compiled for {cls.MMA}; this GPU's matrix unit is {_mosaic.mma_kind()} "
                    "(the interpret subclass runs here)")
        return None

    def after_test(self) -> None:
        if self.INTERPRET:
            assert _compat.mosaic_gpu_races_found() is not True, "the interpreter found a race"


def assert_registered_unverified(op: str, platform: str) -> None:
    """``op``'s compiled Pallas kernel is registered for ``platform`` by name only, verified
    nowhere (auto selection passes it over), and its interpreted twin for the CPU."""
    assert dispatch.implementations(op, platform)["pallas"].verified == {}
    assert f"pallas_{platform}_interpret" in dispatch.implementations(op, "cpu")
