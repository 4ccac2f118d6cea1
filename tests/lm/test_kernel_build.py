"""The CPU kernels' build cache: keyed by the CPU's instruction set and the sources, built before use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lm.kernels
from lm.kernels import tuning
from lm.kernels.build import build_directory, cached_library, cpu_flags, extension_name, isa, isa_tag

REPO = Path(__file__).resolve().parents[2]
CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx fma avx2 avx512f avx512bw
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu sse2 avx fma avx2 avx512f avx512bw
"""
ARM_CPUINFO = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n"
AVX2 = {"fpu", "sse2", "avx", "fma", "avx2"}


def test_cpu_flags_are_read_from_cpuinfo():
    assert cpu_flags(CPUINFO) == AVX2 | {"avx512f", "avx512bw"}
    assert cpu_flags(ARM_CPUINFO) == {"fp", "asimd", "sve"}
    assert cpu_flags("processor\t: 0\n") == frozenset()
    assert cpu_flags()  # this machine (Linux) has a flags line


def test_the_extension_name_differs_by_instruction_set(monkeypatch):
    monkeypatch.delenv("QWEN35_CPU_ISA", raising=False)  # native builds (QWEN35_CPU_ISA=avx2 names them alike)
    avx2, avx512 = extension_name(AVX2), extension_name(AVX2 | {"avx512f"})
    assert avx2 != avx512 and "_avx2_" in avx2 and "_avx512_" in avx512
    assert extension_name(sorted(AVX2, reverse=True)) == avx2  # the order of the flags does not matter
    assert extension_name(AVX2 | {"avx512_bf16"}) not in (avx2, avx512)  # any flag counts, not just the level
    assert build_directory(avx2) != build_directory(avx512)
    assert avx2.isidentifier() and avx2.endswith(extension_name().rsplit("_", 1)[1])  # same sources, same tail
    assert isa_tag({"fp", "asimd"}, "aarch64").startswith("aarch64_")


def test_the_avx2_build_of_an_avx512_cpu_has_its_own_name_and_flags(monkeypatch):
    from lm.kernels import build

    monkeypatch.delenv("QWEN35_CPU_ISA", raising=False)
    avx512 = AVX2 | {"avx512f", "avx512bw", "avx_vnni"}
    native = extension_name(avx512)
    assert build.cflags(tuning.ZEN4)[: len(build.CFLAGS)] == build.CFLAGS
    assert build.cflags(tuning.ZEN4)[len(build.CFLAGS):] == tuning.ZEN4.defines()
    monkeypatch.setenv("QWEN35_CPU_ISA", "avx2")
    assert build.cflags(tuning.GENERIC) == [*build.CFLAGS, "-mno-avx512f", "-mno-avxvnni", *tuning.GENERIC.defines()]
    assert tuning.current() == tuning.PROFILES[tuning.cpu_class()].for_isa("avx2")
    assert build.build_flags(avx512) == AVX2  # the build's name lists the flags it uses
    forced = extension_name(avx512)
    assert "_avx2_" in forced and forced != native
    monkeypatch.setenv("QWEN35_CPU_ISA", "sse")
    with pytest.raises(ValueError, match="QWEN35_CPU_ISA must be one of native, avx2, got 'sse'"):
        build.cflags()


