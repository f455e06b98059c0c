"""Training text: the running Python's standard library, a fixed held-out split, batches and prompts.

The demo target learns Python from the interpreter's own standard-library source, so nothing
has to be downloaded. A fixed list of modules (``HELD_OUT_MODULES``) is never trained on: the
held-out loss, the draft agreement and the benchmark prompts all come from those modules.
"""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

# Modules present in every Python from 3.11 to 3.13 (the CPU box runs 3.11, the GPU box 3.12),
# plain library code of moderate size. Their source, their package directories and their
# test files (test_<name>.py, test_<name>/) never enter a training corpus.
HELD_OUT_MODULES: tuple[str, ...] = (
    "calendar", "csv", "difflib", "fractions", "graphlib", "heapq",
    "json", "queue", "sched", "shlex", "statistics", "textwrap",
)

# Parts of the standard-library tree that are not the interpreter's own Python code
# (third-party packages) or are mostly data tables rather than code.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "pydoc_data", "encodings"}

# Source files larger than this are almost always generated tables or test data.
_MAX_FILE_BYTES = 400_000


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relpath: str | Path) -> bool:
    """Whether a path relative to the stdlib root belongs to a held-out module or its tests."""
    parts = Path(relpath).parts
    if not parts:
        return False
    names = set(HELD_OUT_MODULES) | {f"test_{m}" for m in HELD_OUT_MODULES}
    top = Path(parts[0]).stem if len(parts) == 1 else parts[0]
    if top in HELD_OUT_MODULES:
        return True
    # Test modules live anywhere under test/ (test/test_json/, test/test_heapq.py, ...).
    return any(Path(p).stem in names for p in parts[1:])


def stdlib_files(held_out: bool = False, root: Path | None = None) -> list[Path]:
    """Sorted .py files of the standard library: the training split, or the held-out split."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]):
            continue
        if is_held_out(rel) != held_out:
            continue
        try:
            if path.stat().st_size > _MAX_FILE_BYTES:
                continue
        except OSError:
            continue
        files.append(path)
    return files


def _read_text(path: Path) -> str | None:
    """File text as UTF-8, or None for files that are not UTF-8 (a few deliberate test cases)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def stdlib_documents(held_out: bool = False) -> list[str]:
    """Texts of the stdlib training split (or held-out split), one string per file."""
    docs = [t for t in (_read_text(p) for p in stdlib_files(held_out)) if t and t.strip()]
    if not docs:
        raise ValueError(f"no readable Python source found under {stdlib_root()}")
    return docs


def heldout_named_documents() -> list[tuple[str, str]]:
    """(path relative to the stdlib root, text) for the held-out library modules, tests excluded."""
    root = stdlib_root()
    out = []
    for path in stdlib_files(held_out=True):
        rel = path.relative_to(root)
        if rel.parts[0] == "test":
            continue
        text = _read_text(path)
        if text and text.strip():
            out.append((rel.as_posix(), text))
    return out


def read_corpus(spec: str | Path) -> list[str]:
    """Documents of a corpus: ``"stdlib"`` (training split), a text/JSONL file, or a directory.

    A ``.jsonl`` file holds one JSON object per line with a ``"text"`` field; any other file is
    one document; a directory contributes every ``.py``, ``.txt`` and ``.md`` file below it.
    Raises ValueError when the corpus is missing, unreadable or holds no text.
    """
    if str(spec) == "stdlib":
        return stdlib_documents()
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"corpus {path} does not exist (give a file, a directory or 'stdlib')")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".py", ".txt", ".md") and p.is_file())
        docs = [t for t in (_read_text(p) for p in files) if t and t.strip()]
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"corpus {path} is not readable as UTF-8 text: {e}") from e
        if path.suffix == ".jsonl":
            docs = []
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    docs.append(json.loads(line)["text"])
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: expected a JSON object with a 'text' field") from e
            docs = [d for d in docs if isinstance(d, str) and d.strip()]
        else:
            docs = [text] if text.strip() else []
    if not docs:
        raise ValueError(f"corpus {path} holds no text")
    return docs


def encode_documents(tokenizer, docs: Sequence[str], eos_id: int) -> torch.Tensor:
    """One flat int32 token stream: every document followed by the end-of-text token."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(docs)):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


def split_tail(tokens: torch.Tensor, fraction: float, min_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval) split of a token stream that keeps the last ``fraction`` for evaluation.

    Used for user corpora, which have no held-out module list.
    """
    n_eval = max(min_tokens, int(len(tokens) * fraction))
    if len(tokens) - n_eval < min_tokens:
        raise ValueError(f"corpus has only {len(tokens)} tokens; need at least {2 * min_tokens}")
    return tokens[:-n_eval], tokens[-n_eval:]


