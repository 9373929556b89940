"""The world mesh and its process groups, built once per layout in a process.

Every process group PyTorch creates keeps its threads and sockets (three threads per gloo group)
until the process ends; ``init`` called again (a script that restarts the runtime, a test process
running many jobs) would add a set each time, and the idle gloo threads then wake often enough
to slow a small machine several-fold. So a restart with a layout this process has built before
reuses that layout's meshes. Groups hold no state between collectives: reusing one is the same
as making it again. Every rank calls ``init`` with the same configs in the same order, so every
rank builds (a collective) or reuses at the same calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Meshes:
    """What ``init`` builds for one layout."""

    world: DeviceMesh
    expert: DeviceMesh
    groups: dict
    """Process groups spanning several mesh dimensions (see ``runtime._multi_dim_groups``)."""


@dataclass
class MeshCache:
    """The meshes built over one default process group, by layout; handed from each runtime to
    the next (the distributed context is passed along, not kept in a module)."""

    world_group: Any
    built: dict = field(default_factory=dict)

    def get(self, device: torch.device, layout: torch.Tensor, expert_degree: int,
            build: Callable[[], Meshes]) -> Meshes:
        key = (device.type, tuple(layout.shape), tuple(layout.flatten().tolist()), expert_degree)
        if key not in self.built:
            self.built[key] = build()
        return self.built[key]


def carried(previous: MeshCache | None) -> MeshCache:
    """``previous`` while the default process group is still the one it was built over (a
    destroyed and re-created world makes every group of the old one unusable), else a new one."""
    if previous is not None and previous.world_group is dist.group.WORLD:
        return previous
    return MeshCache(dist.group.WORLD)
