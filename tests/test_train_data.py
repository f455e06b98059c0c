"""Training data: --stdlib from another tree (directory or tar), pack_stdlib.py, editing-pair augmentation."""

from __future__ import annotations

import importlib.util
import io
import json
import tarfile
from pathlib import Path

import pytest

from spectool.cli.train_target import main as train_target_main
from spectool.train import data
from spectool.train.tokenizer import eos_id, train_tokenizer

PACK_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "pack_stdlib.py"
REAL = data.stdlib_root()

# A small standard library, written out by hand: which relative paths fall in which split.
TRAIN_FILES = ("os.py", "shutil.py", "email/utils.py", "test/test_shutil.py", "crlf.py")
HELD_FILES = ("json/__init__.py", "textwrap.py", "test/test_csv.py")
SKIPPED_FILES = ("encodings/cp1252.py", "site-packages/pkg/mod.py", "README.txt", "latin1.py", "big.py")


def _write_tree(lib: Path) -> None:
    texts = {"os.py": "import sys\n", "test/test_shutil.py": "import shutil\n",
             "test/test_csv.py": "import csv\n", "encodings/cp1252.py": "TABLE = ()\n",
             "site-packages/pkg/mod.py": "x = 1\n", "README.txt": "not python\n",
             "crlf.py": "a = 1\r\nb = 2\r\n", "big.py": "x = 1\n" * 80_000}
    for rel in TRAIN_FILES + HELD_FILES + SKIPPED_FILES:
        path = lib / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel == "latin1.py":
            path.write_bytes("name = 'café'\n".encode("latin-1"))
        elif rel in texts:
            path.write_bytes(texts[rel].encode())
        else:  # real source, long enough for evaluation windows and editing chunks
            path.write_text((REAL / rel).read_text(encoding="utf-8"), encoding="utf-8")


