"""``python -m modelparallel``: the ``modelparallel`` command (``modelparallel.cli:main``, the
console script of pyproject.toml), for an environment whose scripts directory is not on PATH."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
