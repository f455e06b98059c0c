"""Reading prompt files for the command line: JSONL (``{"prompt": ..., "kind": ...}`` per
line) or plain text (one prompt per line)."""

from __future__ import annotations

import json
from pathlib import Path


def load_prompts(path: str | Path, kind: str | None = None) -> list[str]:
    """Prompts of a file; with ``kind``, only JSONL entries whose "kind" matches."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read prompts file {path}: {e}") from e
    if path.suffix != ".jsonl":
        prompts = [line for line in raw.splitlines() if line.strip()]
    else:
        prompts = []
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a 'prompt' string")
            if kind is None or obj.get("kind") == kind:
                prompts.append(obj["prompt"])
    if not prompts:
        raise ValueError(f"{path} holds no prompts" + (f" of kind {kind!r}" if kind else ""))
    return prompts
