"""Pack this Python's standard-library source into a .tar.xz that training reads with --stdlib.

Figure: docs/TRAINING.md "Data and the held-out split". Time: under a minute.

    python benchmarks/pack_stdlib.py                 # writes .corpus/stdlib-3.11.tar.xz (ignored by git)
    python benchmarks/train_demo.py --out /tmp/demo --stdlib .corpus/stdlib-3.11.tar.xz

The training corpus is a standard library's .py files, and its size depends on the Python
version (3.11: 8.4 M tokens; 3.12, on the GPU machine: 2.3 M). Packing one version's tree lets
another machine train on exactly the same text. Only the files the split rule can use go in
(spectool.train.data: .py, no site-packages/encodings/pydoc_data, at most 400 kB), both the
training and the held-out split, with os.py at the top so the reader finds the root. The
archive is deterministic (sorted names, zero times and owners) so its bytes identify the corpus.
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
from pathlib import Path

from spectool.train import data

# A corpus archive should stay small beside the repository (64 MiB is a comfortable working-tree budget).
CARRY_LIMIT_BYTES = 64 * 2**20


def pack(root: Path, dest: Path) -> tuple[int, int]:
    """Write the usable .py files under ``root`` to ``dest`` (tar.xz); returns (files, source bytes)."""
    files = sorted(data.stdlib_files(False, root) + data.stdlib_files(True, root))
    if not (root / "os.py").is_file() or not files:
        raise ValueError(f"{root} is not a Python standard library (no os.py or no usable .py files)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    total = 0
    with tarfile.open(dest, "w:xz", preset=9) as tar:
        for path in files:
            raw = path.read_bytes()
            info = tarfile.TarInfo(path.relative_to(root).as_posix())
            info.size, info.mode = len(raw), 0o644
            tar.addfile(info, io.BytesIO(raw))
            total += len(raw)
    return len(files), total


def main(argv: list[str] | None = None) -> int:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, default=data.stdlib_root(),
                   help="standard-library directory to pack (default: this Python's)")
    p.add_argument("--out", type=Path, default=Path(".corpus") / f"stdlib-{version}.tar.xz",
                   help="archive to write (default: %(default)s)")
    a = p.parse_args(argv)
    try:
        count, source_bytes = pack(a.root, a.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = a.out.stat().st_size
    print(f"{a.out}: {count} files, {source_bytes / 1e6:.1f} MB of source, {size / 2**20:.1f} MiB packed")
    if size > CARRY_LIMIT_BYTES // 4:
        print(f"warning: the archive is over a quarter of {CARRY_LIMIT_BYTES // 2**20} MiB",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
