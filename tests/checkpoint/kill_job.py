"""One rank of a kill trial's 2-rank job, run in a process the driver (``checkpoint_kill.py``)
forks: resume and check what was resumed, train, write the expected state aside, save, and die by
SIGKILL at the n-th file-system event when the driver chose it as the victim.

Kept apart from the driver because this side runs inside the job under test (it patches
``os``/``shutil`` to count events), while the driver only forks, waits and verifies.

Not a test module: imported by checkpoint_kill.py's driver.
"""

from __future__ import annotations

import os
import shutil
import signal
from datetime import timedelta
from pathlib import Path

import torch

SAVES_PER_TRIAL = 2
ROLL_CALL_S = 0.2
"""The survivor's roll call (``errors.ROLL_CALL_S``, 3 s by default) in a trial's job: the roll call
waits for other survivors, and a 2-rank job has none, so its wait always ends at the limit with the
dead rank named; a shorter limit names the same rank without the survivor idling 3 s per kill."""
ASYNC_ENV = "MODELPARALLEL_KILL_ASYNC"
"""Set to 1 (``--async``): the trials save asynchronously, so kills land in the background writer."""
FULL_ENV = "MODELPARALLEL_KILL_FULL"
"""Set to 1 (``--full``): the trials save full checkpoints (``partial=False``), model weights only."""
EVENTS = ((os, "fsync"), (os, "replace"), (os, "rename"), (os, "mkdir"), (os, "unlink"), (shutil, "rmtree"))


def _tripwire(n: int, counter: list[int], note: Path) -> None:
    """Count file-system events in this process; SIGKILL it at event ``n`` (0: only count),
    after noting which event it was in ``note``."""
    for module, name in EVENTS:
        original = getattr(module, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            counter[0] += 1
            if counter[0] == n:
                target = Path(str(args[0])) if args and isinstance(args[0], (str, os.PathLike)) else ""
                note.write_text(f"{_name} {'/'.join(Path(target).parts[-2:]) if target else args[:1]}")
                os.kill(os.getpid(), signal.SIGKILL)
            return _original(*args, **kwargs)

        setattr(module, name, wrapped)


def _gathered(model, optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"model/{k}": full(v) for k, v in model.module.state_dict().items() if k != "lm_head.weight"}
    names = {id(p): n for n, p in model.module.named_parameters()}
    for p, slots in optimizer.optimizer.state.items():
        out.update({f"optimizer/{names[id(p)]}/{k}": full(v) for k, v in slots.items()})
    return out


def _job(rank: int, root: Path, trial: int, kill_at: int, store: str) -> None:
    """One rank of a trial's 2-rank job (runs in a forked child)."""
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import modelparallel as smp
    from modelparallel.checkpoint.safety import commit, errors

    errors.ROLL_CALL_S = ROLL_CALL_S  # this forked job's own copy of the module
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    smp.init({"tensor_parallel_degree": 2, "random_seed": 0})
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=101, n_positions=16, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    (root / f"ready.{rank}").write_text("")  # the driver's timer starts once both ranks are up
    model = smp.DistributedModel(GPT2LMHeadModel(config))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ckpt = root / "ckpt"
    full = os.environ.get(FULL_ENV) == "1"
    if commit.read_newest(ckpt) is not None:
        tag = smp.resume_from_checkpoint(ckpt, partial=not full)
        expected = torch.load(root / "expected" / f"{tag}.pt")
        got = _gathered(model, optimizer)
        if full:  # a full checkpoint holds the model's weights only
            expected, got = ({k: v for k, v in d.items() if k.startswith("model/")} for d in (expected, got))
        bad = [k for k in expected if not torch.equal(expected[k], got[k])]
        assert not bad and got.keys() == expected.keys(), f"resumed {tag}: differs in {bad[:5]}"
    counter = [0]
    _tripwire(kill_at, counter, root / "logs" / f"trial{trial}.killed_at")
    for i in range(SAVES_PER_TRIAL):
        ids = (torch.arange(24).reshape(2, 12) * (trial + i + 3)) % 101
        model.backward(model(ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
        tag = f"t{trial}_{i}"
        state = _gathered(model, optimizer)
        if rank == 0:
            commit.write_file_atomic(root / "expected" / f"{tag}.pt", _to_bytes(state))
        smp.barrier()
        smp.save_checkpoint(ckpt, tag, user_content=tag, partial=not full,
                            num_kept_partial_checkpoints=None if full else 2,
                            async_save=os.environ.get(ASYNC_ENV) == "1")
    smp.wait_for_checkpoints()
    (root / f"events.{rank}").write_text(str(counter[0]))


def _to_bytes(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
