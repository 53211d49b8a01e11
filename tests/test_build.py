"""llmc_py/_native/build.py: the switches and probes that choose compiler flags,
tested with fake probes (no compiler needed except where stated)."""
import importlib.util
from pathlib import Path

import pytest

import llmc_py

BUILD_PY = Path(__file__).resolve().parent.parent / "llmc_py" / "_native" / "build.py"


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("llmc_ffi_build_under_test", BUILD_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)   # also constructs the builder: probes only, no build
    return module


class FakeProbe:
    """Answers probe compiles by flag, and records what it was asked."""

    def __init__(self, native=True, openmp=True):
        self.native, self.openmp, self.calls = native, openmp, []

    def __call__(self, compile_args, link_args, source=None):
        self.calls.append(list(compile_args))
        if "-march=native" in compile_args:
            return self.native
        return self.openmp and "-fopenmp" in compile_args


@pytest.mark.parametrize("value,expected", [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("OFF\n", False),
])
def test_env_flag_parses_on_and_off(build, value, expected):
    assert build.env_flag("X", not expected, {"X": value}) is expected


@pytest.mark.parametrize("environ", [{}, {"X": ""}, {"X": "   "}])
@pytest.mark.parametrize("default", [True, False])
def test_env_flag_unset_or_blank_gives_default(build, environ, default):
    assert build.env_flag("X", default, environ) is default


@pytest.mark.parametrize("value", ["2", "maybe", "y e s"])
def test_env_flag_rejects_other_values(build, value):
    with pytest.raises(ValueError, match="LLMC_NATIVE"):
        build.env_flag("LLMC_NATIVE", True, {"LLMC_NATIVE": value})


def test_env_flag_reads_os_environ_by_default(build, monkeypatch):
    monkeypatch.setenv("LLMC_TEST_FLAG", "0")
    assert build.env_flag("LLMC_TEST_FLAG", True) is False


def test_build_flags_default_uses_native_and_openmp(build, capsys):
    compile_args, link_args = build.build_flags({}, FakeProbe())
    assert compile_args[:len(build.BASE_FLAGS)] == build.BASE_FLAGS
    assert "-march=native" in compile_args and "-fopenmp" in compile_args
    assert link_args == ["-fopenmp"]
    assert capsys.readouterr().err == ""


def test_build_flags_native_off_drops_march_without_probing(build):
    probe = FakeProbe()
    compile_args, _ = build.build_flags({"LLMC_NATIVE": "0"}, probe)
    assert "-march=native" not in compile_args and "-fopenmp" in compile_args
    assert not any("-march=native" in call for call in probe.calls)


def test_build_flags_native_probe_failure_drops_march(build):
    compile_args, _ = build.build_flags({}, FakeProbe(native=False))
    assert "-march=native" not in compile_args and "-fopenmp" in compile_args


def test_build_flags_openmp_off_drops_fopenmp_quietly(build, capsys):
    probe = FakeProbe()
    compile_args, link_args = build.build_flags({"LLMC_OPENMP": "0"}, probe)
    assert "-fopenmp" not in compile_args and link_args == []
    assert "-march=native" in compile_args
    assert not any("-fopenmp" in call for call in probe.calls)
    assert capsys.readouterr().err == ""


def test_build_flags_openmp_probe_failure_warns(build, capsys):
    compile_args, link_args = build.build_flags({}, FakeProbe(openmp=False))
    assert "-fopenmp" not in compile_args and "-fopenmp" not in link_args
    assert "no OpenMP" in capsys.readouterr().err


def test_build_flags_sanitize_adds_asan_and_ubsan(build):
    compile_args, link_args = build.build_flags({"LLMC_SANITIZE": "1"}, FakeProbe())
    for flag in build.SANITIZE_FLAGS:
        assert flag in compile_args and flag in link_args
    assert "-fsanitize=address,undefined" in compile_args
    assert "-O3" not in compile_args and build.SANITIZE_OPT in compile_args
    assert "-fopenmp" in compile_args and "-fopenmp" in link_args   # the other switches still apply


def test_build_flags_default_is_not_sanitized(build):
    for environ in ({}, {"LLMC_SANITIZE": "0"}):
        compile_args, link_args = build.build_flags(environ, FakeProbe())
        assert not any("sanitize" in f for f in compile_args + link_args)
        assert "-O3" in compile_args


def test_build_flags_leaves_base_flags_alone(build):
    base = list(build.BASE_FLAGS)
    build.build_flags({}, FakeProbe())
    assert build.BASE_FLAGS == base


def test_openmp_flags(build):
    assert build.openmp_flags(lambda *args: False) is None
    assert build.openmp_flags(FakeProbe()) == (["-fopenmp"], ["-fopenmp"])


def test_compiler_command_splits_cc(build, monkeypatch):
    monkeypatch.setenv("CC", "ccache gcc -m64")
    assert build.compiler_command() == ["ccache", "gcc", "-m64"]


def test_try_compile_with_the_real_compiler(build):
    assert build.try_compile([], [], "int main(void) { return 0; }\n")
    assert not build.try_compile([], [], "int main(void) { return }\n")


def test_sources_are_exactly_the_c_files(build):
    assert sorted(build.SOURCES) == sorted(p.name for p in build.CSRC.glob("*.c"))


def test_extension_imports():
    import llmc_py._native._llmc as ext
    assert hasattr(ext.lib, "matmul_forward") and hasattr(ext, "ffi")
    assert isinstance(llmc_py.has_openmp(), bool)
    assert llmc_py.get_num_threads() >= 1
