"""The native build's lock: a build killed mid-way must not make every later build wait forever."""
from __future__ import annotations

import os
import subprocess
import sys

from compute.native import build_directory, exclusive_build


def test_a_dead_builds_torch_lock_is_removed_under_the_build_lock(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = build_directory("specstop_probe")
    (folder / "lock").write_text("")  # what torch's FileBaton leaves when its process is killed
    with exclusive_build(folder):
        assert not (folder / "lock").exists()


def test_a_kernel_builds_past_a_stale_torch_lock(tmp_path) -> None:
    code = (
        "from compute.native import NativeExtension, build_directory\n"
        "(build_directory('specstop_draft_stats') / 'lock').write_text('')\n"
        "ext = NativeExtension('specstop_draft_stats', 'draft_stats.cpp', 'native draft statistics')\n"
        "assert ext.module() is not None, ext.failed\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_prebuild_builds_each_kernel_once_in_the_background_and_a_caller_waits_for_it(monkeypatch) -> None:
    import threading
    import time

    from compute import kernels, native

    class Slow(native.NativeExtension):
        def _build(self) -> None:
            builds.append((self.name, threading.current_thread().name))
            time.sleep(0.2)
            self._module = object()

    builds: list[tuple[str, str]] = []
    exts = [Slow(f"k{i}", "draft_stats.cpp", f"kernel {i}") for i in range(3)]
    monkeypatch.setattr(kernels, "host_extensions", lambda: exts)
    monkeypatch.setattr(kernels, "_STARTED", [])
    kernels.prebuild()
    assert exts[0].module() is not None  # meets the background build and waits for it instead of building again
    kernels.prebuild(wait=True)  # a second call starts nothing new
    assert sorted(name for name, _ in builds) == ["k0", "k1", "k2"]
    assert all(thread.startswith("specstop native build") for _, thread in builds)