def random_windows(tokens: torch.Tensor, batch_size: int, length: int,
                   generator: torch.Generator) -> torch.Tensor:
    """[batch_size, length] int64 windows at random offsets of a token stream."""
    if len(tokens) < length + 1:
        raise ValueError(f"corpus has {len(tokens)} tokens, fewer than one window of {length + 1}")
    starts = torch.randint(0, len(tokens) - length, (batch_size, 1), generator=generator)
    return tokens[starts + torch.arange(length)].long()


def eval_windows(tokens: torch.Tensor, length: int, max_windows: int) -> Iterator[torch.Tensor]:
    """Consecutive non-overlapping [1, length] windows of a stream, evenly spread, at most ``max_windows``."""
    n = (len(tokens) - 1) // length
    if n < 1:
        raise ValueError(f"evaluation text has {len(tokens)} tokens, fewer than one window of {length + 1}")
    stride = max(1, n // max_windows)
    for w in range(0, n, stride)[:max_windows]:
        yield tokens[w * length:(w + 1) * length].long().unsqueeze(0)


# ---- benchmark prompts -------------------------------------------------------------------------

def _cut_at_line(text: str, pos: int) -> int:
    """The start of the line holding ``pos`` (so prompts end on a line boundary)."""
    return text.rfind("\n", 0, pos) + 1


def completion_prompts(docs: Sequence[tuple[str, str]], n: int, prompt_chars: int = 1200,
                       seed: int = 0) -> list[dict]:
    """Prompts cut from held-out files, ending at a line start, for the model to continue.

    Each is ``{"kind": "completion", "source": path, "prompt": text, "reference": next text}``.
    """
    rng = random.Random(seed)
    usable = [(name, text) for name, text in docs if len(text) > 2 * prompt_chars]
    if not usable:
        raise ValueError("no held-out document is long enough for a completion prompt")
    out = []
    for i in range(n):
        name, text = usable[i % len(usable)]
        end = _cut_at_line(text, rng.randrange(prompt_chars, len(text) - prompt_chars // 2))
        start = _cut_at_line(text, max(0, end - prompt_chars))
        out.append({"kind": "completion", "source": name, "prompt": text[start:end],
                    "reference": text[end:end + prompt_chars // 2]})
    return out


def light_edit(text: str, rng: random.Random) -> str:
    """A lightly changed copy of source text: one identifier renamed, a comment added, a line dropped.

    It stays mostly identical, as when a user asks for a small change to a file they pasted.
    """
    lines = text.split("\n")
    words = sorted({w for w in text.replace("(", " ").replace(")", " ").replace(".", " ")
                    .replace(",", " ").replace(":", " ").split() if w.isidentifier() and len(w) > 4})
    if words:
        old = rng.choice(words)
        lines = [line.replace(old, old + "_v2") for line in lines]
    code_lines = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
    if len(code_lines) > 4:
        i = rng.choice(code_lines[1:])
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        lines.insert(i, f"{indent}# edited: keep this in step with the caller")
        j = rng.choice(code_lines[len(code_lines) // 2:])
        del lines[j + 1 if j >= i else j]
    return "\n".join(lines)


def editing_prompts(docs: Sequence[tuple[str, str]], n: int, chunk_chars: int = 1500,
                    head_chars: int = 200, seed: int = 0) -> list[dict]:
    """Prompts holding a held-out source chunk and the start of a lightly changed copy of it.

    The continuation mostly repeats the prompt, the case N-gram drafting exists for. Each is
    ``{"kind": "editing", "source": path, "prompt": text, "reference": rest of the edited copy}``.
    """
    rng = random.Random(seed + 1)
    usable = [(name, text) for name, text in docs if len(text) > chunk_chars + 1]
    if not usable:
        raise ValueError("no held-out document is long enough for an editing prompt")
    out = []
    for i in range(n):
        name, text = usable[i % len(usable)]
        start = _cut_at_line(text, rng.randrange(0, len(text) - chunk_chars))
        chunk = text[start:_cut_at_line(text, start + chunk_chars)]
        edited = light_edit(chunk, rng)
        head = edited[:_cut_at_line(edited, head_chars) or head_chars]
        prompt = (f"# Original {name}:\n{chunk}\n"
                  f"# The same code after a small edit (a rename, a comment added, a line removed):\n"
                  f"{head}")
        out.append({"kind": "editing", "source": name, "prompt": prompt, "reference": edited[len(head):]})
    return out


def write_prompts_jsonl(path: str | Path, prompts: Sequence[dict]) -> None:
    """Write prompt records one JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
