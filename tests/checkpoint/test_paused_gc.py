"""``paused_gc`` (modelparallel/checkpoint/paused_gc.py): the collector is off inside the block and
back as it was after it, errors and decorator use included; a failure means checkpoint saves leave
the process with its garbage collector switched off (or never switch it off)."""

import gc

import pytest

from modelparallel.checkpoint.paused_gc import paused_gc


def test_paused_gc_restores_the_collectors_state():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with paused_gc():
            assert not gc.isenabled()
            raise RuntimeError("inside")
    assert gc.isenabled(), "back on after an error"
    gc.disable()
    try:
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled(), "left off when it was off"
    finally:
        gc.enable()

    @paused_gc()
    def decorated():
        return gc.isenabled()

    assert decorated() is False and gc.isenabled()
