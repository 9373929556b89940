"""Saves that do not stop training: state staged to host memory and written by a background thread
(``async_save``), full checkpoints gathered in the call and written later (``async_full``), and
the check that a tensor copied late did not change meanwhile (``deferred``)."""
