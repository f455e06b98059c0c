"""Training text: the running Python's standard library, a fixed held-out split, batches and prompts.

The demo target learns Python from the interpreter's own standard-library source, so nothing
has to be downloaded. A fixed list of modules (``HELD_OUT_MODULES``) is never trained on: the
held-out loss, the draft agreement and the benchmark prompts all come from those modules.
"""

from __future__ import annotations

import functools
import json
import random
import sysconfig
import tarfile
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


def _is_candidate(rel: Path, size: int) -> bool:
    """The split rule shared by every stdlib source: a .py file of the interpreter's own code."""
    return rel.suffix == ".py" and not _SKIP_DIRS.intersection(rel.parts[:-1]) and size <= _MAX_FILE_BYTES


def stdlib_files(held_out: bool = False, root: Path | None = None) -> list[Path]:
    """Sorted .py files of a standard-library directory: the training split, or the held-out split."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if _is_candidate(rel, size) and is_held_out(rel) == held_out:
            files.append(path)
    return files


def _read_text(path: Path) -> str | None:
    """File text as UTF-8, or None for files that are not UTF-8 (a few deliberate test cases)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _tree_from_directory(path: Path) -> list[tuple[str, str]]:
    # A Lib/ directory itself, or a Python source checkout holding one.
    root = next((r for r in (path, path / "Lib") if (r / "os.py").is_file()), None)
    if root is None:
        raise ValueError(f"--stdlib {path} is not a Python standard library (no os.py in it or in Lib/)")
    out = []
    for p in sorted(stdlib_files(False, root) + stdlib_files(True, root)):
        text = _read_text(p)
        if text and text.strip():
            out.append((p.relative_to(root).as_posix(), text))
    return out


def _tree_from_archive(path: Path) -> list[tuple[str, str]]:
    # Streaming mode reads a compressed archive once, front to back (random access re-decompresses).
    raw: dict[str, bytes] = {}
    try:
        with tarfile.open(path, "r|*") as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(".py") and member.size <= _MAX_FILE_BYTES:
                    raw[member.name.removeprefix("./")] = tar.extractfile(member).read()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ValueError(f"--stdlib {path} is not a readable tar archive: {e}") from e
    tops = sorted((n for n in raw if n == "os.py" or n.endswith("/os.py")), key=lambda n: n.count("/"))
    if not tops:
        raise ValueError(f"--stdlib {path} holds no Python standard library (no os.py in the archive)")
    prefix = tops[0].removesuffix("os.py")
    out = []
    for name in sorted(raw):
        rel = Path(name.removeprefix(prefix))
        if not name.startswith(prefix) or not _is_candidate(rel, len(raw[name])):
            continue
        try:
            # Newlines translated as Path.read_text does, so both sources give the same text.
            text = raw[name].decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        except UnicodeDecodeError:
            continue
        if text.strip():
            out.append((rel.as_posix(), text))
    return out


@functools.lru_cache(maxsize=2)
def _stdlib_tree(source: str) -> tuple[tuple[str, str], ...]:
    """Every candidate file of a stdlib tree (both splits), cached: each phase of a run reads it."""
    path = Path(source)
    if not path.exists():
        raise ValueError(f"--stdlib {path} does not exist (give a Lib/ directory or a .tar.xz of one)")
    files = _tree_from_directory(path) if path.is_dir() else _tree_from_archive(path)
    if not files:
        raise ValueError(f"no readable Python source found in --stdlib {path}")
    return tuple(files)


def stdlib_sources(held_out: bool = False, stdlib: str | Path | None = None) -> list[tuple[str, str]]:
    """(path relative to the stdlib root, text) of the training or held-out split of a standard library.

    ``stdlib`` is a Lib/ directory (or a source checkout holding Lib/) or a tar archive of one
    (``benchmarks/pack_stdlib.py`` writes one); None means the running interpreter's. The split
    rule and the held-out modules are the same for every source.
    """
    tree = _stdlib_tree(str(Path(stdlib).resolve() if stdlib is not None else stdlib_root()))
    docs = [(name, text) for name, text in tree if is_held_out(name) == held_out]
    if not docs:
        raise ValueError(f"no {'held-out' if held_out else 'training'} source in the standard library "
                         f"{stdlib or stdlib_root()}")
    return docs


def stdlib_documents(held_out: bool = False, stdlib: str | Path | None = None) -> list[str]:
    """Texts of the stdlib training split (or held-out split), one string per file."""
    return [text for _, text in stdlib_sources(held_out, stdlib)]


def heldout_named_documents(stdlib: str | Path | None = None) -> list[tuple[str, str]]:
    """(path relative to the stdlib root, text) for the held-out library modules, tests excluded."""
    return [(name, text) for name, text in stdlib_sources(True, stdlib) if not name.startswith("test/")]


