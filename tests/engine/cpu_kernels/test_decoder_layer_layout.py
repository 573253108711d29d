"""decoder_layer.py's ctypes structs against decoder_layer.cpp's: the same layout, and a mirror that drifts (a field
added on one side only) turns the fused layer off instead of letting it read garbage."""

from __future__ import annotations

import pytest

from engine.cpu_kernels import build, decoder_layer

pytestmark = pytest.mark.skipif(
    not build.enabled() or not build.NEEDS <= build.cpu_flags() or build.compiler() is None,
    reason="this machine cannot build the kernels",
)


def test_the_mirror_matches_the_cpp_structs() -> None:
    assert decoder_layer._layout_fault(None) is None


def test_a_drifted_mirror_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    right = decoder_layer._mirrored()
    monkeypatch.setattr(decoder_layer, "_mirrored", lambda: [*right[:-1], right[-1] + 8])
    why = decoder_layer._layout_fault(None)
    assert why is not None and "decoder_layer.cpp" in why and str(right[-1] + 8) in why
