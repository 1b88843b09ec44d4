"""The training text: the King James Bible from Debian's ``bible-kjv-text`` package.

The text is public domain (the translation is from 1611; the package's copyright file says so).
Debian ships it compressed for its own reader, so both packages are fetched with the ordinary
client (``apt-get download``, no root install), unpacked with ``dpkg-deb -x``, checked against
their sha256, and the package's ``bible`` program prints the whole text, one verse a line
("Ge1:1 In the beginning God created the heaven and the earth."). That text is cached.

The held-out split is every ``HOLD_OUT_EVERY``-th chapter of the Bible, so it covers the whole
book (law, poetry, prophets, gospels, letters) and no training chapter is in it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hyspec.paths import cache_dir

# Debian 13 (trixie), version 4.38 of both. The text is data; the program decompresses it.
PACKAGES: dict[str, str] = {
    "bible-kjv-text_4.38_all.deb": "d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a",
    "bible-kjv_4.38_amd64.deb": "75a49c032a6efa9faa2beb4a9acb70974380122906329d0e100de36cc88ff02d",
}
# `bible -f Gen1:1-Rev22:21`: 31102 verses, 4404412 bytes of ASCII.
TEXT_SHA256 = "cd45f0c9cedab8e4439bd6486c8952c77cc8b0ecc5d1f6ae3513f2039f47229d"
TEXT_NAME = "kjv.txt"
HOLD_OUT_EVERY = 20  # chapters 10, 30, 50, ... (0-based) are held out: 59 of 1189

_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


class CorpusError(RuntimeError):
    """The corpus could not be fetched, or it is not the text it should be."""


@dataclass(frozen=True)
class Chapter:
    book: str  # the package's abbreviation: Ge, Exo, ..., Rev
    number: int
    verses: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.book} {self.number}"

    @property
    def text(self) -> str:
        """The chapter as a document: one verse a line, no verse numbers."""
        return "\n".join(self.verses)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _run(cmd: list[str], cwd: Path) -> str:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as e:
        raise CorpusError(f"{cmd[0]} not found: the corpus comes from Debian packages (apt-get, dpkg-deb)") from e
    if done.returncode != 0:
        raise CorpusError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return done.stdout


def fetch_text(directory: Path | None = None) -> Path:
    """The verse-per-line text, fetched and checked once, then cached in ``directory``
    (default: ``<hyspec cache>/corpus``)."""
    directory = Path(directory) if directory is not None else cache_dir() / "corpus"
    out = directory / TEXT_NAME
    if out.is_file() and sha256_file(out) == TEXT_SHA256:
        return out
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hyspec-kjv-") as tmp_name:
        tmp = Path(tmp_name)
        # apt drops privileges to _apt for downloads; a private temp dir must let it write.
        os.chmod(tmp, 0o777)
        for deb in PACKAGES:
            name, version = deb.split("_")[:2]
            try:
                _run(["apt-get", "download", "-q", f"{name}={version}"], tmp)
            except CorpusError:
                # A fresh machine may have no package lists yet.
                _run(["apt-get", "update", "-q"], tmp)
                _run(["apt-get", "download", "-q", f"{name}={version}"], tmp)
        for deb, expected in PACKAGES.items():
            got = sha256_file(tmp / deb)
            if got != expected:
                raise CorpusError(f"{deb}: sha256 {got}, expected {expected}")
            _run(["dpkg-deb", "-x", deb, "root"], tmp)
        lib = tmp / "root" / "usr" / "lib"
        # -f: one verse a line with its reference; -p: where bible.data is.
        text = _run([str(tmp / "root" / "usr" / "bin" / "bible"), "-f", "-p", str(lib), "Gen1:1-Rev22:21"], tmp)
        got = hashlib.sha256(text.encode()).hexdigest()
        if got != TEXT_SHA256:
            raise CorpusError(f"the text printed by bible(1) has sha256 {got}, expected {TEXT_SHA256}")
        partial = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        partial.write_text(text)
        shutil.move(partial, out)
    return out


def parse(text: str) -> list[Chapter]:
    """Chapters in Bible order from ``bible -f`` output."""
    chapters: list[Chapter] = []
    key: tuple[str, int] | None = None
    verses: list[str] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _VERSE.match(line)
        if m is None:
            raise CorpusError(f"line {lineno} is not a verse: {line[:80]!r}")
        book, chapter, verse = m.group(1), int(m.group(2)), m.group(4).strip()
        if (book, chapter) != key:
            if key is not None:
                chapters.append(Chapter(key[0], key[1], tuple(verses)))
            key, verses = (book, chapter), []
        verses.append(verse)
    if key is not None:
        chapters.append(Chapter(key[0], key[1], tuple(verses)))
    return chapters


def split(chapters: list[Chapter], every: int = HOLD_OUT_EVERY) -> tuple[list[Chapter], list[Chapter]]:
    """(training, held-out): chapter i is held out when i % every == every // 2."""
    train = [c for i, c in enumerate(chapters) if i % every != every // 2]
    held_out = [c for i, c in enumerate(chapters) if i % every == every // 2]
    return train, held_out


def load(directory: Path | None = None) -> tuple[list[Chapter], list[Chapter]]:
    """(training, held-out) chapters of the checked corpus."""
    return split(parse(fetch_text(directory).read_text()))