def read_corpus(spec: str | Path, stdlib: str | Path | None = None) -> list[str]:
    """Documents of a corpus: ``"stdlib"`` (training split), a text/JSONL file, or a directory.

    A ``.jsonl`` file holds one JSON object per line with a ``"text"`` field; any other file is
    one document; a directory contributes every ``.py``, ``.txt`` and ``.md`` file below it.
    ``stdlib`` picks the standard library ``"stdlib"`` means (see ``stdlib_sources``).
    Raises ValueError when the corpus is missing, unreadable or holds no text.
    """
    if str(spec) == "stdlib":
        return stdlib_documents(stdlib=stdlib)
    if stdlib is not None:
        raise ValueError("--stdlib only applies to --corpus stdlib")
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


EDIT_HEADER = "# The same code after a small edit (a rename, a comment added, a line removed):\n"


def edit_document(name: str, chunk: str, edited: str) -> str:
    """The editing layout: a source chunk, a header, then (the start of) its lightly changed copy."""
    return f"# Original {name}:\n{chunk}\n{EDIT_HEADER}{edited}"


def _edit_chunk(text: str, rng: random.Random, chunk_chars: int) -> tuple[str, str]:
    """(chunk of whole lines of about ``chunk_chars`` at a random place, its ``light_edit``)."""
    start = _cut_at_line(text, rng.randrange(0, len(text) - chunk_chars))
    chunk = text[start:_cut_at_line(text, start + chunk_chars)]
    return chunk, light_edit(chunk, rng)


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
        chunk, edited = _edit_chunk(text, rng, chunk_chars)
        head = edited[:_cut_at_line(edited, head_chars) or head_chars]
        out.append({"kind": "editing", "source": name, "prompt": edit_document(name, chunk, head),
                    "reference": edited[len(head):]})
    return out


def editing_pairs(docs: Sequence[tuple[str, str]], fraction: float, seed: int = 0,
                  chunk_chars: tuple[int, int] = (300, 2000)) -> list[str]:
    """Editing-style training documents that make up ``fraction`` of the training text with ``docs``.

    Each is a random chunk of a document followed by its lightly changed copy, laid out exactly
    as the editing prompts are (``edit_document``): a model trained on them learns to copy from
    its context, which is what N-gram drafting feeds on. Pass training documents only, never
    held-out ones. ``docs`` are (name, text) pairs; the name goes in the header.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"edit fraction must be in [0, 1), got {fraction}")
    usable = [(name, text) for name, text in docs if len(text) > chunk_chars[0] + 1 and "\n" in text]
    if fraction == 0.0 or not usable:
        return []
    # Pairs are `fraction` of (documents + pairs).
    wanted = fraction / (1.0 - fraction) * sum(len(text) for _, text in docs)
    rng = random.Random(seed)
    out, have = [], 0
    for _ in range(int(wanted / chunk_chars[0]) + 100):  # bounded: some chunks come out empty
        if have >= wanted:
            break
        name, text = rng.choice(usable)
        chunk, edited = _edit_chunk(text, rng, min(rng.randint(*chunk_chars), len(text) - 1))
        if chunk.strip():
            out.append(edit_document(name, chunk, edited))
            have += len(out[-1])
    return out


def corpus_tokens(corpus: str | Path, tokenizer, eos_id: int, seq_len: int, *,
                  stdlib: str | Path | None = None, edit_fraction: float = 0.0,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token streams of a corpus, with editing pairs added to the training side.

    ``"stdlib"`` splits by module (held-out: the held-out library modules, tests excluded); any
    other corpus keeps its last 5 % of tokens for evaluation, and editing pairs come only from
    the documents that lie wholly before that tail.
    """
    if str(corpus) == "stdlib":
        named = stdlib_sources(stdlib=stdlib)
        held = [text for _, text in heldout_named_documents(stdlib)]
        docs = [text for _, text in named] + editing_pairs(named, edit_fraction, seed)
        return encode_documents(tokenizer, docs, eos_id), encode_documents(tokenizer, held, eos_id)
    docs = read_corpus(corpus, stdlib)
    train, held = split_tail(encode_documents(tokenizer, docs, eos_id), 0.05, seq_len + 1)
    if not edit_fraction:
        return train, held
    before_tail, end = [], 0
    for i, enc in enumerate(tokenizer.encode_batch(docs)):
        end += len(enc.ids) + 1
        if end > len(train):
            break
        before_tail.append((f"document {i}", docs[i]))
    pairs = editing_pairs(before_tail, edit_fraction, seed)
    if pairs:
        train = torch.cat([train, encode_documents(tokenizer, pairs, eos_id)])
    return train, held


def write_prompts_jsonl(path: str | Path, prompts: Sequence[dict]) -> None:
    """Write prompt records one JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
