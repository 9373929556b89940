"""Crash safety and safe reading: the atomic commit, ``newest`` and retention (``commit``, built
on ``durable`` writes and file ``checksums``), the manifest every committed directory holds
(``manifest``), one writer per directory (``lock``), checksums (``crc``), files opened and read
verified without following links (``safe_open``, ``files``), no code run from a file
(``safe_load``), and a failure on one rank raised on every rank (``errors``,
built on torch.distributed; the exception it raises lives in ``failure``, which needs no torch)."""
