"""The training corpus and the held-out set, as sorted lists of source files (no network, no downloads).

Training text is the CPython standard library of the running interpreter (`sysconfig` "stdlib": every `.py`
outside site-packages, PSF-licensed), split by a hash of each file's relative path, so the split is the same on
every machine with that Python and does not move when files are added. The held-out set is the pure-Python
source of the third-party packages in HELD_OUT_PACKAGES, wherever they are installed; none of it is trained on.
Files over MAX_FILE_BYTES (data tables such as `pydoc_data/topics.py`) and files that are not UTF-8 are left out.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_PACKAGES = ("click", "jinja2", "attr", "httpx", "h11", "starlette", "yaml", "requests", "urllib3")
MAX_FILE_BYTES = 300_000
_NOT_STDLIB = ("site-packages", "dist-packages", "__pycache__")


@dataclass(frozen=True)
class SourceFile:
    name: str  # path relative to its root, "/"-separated: the split's key
    text: str


@dataclass(frozen=True)
class Corpus:
    train: list[SourceFile]
    val: list[SourceFile]  # stdlib files held out of training (same distribution)
    held_out: list[SourceFile]  # third-party packages (another distribution)
    held_out_packages: list[str]  # those of HELD_OUT_PACKAGES found installed
    python_version: str

    def summary(self) -> dict[str, object]:
        """Counts and characters per part, for the training log."""
        part = {n: getattr(self, n) for n in ("train", "val", "held_out")}
        return {"python": self.python_version, "held_out_packages": self.held_out_packages,
                **{f"{n}_files": len(f) for n, f in part.items()},
                **{f"{n}_chars": sum(len(s.text) for s in f) for n, f in part.items()}}


def stdlib_dir() -> Path:
    """The running interpreter's `Lib/`."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_val(name: str, val_percent: float) -> bool:
    """Whether file `name` belongs to the validation split: a fixed hash of its name, not its position."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 10_000 < val_percent * 100


def read_sources(root: Path, skip_parts: tuple[str, ...] = ()) -> list[SourceFile]:
    """Every readable `.py` under root (not under a folder named in skip_parts), sorted by relative name."""
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in skip_parts for part in rel.parts) or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(SourceFile(rel.as_posix(), text))
    return files


def held_out_sources(packages: tuple[str, ...] = HELD_OUT_PACKAGES) -> tuple[list[SourceFile], list[str]]:
    """The source files of the installed `packages` (each file named `package/relative path`), and which were found."""
    files, found = [], []
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        files += [SourceFile(f"{package}/{f.name}", f.text) for f in read_sources(root, ("__pycache__",))]
        found.append(package)
    return files, found


def load_corpus(val_percent: float = 2.0, max_files: int | None = None) -> Corpus:
    """The stdlib split into train / val, and the held-out third-party files. `max_files` keeps the first
    files of each part (by name; a tenth as many of val and held-out) for micro runs; None keeps all."""
    if not 0 < val_percent < 100:
        raise ValueError(f"val_percent must lie in (0, 100), got {val_percent}")
    stdlib = read_sources(stdlib_dir(), _NOT_STDLIB)
    if not stdlib:
        raise RuntimeError(f"no standard-library sources under {stdlib_dir()}")
    train = [f for f in stdlib if not is_val(f.name, val_percent)]
    val = [f for f in stdlib if is_val(f.name, val_percent)]
    held_out, found = held_out_sources()
    if max_files is not None:
        few = max(1, max_files // 10)
        train, val, held_out = train[:max_files], val[:few], held_out[:few]
    return Corpus(train, val, held_out, found, ".".join(map(str, sys.version_info[:3])))
