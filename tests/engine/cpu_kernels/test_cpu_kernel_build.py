"""engine/cpu_kernels/build.py: a kernel is built once into the cache and loaded, and every way it cannot be
(switched off, no compiler, a CPU without the flags, a failed build) is None with a reason, never an error."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from engine.cpu_kernels import build

load = build.load.__wrapped__  # uncached: each test builds into its own cache folder
# The build's mechanics, not its code, are tested here: unoptimised builds take a third of the time
FLAGS = (*build.FLAGS, "-O0")
needs_cpu = pytest.mark.skipif(
    not build.NEEDS <= build.cpu_flags() or build.compiler() is None,
    reason="this machine cannot build the AVX512-BF16 kernels",
)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPINDLE_CPU_KERNELS", raising=False)
    return tmp_path


@needs_cpu
def test_built_once_then_loaded_from_the_cache(_cache: Path) -> None:
    lib = load(FLAGS, build.NEEDS)
    assert lib is not None and lib.spindle_gemm_bf16_abi() > 0 and lib.spindle_layer_ops_abi() > 0
    built = list((_cache / "cpu_kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    assert load(FLAGS, build.NEEDS) is not None
    assert built[0].stat().st_mtime_ns == stamp  # not rebuilt
    assert load((*FLAGS, "-DSPINDLE_OTHER"), build.NEEDS) is not None
    assert len(list((_cache / "cpu_kernels").iterdir())) == 2  # other flags: another library


@needs_cpu
def test_builders_at_once_leave_one_whole_library(_cache: Path) -> None:
    target = _cache / "cpu_kernels" / "gemm_bf16-race.so"
    errors: list[BaseException] = []

    def builder() -> None:
        try:
            build._compile(build.compiler() or "g++", build.sources(), FLAGS, target)
        except BaseException as e:  # noqa: BLE001  # why: reported to the test thread
            errors.append(e)

    threads = [threading.Thread(target=builder) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary file left
    import ctypes

    assert ctypes.CDLL(str(target)).spindle_gemm_bf16_abi() > 0


@pytest.mark.parametrize("case", ["switched off", "no compiler", "cpu lacks flags", "build fails", "build too slow"])
def test_every_way_it_cannot_run_is_none(
    case: str, _cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    flags = build.FLAGS
    if case == "switched off":
        monkeypatch.setenv("SPINDLE_CPU_KERNELS", "0")
    elif case == "no compiler":
        monkeypatch.setattr(build, "compiler", lambda: None)
        monkeypatch.setattr(build, "cpu_flags", lambda: build.NEEDS)
    elif case == "cpu lacks flags":
        monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx512f"}))
    else:
        if build.compiler() is None:
            pytest.skip("no compiler here to fail")
        monkeypatch.setattr(build, "cpu_flags", lambda: build.NEEDS)
        flags = (*build.FLAGS, "-fno-such-option-spindle") if case == "build fails" else flags
        if case == "build too slow":
            monkeypatch.setattr(build, "COMPILE_TIMEOUT_S", 0.01)  # every compiler stopped, none left running
    with caplog.at_level(logging.INFO, logger="engine.cpu_kernels.build"):
        assert load(flags, build.NEEDS) is None
    if case == "no compiler":
        assert "no C++ compiler" in caplog.text
    elif case == "cpu lacks flags":
        assert "avx512_bf16" in caplog.text
    elif case in ("build fails", "build too slow"):
        assert "build failed" in caplog.text and (case == "build fails" or "took over 0.01 s" in caplog.text)
        assert not any((_cache / "cpu_kernels").iterdir())  # the failed attempt's files are gone
