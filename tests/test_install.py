"""The README's first command on a fresh machine, and the imports it relies on.

`pip install .` installs only [project.dependencies], so every third-party module that spectool or
spectool.widgets imports when loaded must be one of them (or be imported lazily, inside the function
that needs it), and the CPU path must run without the test extra (triton above all: the CPU build
of torch does not bring it).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Distribution name -> the top-level module it installs, where they differ.
IMPORT_NAMES = {"huggingface_hub": "huggingface_hub", "pytest-timeout": "pytest_timeout"}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower() for r in requirements}


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names imported when ``path`` is loaded: module-level imports, including those under ``if`` but
    not those guarded by ``try: ... except ImportError`` (which have a fallback) or inside functions."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                guarded = any(isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                              for h in node.handlers)
                if not guarded:
                    visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return found


def test_every_module_level_third_party_import_is_a_declared_dependency():
    declared = {IMPORT_NAMES.get(n, n.replace("-", "_")) for n in _names(PYPROJECT["project"]["dependencies"])}
    allowed = declared | set(sys.stdlib_module_names) | {"spectool", "__future__"}
    files = sorted([*(ROOT / "spectool").rglob("*.py"), *(ROOT / "widgets").rglob("*.py")])
    assert len(files) > 30
    undeclared = {f"{f.relative_to(ROOT)}: {name}" for f in files for name in _module_level_imports(f) - allowed}
    assert not undeclared, "import these lazily (with an 'install X' error) or declare them: " + ", ".join(
        sorted(undeclared))


def test_the_scan_sees_an_undeclared_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nimport triton\ntry:\n    import plotly\nexcept ImportError:\n    plotly = None\n"
                     "def f():\n    import transformers\n")
    assert _module_level_imports(probe) == {"os", "triton"}


# Run in a child where importing triton fails as it does after `pip install .` with the CPU torch.
_NO_TRITON = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError("No module named 'triton'", name="triton")
sys.meta_path.insert(0, NoTriton())
from spectool.cli import main
rc = main(sys.argv[1:])
assert "triton" not in sys.modules
sys.exit(rc)
"""


def test_cpu_commands_run_without_triton(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)

    def spectool(*args: str) -> str:
        p = subprocess.run([sys.executable, "-c", _NO_TRITON, *args], capture_output=True, text=True, env=env,
                           timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p.stdout

    out = tmp_path / "demo"  # every draft method, traces and HTML reports
    assert "spectool demo" in spectool("demo", "--quick", "--device", "cpu", "--out", str(out))
    assert len(list(out.glob("*.html"))) == 8  # every draft method of the bundle, both workloads
    assert spectool("check", str(out / "eagle_completion.sptrace")).startswith("ok")


def test_a_triton_kernel_without_triton_says_what_to_install():
    code = (_NO_TRITON.split("from spectool.cli")[0]
            + "import torch\nfrom spectool.kernels.tree_indices import reconstruct_indices_triton\n"
            "mask, seq_lens = torch.eye(2, dtype=torch.bool)[None], torch.zeros(1, dtype=torch.long)\n"
            "try:\n    reconstruct_indices_triton(mask, seq_lens)\nexcept ModuleNotFoundError as e:\n    print(e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "pip install triton" in p.stdout


# ----------------------------------------------------------------------------------------------------
# The README's first command, for real.


def _source_copy(dest: Path) -> Path:
    """The repository as a fresh clone has it: tracked files only (no build outputs, no built extension)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode == 0 and listed.stdout:
        for name in listed.stdout.decode().split("\0"):
            src = ROOT / name
            if name and src.is_file() and not src.is_symlink():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name)
    else:  # not a git checkout: everything but what a build or a test run leaves behind
        shutil.copytree(ROOT, dest, dirs_exist_ok=True, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "__pycache__", "_native*.so", ".pytest_cache", "widgets"))
        shutil.copytree(ROOT / "widgets", dest / "widgets", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _local_cpu_torch_wheel() -> Path | None:
    """The CPU torch wheel of the running version among pip's local wheel folders (find-links), if any."""
    version = torch.__version__.split("+")[0]
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    folders += [w for line in config.splitlines() if "find-links" in line
                for w in line.split("=", 1)[1].strip("'\"").split()]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in folders:
        folder = Path(folder.removeprefix("file://"))
        for wheel in sorted(folder.glob(f"torch-{version}+cpu-{tag}-*.whl")) if folder.is_dir() else []:
            return wheel
    return None


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_readme_first_command_on_a_fresh_environment(tmp_path):
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 && pip install . && spectool demo" in readme  # the command followed here
    wheel = _local_cpu_torch_wheel()
    assert wheel is not None, ("no CPU torch wheel in pip's find-links folders: this test installs torch only from "
                               "a local wheel, never downloading a CUDA build")
    src = _source_copy(tmp_path / "spectool-src")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"

    def run(*cmd: str, cwd: Path = src, timeout: int = 900) -> str:
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
        return p.stdout

    pip = str(bin_dir / "pip")
    # `pip install torch==2.13.0`, pinned first to the local CPU wheel so no index can offer a CUDA build.
    run(pip, "install", "-q", "--no-deps", "--no-index", str(wheel))
    run(pip, "install", "-q", f"torch=={torch.__version__.split('+')[0]}")
    run(pip, "install", "-q", ".")  # no extras
    installed = {d["name"].lower() for d in json.loads(run(pip, "list", "--format=json"))}
    test_only = _names(PYPROJECT["project"]["optional-dependencies"]["test"]) - _names(
        PYPROJECT["project"]["dependencies"])
    assert not installed & test_only, f"`pip install .` pulled test-only packages: {sorted(installed & test_only)}"
    assert "triton" not in installed
    out = run(str(bin_dir / "spectool"), "demo", "--quick", "--out", str(tmp_path / "demo"), cwd=tmp_path)
    assert "multi_layer_eagle" in out and (tmp_path / "demo" / "summary.json").is_file()
    # From the repository root `python -m spectool` imports the source tree, which has no built extension (the
    # N-gram trie is native).
    (tmp_path / "p.txt").write_text("def add(a, b):\n")
    out = run(str(bin_dir / "python"), "-m", "spectool", "record", "--model", "spectool/demo/target", "--draft",
              "ngram", "--prompts", str(tmp_path / "p.txt"), "--max-new-tokens", "8", "--out", str(tmp_path / "r"))
    assert "trace written" in out and (tmp_path / "r").is_file()