def _tar(src: Path, dest: Path, prefix: str) -> Path:
    with tarfile.open(dest, "w:xz") as tar:
        for path in sorted(src.rglob("*")):
            if path.is_file():
                info = tarfile.TarInfo(prefix + path.relative_to(src).as_posix())
                raw = path.read_bytes()
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
    return dest


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A Python source checkout holding Lib/."""
    root = tmp_path_factory.mktemp("python")
    _write_tree(root / "Lib")
    return root


def test_stdlib_directory_and_archive_give_the_same_split(tree, tmp_path):
    archive = _tar(tree, tmp_path / "lib.tar.xz", "Python-3.99/")  # the shape of a source tarball
    for source in (tree, tree / "Lib", archive):
        train = dict(data.stdlib_sources(stdlib=source))
        held = dict(data.stdlib_sources(held_out=True, stdlib=source))
        assert set(train) == set(TRAIN_FILES)
        assert set(held) == set(HELD_FILES)
        assert train["crlf.py"] == "a = 1\nb = 2\n"  # newlines as Path.read_text gives them
        assert held["textwrap.py"] == (REAL / "textwrap.py").read_text(encoding="utf-8")
        assert {name for name, _ in data.heldout_named_documents(source)} == {"json/__init__.py", "textwrap.py"}
        assert data.read_corpus("stdlib", source) == [train[name] for name in sorted(train)]


def test_pack_stdlib_round_trips(tree, tmp_path):
    spec = importlib.util.spec_from_file_location("pack_stdlib", PACK_SCRIPT)
    pack_stdlib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pack_stdlib)
    archive = tmp_path / "out" / "lib.tar.xz"
    assert pack_stdlib.main(["--root", str(tree / "Lib"), "--out", str(archive)]) == 0
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert names == set(TRAIN_FILES + HELD_FILES) | {"latin1.py"}  # what the split rule can use, both splits
    for held_out in (False, True):
        assert data.stdlib_sources(held_out, archive) == data.stdlib_sources(held_out, tree)
    assert pack_stdlib.main(["--root", str(tmp_path), "--out", str(tmp_path / "x.tar.xz")]) == 2


def test_bad_stdlib_is_a_clear_error(tree, tmp_path):
    not_tar = tmp_path / "lib.tar.xz"
    not_tar.write_text("not an archive")
    no_os = _tar(tree / "Lib" / "json", tmp_path / "json.tar.xz", "")
    cases = {tmp_path / "missing": "does not exist", not_tar: "not a readable tar archive",
             no_os: "no os.py", tree / "Lib" / "json": "not a Python standard library"}
    for source, message in cases.items():
        with pytest.raises(ValueError, match=message):
            data.stdlib_sources(stdlib=source)
    with pytest.raises(ValueError, match="only applies to --corpus stdlib"):
        data.read_corpus(tree / "Lib" / "textwrap.py", stdlib=tree)


def _split_pair(doc: str) -> tuple[str, str, str]:
    head, rest = doc.split("\n", 1)
    chunk, edited = rest.split("\n" + data.EDIT_HEADER, 1)
    return head.removeprefix("# Original ").removesuffix(":"), chunk, edited


def _is_light_edit(chunk: str, edited: str) -> bool:
    """Undo the rename and the added comment: what is left must be the chunk less at most one line."""
    if "_v2" in chunk or edited == chunk:
        return False
    left = [line for line in edited.replace("_v2", "").split("\n")
            if line.strip() != "# edited: keep this in step with the caller"]
    lines = chunk.split("\n")
    return left == lines or any(lines[:j] + lines[j + 1:] == left for j in range(len(lines)))


def test_editing_pairs_copy_training_text_with_a_light_edit():
    docs = data.stdlib_sources()[:60]
    sources = dict(docs)
    pairs = data.editing_pairs(docs, 0.25, seed=3)
    share = sum(map(len, pairs)) / (sum(map(len, pairs)) + sum(len(t) for t in sources.values()))
    assert 0.25 <= share < 0.30  # the last pair may overshoot by one chunk
    for doc in pairs:
        name, chunk, edited = _split_pair(doc)
        assert chunk and chunk in sources[name]  # a chunk of the named training file, whole lines
        assert chunk.endswith("\n") and (sources[name].startswith(chunk) or f"\n{chunk}" in sources[name])
        assert _is_light_edit(chunk, edited)
    assert data.editing_pairs(docs, 0.25, seed=3) == pairs
    assert data.editing_pairs(docs, 0.25, seed=4) != pairs
    assert data.editing_pairs(docs, 0.0) == []
    with pytest.raises(ValueError, match="edit fraction"):
        data.editing_pairs(docs, 1.0)


def test_editing_prompts_use_the_same_layout():
    named = data.heldout_named_documents()
    for p in data.editing_prompts(named, 4):
        name, chunk, head = _split_pair(p["prompt"])
        assert name == p["source"] and chunk in dict(named)[name]
        assert _is_light_edit(chunk, head + p["reference"])  # head + reference: one edited copy


def test_pairs_never_come_from_a_corpus_evaluation_tail(tmp_path):
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    docs = [{"text": "".join(f"def {w}_{i}(x):\n    return x + {i}\n" for i in range(40))} for w in words]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(d) for d in docs))
    tok = train_tokenizer([d["text"] for d in docs], 300)
    plain, held = data.corpus_tokens(corpus, tok, eos_id(tok), 32, edit_fraction=0.0)
    train, held2 = data.corpus_tokens(corpus, tok, eos_id(tok), 32, edit_fraction=0.5)
    assert held.tolist() == held2.tolist() and train[:len(plain)].tolist() == plain.tolist()
    pairs_text = tok.decode(train[len(plain):].tolist())
    assert pairs_text.count(data.EDIT_HEADER) >= 2
    assert "hotel_" in tok.decode(held.tolist())  # the last document is in the tail ...
    assert "hotel_" not in pairs_text              # ... so no pair copies it


def test_train_target_reads_the_given_stdlib(tree, tmp_path, capsys):
    archive = _tar(tree / "Lib", tmp_path / "lib.tar.xz", "")
    out = tmp_path / "target"
    args = ["--corpus", "stdlib", "--stdlib", str(archive), "--out", str(out), "--device", "cpu",
            "--no-progress", "--epochs", "2", "--batch-size", "4", "--seq-len", "32", "--vocab-size", "300",
            "--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate-size", "64"]
    assert train_target_main(args) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["train_tokens"] < 200_000  # the small tree, not this Python's 8.4 M-token library
    # Epochs fix the step count: steps x batch x seq_len covers the training stream twice.
    assert abs(result["steps"] * 4 * 32 - 2 * result["train_tokens"]) <= 4 * 32
    assert result["heldout_source"] == "held-out stdlib modules"
    capsys.readouterr()
    assert train_target_main(["--corpus", str(tree / "Lib" / "shutil.py"), "--stdlib", str(archive),
                              "--out", str(tmp_path / "t2"), "--device", "cpu", "--no-progress"]) == 2
    assert "only applies to --corpus stdlib" in capsys.readouterr().err
