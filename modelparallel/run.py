"""``python -m modelparallel.run [torchrun options] script.py [args]``: ``modelparallel run``
(see ``modelparallel/sagemaker/launch.py``)."""

import sys

from .sagemaker.launch import main

if __name__ == "__main__":
    sys.exit(main())
