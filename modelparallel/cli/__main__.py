"""``python -m modelparallel.cli``: what the launcher starts on every rank.

Guarded like any script: importing this module (a tool listing the package's modules, a test)
must not run the command, which would parse the importer's own ``sys.argv`` and exit."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
