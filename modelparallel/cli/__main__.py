"""``python -m modelparallel.cli``: what the launcher starts on every rank."""

import sys

from . import main

sys.exit(main())