def test_each_cpu_class_has_its_profile_and_each_profile_its_values():
    """The CPU class comes from vendor, family and model; the profiles hold what each class is tuned by."""
    milan, genoa = "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n", "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
    assert tuning.cpu_model(milan) == 1 and tuning.cpu_model("") == 0 and tuning.cpu_family(milan) == 25
    assert tuning.cpu_vendor(CPUINFO) == "GenuineIntel" and tuning.cpu_vendor(ARM_CPUINFO) == ""
    cls = lambda text, machine="x86_64": tuning.cpu_class(tuning.cpu_vendor(text), tuning.cpu_family(text),  # noqa: E731
                                                          tuning.cpu_model(text), machine)
    assert cls(milan) == "zen3" and cls(genoa) == "zen4" and cls(milan.replace(": 1\n", ": 33\n")) == "zen3"
    assert cls(milan.replace(": 1\n", ": 97\n")) == "zen4" and cls(milan.replace("25", "26")) == "zen5"
    assert cls(CPUINFO) == "intel" and cls(ARM_CPUINFO, "aarch64") == "arm" and cls("", "x86_64") == "generic"
    assert cls(milan.replace("25", "23")) == "generic"  # Zen 2 and older AMD
    assert "-DQWEN35_PREFETCH_ROWS=1" in tuning.INTEL.defines() and "-DQWEN35_PREFETCH_L2=8" in tuning.INTEL.defines()
    assert not tuning.ZEN3.bf16_groups and all(p.bf16_groups for p in tuning.PROFILES.values() if p is not tuning.ZEN3)
    assert "-DQWEN35_GROUP_ZMM=1" in tuning.ZEN4.defines()
    assert tuning.ZEN4.for_isa("avx2").defines() == tuning.GENERIC.defines()  # Zen 4's AVX-512 values only
    assert "-DQWEN35_PREFETCH_L2_HINT=0" in tuning.ZEN3.for_isa("avx2").defines()
    with tuning.override(panel_rows=3, moe_pieces=2) as profile:
        assert tuning.current() is profile and lm.kernels.moe_pieces() == 2
    assert tuning.current().moe_pieces == 1
    with pytest.raises(ValueError, match="QWEN35_CPU_ISA must be one of native, avx2"):
        tuning.GENERIC.for_isa("sse")


def _combinations():
    seen = {}
    for profile in tuning.PROFILES.values():
        for isa_name in tuning.ISAS:
            seen.setdefault((tuple(profile.for_isa(isa_name).defines()), isa_name), f"{profile.cpu}-{isa_name}")
    return sorted(seen.items(), key=lambda item: item[1])


@pytest.mark.slow
@pytest.mark.subprocess
def test_every_profile_and_isa_compiles(tmp_path):
    """Every profile x ISA of lm/kernels/tuning.py compiles (-fsyntax-only, all kernel sources in one
    unit, every AVX-512 / AMX branch whatever this CPU), so the branches for other CPUs do not rot;
    and a build without the profile's values stops at the headers' #error."""
    from lm.kernels import build

    unit = tmp_path / "all_kernels.cpp"
    unit.write_text("".join(f'#include "{Path(s).name}"\n' for s in build.SOURCES if not s.endswith("bindings.cpp")))
    runs = []
    for (defines, isa_name), label in _combinations():
        profile = next(p for p in tuning.PROFILES.values() if tuple(p.for_isa(isa_name).defines()) == defines)
        runs.append((label, subprocess.Popen(build.check_command(profile, isa_name, unit), stderr=subprocess.PIPE,
                                             text=True)))  # fmt: skip
        if len(runs) % 2 == 0:  # two at a time
            runs[-2][1].wait()
    failed = [f"{label}:\n{run.communicate()[1][-3000:]}" for label, run in runs if run.wait() != 0]
    assert not failed, "\n".join(failed)
    bare = [a for a in build.check_command(tuning.GENERIC, "native", unit) if not a.startswith("-DQWEN35_")]
    run = subprocess.run(bare, capture_output=True, text=True)
    assert run.returncode != 0 and "come from lm/kernels/tuning.py" in run.stderr


def test_a_build_for_another_instruction_set_is_not_loaded(tmp_path, monkeypatch):
    monkeypatch.delenv("QWEN35_CPU_ISA", raising=False)  # native builds (QWEN35_CPU_ISA=avx2 names them alike)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    other = extension_name(set(cpu_flags()) ^ {"avx512f"})  # this CPU with AVX-512 toggled
    (tmp_path / other).mkdir()
    (tmp_path / other / f"{other}.so").write_bytes(b"a build for the other CPU")
    assert cached_library(other) == tmp_path / other / f"{other}.so"  # found under its own name ...
    assert cached_library(extension_name()) is None  # ... and not for this CPU, which builds its own


