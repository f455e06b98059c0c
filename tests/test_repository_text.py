"""The repository speaks of spectool and its users: no tracker numbers or work-log words in its text files.

A user reads the docs, comments, docstrings and test names; "issue 9", "session 7" or "the lead
runs this" mean nothing to them. Data files (the demo prompts are Python source, the tokenizer
a vocabulary) are not prose and are skipped.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".ipynb", ".json", ".js", ".css", ".html", ".cpp", ".h",
                 ".yml", ".yaml", ""}
DATA_FILES = {"spectool/demo/prompts.jsonl", "spectool/demo/target/tokenizer.json"}

# Each pattern is a phrase that only a work log would use.
WORK_LOG = [
    re.compile(r"\bissues? #?\d+", re.I),            # "issue 9", "issues 3 and 9", "issue #4"
    re.compile(r"(?<![\w&/-])#\d+(?:'s| is (?:met|blocked)| item)", re.I),  # "#4's", "#9 item 2"
    re.compile(r"\bsessions? \d+", re.I),             # "session 7"
    re.compile(r"\(session[^)]*\)", re.I),           # "(session 8)", "(session, latest)"
    re.compile(r"\bthe lead\b", re.I),
    re.compile(r"\bdevice tool\b", re.I),
    re.compile(r"\.device_carry"),
    re.compile(r"\bDESIGN\.md\b|\.\./shared/"),      # the planning document, which is not in the repository
]


def tracked_text_files() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist): walk the tree
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
                 and not any(part.startswith(".") or part in ("build", "__pycache__") for part in p.parts)]
    this = Path(__file__).resolve()  # its examples of what to catch are not work-log text
    return [ROOT / n for n in names if Path(n).suffix in TEXT_SUFFIXES and n not in DATA_FILES
            and (ROOT / n).is_file() and (ROOT / n).resolve() != this]


def work_log_phrases(text: str) -> list[str]:
    """Every phrase of ``text`` that one of the work-log patterns matches."""
    return [m.group(0) for pattern in WORK_LOG for m in pattern.finditer(text)]


@pytest.mark.parametrize("phrase", ["see issue 9", "issues 3 and 9", "#4's goal", "#9 item 2", "(session 8)",
                                    "session 7, latest", "the lead runs it", "the device tool carries",
                                    ".device_carry/x.py", "as DESIGN.md says", "see ../shared/notes"])
def test_the_patterns_catch_work_log_phrases(phrase):
    assert work_log_phrases(phrase)


@pytest.mark.parametrize("text", ['@pytest.fixture(scope="session")', "a Jupyter session", "color: #444;",
                                  "the tree of node #3", "records carry node indices"])
def test_the_patterns_leave_ordinary_text_alone(text):
    assert work_log_phrases(text) == []


def test_no_text_file_speaks_of_how_the_work_was_organised():
    files = tracked_text_files()
    assert len(files) > 50  # the listing found the tree
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), start=1):
            found += [f"{path.relative_to(ROOT)}:{lineno}: {p!r}" for p in work_log_phrases(line)]
    assert not found, "work-log phrases in the repository:\n" + "\n".join(found[:40])
