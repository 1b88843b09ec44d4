#!/usr/bin/env python3
"""Print requirements declared in pyproject.toml, one per line, for the Makefile to install.

  requirements.py build        [build-system] requires
  requirements.py extra NAME   [project.optional-dependencies] NAME

The Makefile installs the build requirements itself (it builds without isolation, so that the
persistent CMake build directory is reused) and a test extra without reinstalling the project;
reading them from pyproject.toml keeps one list of each. Standard library only.
"""

from __future__ import annotations

import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def load() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)


def main(argv: list[str]) -> int:
    data = load()
    if argv == ["build"]:
        requirements = data["build-system"]["requires"]
    elif len(argv) == 2 and argv[0] == "extra":
        extras = data["project"]["optional-dependencies"]
        if argv[1] not in extras:
            print(f"no extra {argv[1]!r} in {PYPROJECT} (have: {', '.join(extras)})", file=sys.stderr)
            return 2
        requirements = extras[argv[1]]
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(requirements))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
