"""The llama-cpp-python build on this CPU: the flags ``scripts/setup.sh --llamacpp`` chooses from /proc/cpuinfo (an AMX
CPU's and another's, on a stub Python, nothing built), the check GGUF's shapes and types (those ggml's AMX kernels
take), the one line a build that dies prints, and, with llama-cpp-python installed, the installed build decoding that
GGUF in a child process (ggml's AMX kernels on an AMX CPU, its AVX-512 / AVX2 ones elsewhere: the same shapes)."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFReader

from runtimes.llamacpp import llama as engine
from runtimes.llamacpp.llama import (
    BUILD_STAMP,
    CHECK_WIDTHS,
    INSTALL_COMMAND,
    LlamaCppBuildBroken,
    decode_in_child,
    host_isa,
    write_check_gguf,
)

pytestmark = pytest.mark.llamacpp

ROOT = Path(__file__).resolve().parents[1]
SPR_FLAGS = ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi1 bmi2 avx2 avx512f avx512dq avx512cd avx512bw avx512vl "
             "avx512vbmi avx512_vnni avx512_bf16 avx512_fp16 avx_vnni amx_bf16 amx_tile amx_int8")
ZEN4_FLAGS = ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi1 bmi2 avx2 avx512f avx512dq avx512cd avx512bw "
              "avx512vl avx512vbmi avx512_vnni avx512_bf16")
AMX_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
            "-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
            "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")


def setup_tree(tmp: Path) -> Path:
    """A copy of the setup script and pyproject.toml beside a stub ``.venv/bin/python`` (exit 0 where
    ``FAKE_LLAMA=1``: llama-cpp-python is installed; 1 otherwise) whose package stamp is current: the script's
    llama.cpp part runs and builds nothing in a dry run."""
    (tmp / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    (tmp / ".venv" / "bin").mkdir(parents=True)
    stub = tmp / ".venv" / "bin" / "python"
    stub.write_text('#!/bin/sh\n[ "${FAKE_LLAMA:-0}" = 1 ]\n')
    stub.chmod(0o755)
    digest = hashlib.sha256((tmp / "pyproject.toml").read_bytes()).hexdigest()[:16]
    (tmp / ".venv" / ".specstop-installed").write_text(digest + "\n")
    return tmp


def run_setup(tree: Path, flags: str, dry: bool = True, **env: str) -> str:
    """Run ``scripts/setup.sh --llamacpp`` in ``tree`` as on a CPU with these /proc/cpuinfo ``flags``; its output."""
    cpuinfo = tree / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: {flags}\n")
    base = {k: v for k, v in os.environ.items() if k not in ("CMAKE_ARGS", "SPECSTOP_AMX", "LLAMACPP_DRY_RUN")}
    env = {**base, "SPECSTOP_CPUINFO": str(cpuinfo), **({"LLAMACPP_DRY_RUN": "1"} if dry else {}), **env}
    done = subprocess.run(["bash", "scripts/setup.sh", "--llamacpp"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_setup_keeps_native_without_amx_and_names_the_isa_with_amx_off_on_amx(tmp_path):
    tree = setup_tree(tmp_path)
    assert "would build llama-cpp-python" in (out := run_setup(tree, ZEN4_FLAGS))
    assert "CMAKE_ARGS=-DGGML_NATIVE=ON (the host's instruction set)" in out  # unchanged where there is no AMX
    amx = f"CMAKE_ARGS={AMX_ARGS} (ggml's AMX kernels left out on an AMX CPU"
    assert amx in run_setup(tree, SPR_FLAGS)
    assert amx in run_setup(tree, SPR_FLAGS, SPECSTOP_AMX="0")  # AMX stays out
    # SPECSTOP_AMX=1 takes the AMX branch anywhere, naming only the instruction sets the CPU has
    forced = run_setup(tree, ZEN4_FLAGS.replace(" avx512_bf16", ""), SPECSTOP_AMX="1")
    assert "-DGGML_NATIVE=OFF" in forced and "-DGGML_AVX512_BF16=OFF" in forced and "-DGGML_AMX_INT8=OFF" in forced
    assert "(SPECSTOP_AMX=1: as on an AMX CPU" in forced
    given = run_setup(tree, SPR_FLAGS, CMAKE_ARGS="-DGGML_NATIVE=ON")
    assert "CMAKE_ARGS=-DGGML_NATIVE=ON (CMAKE_ARGS as given)" in given and "SIGILL" in given  # with a warning
    assert not (tree / ".venv" / BUILD_STAMP).exists()  # a dry run writes nothing


def test_setup_rebuilds_when_the_stamp_names_other_flags_or_another_cpu(tmp_path):
    tree = setup_tree(tmp_path)
    stamp = tree / ".venv" / BUILD_STAMP
    # installed without a stamp on a CPU without AMX: taken as this script's native build, kept, stamped
    assert "is installed (CMAKE_ARGS=-DGGML_NATIVE=ON)" in run_setup(tree, ZEN4_FLAGS, dry=False, FAKE_LLAMA="1")
    assert "cmake_args=-DGGML_NATIVE=ON" in stamp.read_text() and "cpu=Test CPU" in stamp.read_text()
    assert "is installed" in run_setup(tree, ZEN4_FLAGS, FAKE_LLAMA="1")
    # the same install on an AMX CPU (the venv moved, or the stamp of the native build there): rebuilt without AMX
    out = run_setup(tree, SPR_FLAGS, FAKE_LLAMA="1")
    assert "built with CMAKE_ARGS=-DGGML_NATIVE=ON on Test CPU; this run wants CMAKE_ARGS=-DGGML_NATIVE=OFF" in out
    assert "would build" in out
    # the stamp of another CPU with the same flags: rebuilt for this one
    stamp.write_text(stamp.read_text().replace("cpu=Test CPU", "cpu=Other CPU"))
    assert "would build llama-cpp-python" in run_setup(tree, ZEN4_FLAGS, FAKE_LLAMA="1")
    stamp.unlink()
    assert "would build" in run_setup(tree, SPR_FLAGS, FAKE_LLAMA="1")  # no stamp on an AMX CPU: built before the fix


def test_check_gguf_has_the_targets_widths_in_types_ggmls_amx_kernels_take(tmp_path):
    path = write_check_gguf(tmp_path / "c.gguf")
    mats = {t.name: t for t in GGUFReader(path).tensors if len(t.shape) == 2}
    h, ffn = CHECK_WIDTHS["hidden"], CHECK_WIDTHS["ffn"]
    assert [int(x) for x in mats["blk.0.ffn_up.weight"].shape] == [h, ffn]
    assert [int(x) for x in mats["blk.1.ffn_down.weight"].shape] == [ffn, h]
    kinds = {t.tensor_type for t in mats.values()}
    assert kinds == {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0}
    for t in mats.values():  # ggml's AMX supports_op: K a multiple of the block (256 for Q4_K), N of 32
        k, n = (int(x) for x in t.shape)
        assert k % (256 if t.tensor_type == GGMLQuantizationType.Q4_K else 32) == 0 and n % 32 == 0, t.name
    assert len(mats) == 1 + 7 * CHECK_WIDTHS["layers"]


def test_a_build_that_dies_is_one_line_naming_its_flags_and_the_rebuild_command(tmp_path, monkeypatch):
    monkeypatch.setattr(engine, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    gguf = tmp_path / "x.gguf"
    with pytest.raises(LlamaCppBuildBroken, match=r"without a record.*SIGILL.*rebuild it with: bash scripts/setup"):
        decode_in_child(gguf, 1)
    model = engine.cpuinfo_fields().get("model name", "")
    here = f"llama-cpp-python=0.3.36\ncmake_args=-DGGML_NATIVE=ON\ncpu={model}\nisa={host_isa()}\n"
    (tmp_path / BUILD_STAMP).write_text(here)  # built here with -march=native: rebuild without ggml's AMX kernels
    with pytest.raises(LlamaCppBuildBroken, match=r"CMAKE_ARGS=-DGGML_NATIVE=ON on .*SPECSTOP_AMX=1 bash scripts/"):
        decode_in_child(gguf, 1)
    (tmp_path / BUILD_STAMP).write_text(here.replace(f"cpu={model}", "cpu=Other CPU"))  # a venv copied from elsewhere
    with pytest.raises(LlamaCppBuildBroken, match=f"on Other CPU, .*rebuild it with: {INSTALL_COMMAND}$") as e:
        decode_in_child(gguf, 1)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(engine, "_CHILD", "raise SystemExit('no model here')")
    with pytest.raises(ValueError, match="failed: no model here") as f:
        decode_in_child(gguf, 1)
    assert not isinstance(f.value, LlamaCppBuildBroken)
    assert signal.SIGILL.name == "SIGILL"


def test_the_build_decodes_a_gguf_with_the_targets_widths(tmp_path):
    """The installed build, in a child process: a prompt pass of 48 rows (ggml's AMX tile kernel where it is compiled
    in) and three one-token steps over two layers of the target's widths, the logits finite; the prompt's last logits
    from the batch and from its last token alone (the one-row kernels) agree."""
    pytest.importorskip("llama_cpp")
    out = decode_in_child(write_check_gguf(tmp_path / "c.gguf"), n_threads=2)
    assert out["finite"] and 0 <= out["argmax"] < CHECK_WIDTHS["vocab"]
    assert out["batch_vs_step"] < 0.05, out


def test_load_pair_checks_the_build_first_and_a_dying_build_is_one_error_line(tmp_path, monkeypatch, capsys):
    """What the curve, ``pipelines.measure_costs --runtime llamacpp`` and the llama.cpp benchmark (before its rows) run:
    a build whose child dies stops the command with one ``error:`` line, exit code 2, before any model loads."""
    from pipelines.cli import user_errors

    monkeypatch.setattr(engine, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    monkeypatch.setattr(engine, "llama_cpp_available", lambda: True)
    monkeypatch.setattr(engine, "GGUFVocab", None)  # never reached
    engine.check_llama_build.cache_clear()
    with pytest.raises(SystemExit) as e, user_errors("python -m pipelines.llamacpp_bench"):
        engine.load_pair(tmp_path / "d.gguf", tmp_path / "t.gguf", n_threads=2, n_ctx=256)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("python -m pipelines.llamacpp_bench: error: llama-cpp-python ") and "SIGILL" in err
    engine.check_llama_build.cache_clear()
