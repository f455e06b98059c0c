"""The commands the documentation shows exist: every `spectool COMMAND --flag` and
`python benchmarks/SCRIPT.py --flag` in the README and docs/ names a real command or script and
options it declares; every benchmark script names the figure of the docs it produces and how long
it takes, every profile the figure it explains and the benchmark option that runs it; and
benchmarks/run_gpu.sh's parts, limits and scripts agree.

Options are looked up in the source text (a quoted "--flag"), so no script is imported or run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from spectool.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BENCHMARKS = ROOT / "benchmarks"
SHARED = BENCHMARKS / "speculative.py"  # add_common_arguments: the options most benchmarks share

# A command runs to the end of its code span, or of its line in an indented block.
SCRIPT = re.compile(r"python3? (?:benchmarks/)?(\w+)\.py(.*)")
SPECTOOL = re.compile(r"(?:^|(?<=[!$&;|] ))spectool ([a-z][a-z-]+)(.*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
FIGURE = re.compile(r'^Figure: (docs/\w+\.md) "([^"]+)"\. Time: \S.*$', re.M)


def doc_commands() -> list[tuple[str, int, str, str]]:
    """(document, line, kind, command text) for every command the documents show as code: in a
    fenced or indented block, or in a code span."""
    found = []
    for doc in DOCS:
        fenced = False
        for lineno, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            block = fenced or line.startswith("    ")
            for code in [line.strip().rstrip("\\")] if block else re.findall(r"`([^`]+)`", line):
                for pattern, kind in ((SCRIPT, "script"), (SPECTOOL, "spectool")):
                    found += [(doc.name, lineno, kind, m.group(0)) for m in pattern.finditer(code)]
    return found


def declares(sources: list[Path], flag: str) -> bool:
    return any(f'"{flag}"' in path.read_text(encoding="utf-8") for path in sources)


def script_sources(name: str, args: str) -> list[Path]:
    """The files whose options a benchmark command may use: the script, the shared options, and
    after ``--profile KIND`` the profile's module."""
    from importlib.util import module_from_spec, spec_from_file_location

    sources = [BENCHMARKS / f"{name}.py", SHARED]
    kind = re.search(r"--profile (\w+)", args)
    if kind:
        spec = spec_from_file_location("profiling", BENCHMARKS / "profiling" / "__init__.py")
        profiling = module_from_spec(spec)
        spec.loader.exec_module(profiling)
        module = profiling.PROFILES.get(name, {}).get(kind.group(1))
        assert module, f"{name}.py has no profile {kind.group(1)!r}"
        sources.append(BENCHMARKS / "profiling" / f"{module}.py")
    return sources


def test_the_documents_show_commands():
    kinds = {kind for *_, kind, _ in doc_commands()}
    assert kinds == {"script", "spectool"}  # the patterns still find both kinds


@pytest.mark.parametrize("doc, line, kind, command", doc_commands(), ids=lambda v: str(v)[:60])
def test_a_documented_command_and_its_options_exist(doc, line, kind, command):
    if kind == "script":
        name, args = SCRIPT.match(command).groups()
        assert (BENCHMARKS / f"{name}.py").is_file(), f"{doc}:{line}: no benchmarks/{name}.py"
        sources = script_sources(name, args)
    else:
        name, args = SPECTOOL.match(command).groups()
        assert name in COMMANDS, f"{doc}:{line}: no command 'spectool {name}'"
        module = COMMANDS[name][0].rsplit(".", 1)[1]
        sources = [ROOT / "spectool" / "cli" / f"{module}.py", ROOT / "spectool" / "cli" / "args.py"]
    missing = [f for f in FLAG.findall(args) if f not in ("--help",) and not declares(sources, f)]
    assert not missing, f"{doc}:{line}: {command!r}: no option {', '.join(missing)}"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_every_benchmark_names_its_figure_and_time(script):
    doc = ast.get_docstring(ast.parse((BENCHMARKS / script).read_text(encoding="utf-8")))
    match = FIGURE.search(doc or "")
    assert match, f"benchmarks/{script}: its docstring needs a line 'Figure: docs/X.md \"Section\". Time: ...'"
    assert section_exists(*match.groups()), f"benchmarks/{script}: {match.group(1)} has no section {match.group(2)!r}"


def section_exists(path: str, section: str) -> bool:
    return any(h.lstrip("#").strip().startswith(section)
               for h in (ROOT / path).read_text(encoding="utf-8").splitlines() if h.startswith("#"))


@pytest.mark.parametrize("module", sorted(p.stem for p in (BENCHMARKS / "profiling").glob("*.py")
                                          if not p.stem.startswith("_")))  # _name: the profiles' helpers
def test_every_profile_runs_through_a_benchmark_and_names_the_figure_it_explains(module):
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("profiling", BENCHMARKS / "profiling" / "__init__.py")
    profiling = module_from_spec(spec)
    spec.loader.exec_module(profiling)
    runs = [f"{bench}.py --profile {kind}" for bench, kinds in profiling.PROFILES.items()
            for kind, name in kinds.items() if name == module]
    assert runs, f"benchmarks/profiling/{module}.py is no benchmark's --profile (PROFILES)"
    doc = ast.get_docstring(ast.parse((BENCHMARKS / "profiling" / f"{module}.py").read_text(encoding="utf-8")))
    assert any(run in doc for run in runs), f"its docstring shows none of {runs}"
    paragraph = next((p for p in doc.split("\n\n") if p.startswith("Explains: ")), "")
    match = re.match(r'Explains: (docs/\w+\.md) "([^"]+)"', paragraph)
    assert match and "Time: " in paragraph, f"{module}.py: needs 'Explains: docs/X.md \"Section\" ... Time: ...'"
    assert section_exists(*match.groups()), f"{module}.py: {match.group(1)} has no section {match.group(2)!r}"


def test_run_gpu_lists_each_part_once_with_its_limit_and_runs_existing_scripts():
    text = (BENCHMARKS / "run_gpu.sh").read_text(encoding="utf-8")
    limits = dict(re.findall(r"\[(\w+)\]=(\d+)", re.search(r"declare -A LIMIT=\(([^)]*)\)", text).group(1)))
    header = dict(re.findall(r"^#   (\w+) +(\d+) s ", text, re.M))
    cases = re.findall(r"^        (\w+)\)", text, re.M)
    assert header == limits, "the header's parts and limits are the LIMIT table's"
    assert sorted(cases) == sorted(limits), "every part has one case branch"
    default = re.search(r'PARTS="\$\{PARTS:-([^}]*)\}"', text).group(1).split()
    assert sorted(default) == sorted(limits), "by default the script runs the whole set, each part once"
    assert default.index("large") < min(default.index(p) for p in ("step_times", "vs_transformers", "sweep")), \
        "the parts that use the 113M target run after the part that trains it"
    stated = re.search(r"<= ([\d,]+) s of limits", text).group(1).replace(",", "")
    assert int(stated) == sum(int(v) for v in limits.values()), "the header states the limits' sum"
    for script in set(re.findall(r"\brun \w+ \d+ (\w+)", text)):
        assert (BENCHMARKS / f"{script}.py").is_file(), f"run_gpu.sh runs a missing benchmarks/{script}.py"
