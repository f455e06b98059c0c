"""The native corpus under AddressSanitizer+UBSan and ThreadSanitizer.

Compiles native/*.cpp (without the pybind11 bindings) with the C++ driver
native/test_ngram_corpus.cpp, which puts and gets on several threads, and asserts a
clean exit: any sanitizer report makes the run fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[1] / "native"
SOURCES = ["trie.cpp", "suffix_automaton.cpp", "ngram_corpus.cpp", "test_ngram_corpus.cpp"]


def _unavailable(reason: str) -> None:
    # CI promises these runs: there a missing toolchain is a failure, not a skip.
    (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(reason)


def _compile(flags: list[str], out: Path) -> None:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        _unavailable("no C++ compiler")
    # Probe the sanitizer runtime first, so a compiler without it skips with that reason.
    probe = out.with_suffix(".probe")
    src = out.with_suffix(".cpp")
    src.write_text("int main() { return 0; }\n")
    if subprocess.run([cxx, *flags, str(src), "-o", str(probe)], capture_output=True).returncode != 0:
        _unavailable(f"{cxx} lacks the runtime for {' '.join(flags)}")
    cmd = [cxx, "-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", "-Wall", "-Wextra", "-Wpedantic",
           "-Werror", *flags, f"-I{NATIVE}", *(str(NATIVE / s) for s in SOURCES), "-o", str(out), "-pthread"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("flags", [["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
                                   ["-fsanitize=thread"]], ids=["asan_ubsan", "tsan"])
def test_native_corpus_is_sanitizer_clean(flags, tmp_path):
    exe = tmp_path / "driver"
    _compile(flags, exe)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="halt_on_error=1",
               TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1")
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr[-5000:]
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-5000:]