@pytest.mark.skipif(lm.kernels.mode() == "0", reason="QWEN35_CPU_KERNELS=0: no kernels")
def test_the_loaded_kernels_are_this_cpus_build():
    module = lm.kernels.compiled()
    assert module is not None, "the CPU kernels did not build (see stderr)"
    assert Path(module.__file__) == cached_library(extension_name())


@pytest.mark.skipif(lm.kernels.mode() == "0", reason="QWEN35_CPU_KERNELS=0: no kernels")
def test_the_build_uses_the_int8_dot_products_this_cpu_has():
    from lm.kernels import build

    module = lm.kernels.compiled()
    flags = build.build_flags(cpu_flags())
    assert module.INT8_DOT == ("avx2" in flags)
    assert module.VNNI == ("avx2" in flags and bool({"avx512_vnni", "avx_vnni"} & flags))  # vpdpbusd where it is
    assert module.VECTOR_FLOATS == (16 if "avx512f" in flags else 8)


@pytest.mark.subprocess
@pytest.mark.skipif(lm.kernels.mode() == "0", reason="QWEN35_CPU_KERNELS=0: no kernels")
def test_build_command_reports_the_build():
    lm.kernels.compiled()  # built (once) in this process, so the command only loads it
    result = subprocess.run([sys.executable, "-m", "lm.kernels.build"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr
    built_for = "" if isa() == "native" else f" (QWEN35_CPU_ISA={isa()})"
    assert f"CPU kernels ready{built_for}: {cached_library(extension_name())}" in result.stderr
    off = subprocess.run([sys.executable, "-m", "lm.kernels.build"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO), "QWEN35_CPU_KERNELS": "0"}, timeout=120)
    assert off.returncode == 0 and "nothing to build" in off.stderr


@pytest.mark.subprocess
@pytest.mark.skipif(torch.cuda.is_available() or not torch.version.cuda, reason="needs a CUDA torch without a GPU")
def test_the_no_cuda_runtime_warning_is_silenced(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_HOME": str(tmp_path)}
    plain = subprocess.run([sys.executable, "-c", "import torch.utils.cpp_extension"], capture_output=True,
                           text=True, env=env, timeout=120)  # fmt: skip
    assert "No CUDA runtime is found" in plain.stderr  # what torch prints on its own
    ours = subprocess.run([sys.executable, "-c", "from lm.kernels.build import import_builder; import_builder()"],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert ours.returncode == 0 and "No CUDA runtime" not in ours.stderr, ours.stderr


@pytest.mark.subprocess
def test_a_failed_build_is_loud(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/bin/false"}
    command = [sys.executable, "-m", "lm.kernels.build"]  # an empty cache and a compiler that always fails
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 1
    assert "building CPU kernels (one time, ~" in result.stderr
    assert "error: the CPU kernels did not build: " in result.stderr and "QWEN35_CPU_KERNELS=0" in result.stderr
    prebuild = [sys.executable, "-c", "from lm.kernels.build import prebuild; prebuild()"]
    strict = subprocess.run(prebuild, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**env, "QWEN35_CPU_KERNELS": "1"})  # fmt: skip
    assert strict.returncode == 1 and "QWEN35_CPU_KERNELS=1 but the CPU kernels did not build" in strict.stderr


@pytest.mark.subprocess
def test_a_cached_library_that_does_not_load_is_built_again(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/bin/false"}
    name = extension_name()
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"half a library: the build was killed while linking")
    result = subprocess.run([sys.executable, "-m", "lm.kernels.build"], cwd=REPO, capture_output=True, text=True,
                            env=env, timeout=300)  # fmt: skip
    assert "do not load" in result.stderr and "building them again" in result.stderr, result.stderr
    assert "building CPU kernels (one time" in result.stderr  # the rebuild (which this compiler fails)
    assert not (tmp_path / name / f"{name}.so").exists()
