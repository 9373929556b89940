"""Helpers shared by tests that train a distributed model a few steps and compare its whole state
(model tensors and optimizer slots at their global shapes) with another run's."""

import torch
from torch.distributed.tensor import DTensor


def full_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` at its global shape (a collective for a sharded DTensor)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def gathered_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every model tensor (``model/<key>``) and optimizer slot (``optim/<param>/<slot>``) of an
    ``smp`` model and optimizer at its global shape (a collective)."""
    out = {f"model/{k}": full_copy(v) for k, v in model.module.state_dict().items()}
    names = {id(p): n for n, p in model.module.named_parameters()}
    for p, slots in optimizer.optimizer.state.items():
        out.update({f"optim/{names[id(p)]}/{k}": full_copy(v) for k, v in slots.items()})
    return out


def train_steps(model, optimizer, batches) -> list[float]:
    """One training step per batch of token ids (labels = inputs); the losses."""
    losses = []
    for ids in batches:
        loss = model(ids, labels=ids).loss
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def recording_defers(stager, watched: set):
    """``stager.defer`` that also adds to ``watched`` the names of the tensors it left to the
    kernel's write tracking (``background/pages.py``) rather than to a CRC32 read. Looked at in
    the call: the background thread takes the deferred list as soon as the call returns."""
    defer = stager.defer

    def recording(name, *args, **kwargs):
        defer(name, *args, **kwargs)
        if stager.deferred and stager.deferred[-1].name == name and stager.deferred[-1].pages is not None:
            watched.add(name)

    return recording
