"""The pickles inside a ``torch.save`` file, found where ``torch.load`` will read them and each
bounded by ``pickle_bounds.check_expansion``: the members of its zip (stored, never compressed),
or the pickles one after another of the format before zips.

Kept apart from ``pickle_bounds`` because this is about the file's container (zip headers, data
before the zip, the pre-zip layout), while ``pickle_bounds`` scans one pickle's opcodes.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile

from .pickle_bounds import check_expansion

_LOCAL_HEADER = struct.Struct("<4s22xHH")
"""A zip member's local header: signature, then (past fields not used) name and extra lengths."""


def check_zip_pickles(source: io.BytesIO) -> None:
    """``check_expansion`` on every pickle of the ``torch.save`` file (a zip) in ``source`` (a
    binary file), read where it is (its position kept); a pickle stored compressed is refused
    (``torch.save`` never compresses, and reading one would inflate it first). A file that is not
    a zip is read by ``torch.load`` as its format before zips (five pickles one after another,
    then raw storage bytes): those pickles are checked, and what is no pickle left to the reader.
    A zip after other data is refused: Python's zipfile finds it, ``torch.load`` reads the start.

    Raises:
        pickle.UnpicklingError: naming the pickle (the caller names the file).
        ValueError: a file that is neither a zip nor starts with pickles (damaged).
    """
    start = source.tell()
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, ValueError, OSError):
        source.seek(start)
        try:
            _check_sequential(source.read())
        finally:
            source.seek(start)
        return
    try:
        record = zipfile._EndRecData(source)  # noqa: SLF001 - where the end record puts the directory
        if record is None or archive.start_dir != record[zipfile._ECD_OFFSET]:  # noqa: SLF001
            raise pickle.UnpicklingError("refused: data before its zip (torch.save writes none; torch.load "
                                         "then reads the pickles at its start, not the zip this check reads)")
        for info in archive.infolist():
            if not info.filename.endswith(".pkl"):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise pickle.UnpicklingError(f"refused: {info.filename} is stored compressed")
            check_expansion(_stored(source, info))
    finally:
        archive.close()
        source.seek(start)


def _check_sequential(data: bytes) -> None:
    """The pickles of ``torch.save``'s format before zips: magic number, version, system
    information, the object, its storage keys (what follows is raw data)."""
    if data[:2] == b"PK":
        return  # a damaged zip: torch.load reads no pickle from it (it has no PERSID opcode)
    at = 0
    for _ in range(5):
        if at >= len(data):
            return  # the reader says it ends early
        try:
            at += check_expansion(memoryview(data)[at:])
        except pickle.UnpicklingError as e:
            if str(e).startswith("not a valid pickle"):
                raise ValueError(f"neither a zip nor a pickle at byte {at}: {e}") from None
            raise


def _stored(source: io.BytesIO, info: zipfile.ZipInfo) -> bytes:
    """The bytes of a member stored uncompressed, read through its local header (not
    ``ZipFile.read``, which also checks a CRC-32 that some writers leave out and torch never reads)."""
    source.seek(info.header_offset)
    head = source.read(_LOCAL_HEADER.size)
    if len(head) < _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(head)[0] != b"PK\x03\x04":
        raise pickle.UnpicklingError(f"{info.filename}: its zip header is damaged")
    _, name_len, extra_len = _LOCAL_HEADER.unpack(head)
    source.seek(info.header_offset + _LOCAL_HEADER.size + name_len + extra_len)
    data = source.read(info.file_size)
    if len(data) != info.file_size:
        raise pickle.UnpicklingError(f"{info.filename}: ends before its {info.file_size} bytes")
    return data
