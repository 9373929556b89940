"""The exception every rank raises when a checkpoint save or load failed on at least one rank.

It lives apart from ``errors`` (the agreement that raises it, built on torch.distributed) so
that code reading checkpoints without torch (the launcher's ``--resume`` check, ``commit``,
``manifest``) can raise and catch it; ``errors`` re-exports it, where callers have always found it.
"""


class CheckpointError(RuntimeError):
    """A checkpoint save or load failed on at least one rank; raised on every rank.

    When every failing rank raised the same built-in type (``FileNotFoundError``, ``ValueError``...)
    the error is also an instance of that type, so ``except FileNotFoundError`` still works.
    """
