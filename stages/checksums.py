"""SHA256SUMS: what a bundle's checksums say and whether its files still match them.

The hand-off writes one per bundle (`sha256sum -c SHA256SUMS` verifies it with coreutils); the champion
comparison reads it back before trusting a published bundle's figures.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SUMS = "SHA256SUMS"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_dir(path: Path, pattern: str = "*.safetensors") -> str:
    """One hash over the named files of a model/adapter directory (names and bytes)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob(pattern)):
        h.update(f.name.encode() + b"\0" + sha256_file(f).encode())
    return h.hexdigest()


def render(sums: dict[str, str]) -> str:
    """The SHA256SUMS text for {file name: sha256}, in the order given (coreutils' format)."""
    return "".join(f"{digest}  {name}\n" for name, digest in sums.items())


def read(directory: Path) -> tuple[dict[str, str] | None, str | None]:
    """({file name: sha256} listed in <directory>/SHA256SUMS, None) or (None, why it cannot be read)."""
    path = Path(directory) / SUMS
    if not path.is_file():
        return None, f"it has no {SUMS}"
    listed = {}
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name or "/" in name:
            return None, f"{SUMS} line {n} is not `<sha256>  <file>`"
        listed[name] = digest
    return listed, None


def mismatch(directory: Path, listed: dict[str, str]) -> str | None:
    """The first listed file that is missing or hashes otherwise, said as such; None when all match."""
    for name, digest in listed.items():
        f = Path(directory) / name
        if not f.is_file():
            return f"{name}, listed in {SUMS}, is missing"
        if sha256_file(f) != digest:
            return f"{name} does not match its {SUMS}"
    return None
