"""Reading text files for the command line and drafters: prompt files (JSONL with
``{"prompt": ..., "kind": ...}`` per line, or plain text with one prompt per line) and
JSONL in general."""

from __future__ import annotations

import json
from pathlib import Path


def read_text(path: str | Path, what: str) -> str:
    """A UTF-8 file's text; a ValueError naming ``what`` when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {what} {path}: {e}") from e


def read_jsonl(path: str | Path, text: str) -> list[tuple[int, object]]:
    """(line number, value) for every non-empty line of a JSONL file's ``text``."""
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from e
    return rows


def load_prompts(path: str | Path, kind: str | None = None) -> list[str]:
    """Prompts of a file; with ``kind``, only JSONL entries whose "kind" matches."""
    path = Path(path)
    raw = read_text(path, "prompts file")
    if path.suffix != ".jsonl":
        prompts = [line for line in raw.splitlines() if line.strip()]
    else:
        prompts = []
        for lineno, obj in read_jsonl(path, raw):
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a 'prompt' string")
            if kind is None or obj.get("kind") == kind:
                prompts.append(obj["prompt"])
    if not prompts:
        raise ValueError(f"{path} holds no prompts" + (f" of kind {kind!r}" if kind else ""))
    return prompts
