"""VeOmni's parallel state made from the engine's mesh, so VeOmni's groups are ours.

VeOmni's builders (FSDP2 parallelisation, gradient clipping, the optimizer, the model factory) read
an ambient `ParallelState` whose groups come from a device mesh VeOmni builds with
init_device_mesh over the default group, and whose world size and rank are the default group's.
`MeshParallelState` answers the same questions from a common.engine.mesh.ParallelMesh instead:
world size and rank of the engine's world group, the data-parallel group, the shard group FSDP2
shards over (data x Ulysses: VeOmni's dp_shard_sp / dp_sp), the Ulysses group. VeOmni creates no
group and keeps no state of ours in its registry or topology cache; the engine makes it ambient
around each VeOmni call (use_parallel_state). So a VeOmni engine runs on the mesh a host passes
in, a sub-world included.

Imports veomni: imported only when a VeOmni engine is built.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as torch_dist
from veomni.distributed.parallel_state import ParallelState

from ...common.engine.mesh import DATA, ULYSSES, ParallelMesh


@dataclasses.dataclass(frozen=True)
class MeshParallelState(ParallelState):
    mesh: ParallelMesh | None = None
    """The engine's mesh: every group below is one of its groups."""

    # -- the world: the engine's ranks, not the default group's --------------------------------------
    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def global_rank(self) -> int:
        return torch_dist.get_rank(self.mesh.world_group) if self.mesh.world_size > 1 else 0

    # -- data parallel (no replicate dimension: dp == dp_shard) --------------------------------------
    @property
    def dp_group(self):
        return self.mesh.dp_group

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_mesh(self):
        return self._data_device_mesh()

    @property
    def dp_shard_group(self):
        return self.mesh.dp_group

    @property
    def dp_shard_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_shard_mesh(self):
        return self._data_device_mesh()

    # -- what FSDP2 shards over: data x Ulysses ------------------------------------------------------
    @property
    def dp_shard_sp_group(self):
        return self.mesh.shard_group

    @property
    def fsdp_group(self):
        return self.mesh.shard_group

    @property
    def fsdp_rank(self) -> int:
        return self.mesh.shard_rank

    @property
    def fsdp_mesh(self):
        return self.mesh.fsdp_device_mesh(self.device_type)

    # -- Ulysses (VeOmni's sp is Ulysses here: no context parallel on this backend) ------------------
    @property
    def ulysses_group(self):
        return self.mesh.groups[ULYSSES] if self.ulysses_enabled else None

    @property
    def ulysses_rank(self) -> int:
        return self.mesh.coords[ULYSSES] if self.ulysses_enabled else -1

    @property
    def sp_group(self):
        return self.ulysses_group

    @property
    def sp_rank(self) -> int:
        return self.ulysses_rank

    def _data_device_mesh(self):
        if not self.ulysses_enabled:
            return self.fsdp_mesh  # the shard group is the data group
        if self.mesh.device_mesh is None:
            raise ValueError("VeOmni asked for the data-parallel device mesh of a mesh built from groups "
                             "(ParallelMesh.from_groups): build the mesh with common.engine.mesh.build_mesh")
        return self.mesh.device_mesh[DATA]


def parallel_state_for(mesh: ParallelMesh, device_type: str) -> MeshParallelState:
    """VeOmni's ParallelState for an engine on `mesh` (data parallel x Ulysses, FSDP2)."""
    dp, ulysses = mesh.dp_size, mesh.sizes[ULYSSES]
    # device_mesh: VeOmni requires one with Ulysses; every group it asks for comes from `mesh` above.
    replicate = mesh.replicate_size  # HSDP: VeOmni's dp_replicate x dp_shard, FSDP2 over fsdp_mesh (2-D)
    return MeshParallelState(dp_size=dp, dp_replicate_size=replicate, dp_shard_size=dp // replicate,
                             ulysses_size=ulysses,
                             dp_mode="fsdp2", device_type=device_type,
                             device_mesh=mesh.device_mesh or mesh.fsdp_device_mesh(device_type), mesh=mesh)
