"""One parallel mesh per engine: the degrees of every dimension, this rank's coordinates and the
process group of each dimension, built once (torchtitan's ParallelDims, megatron's pg_collection).

Dimensions, outermost to innermost (the tensor-parallel peers are adjacent ranks, as megatron lays
them out): pipeline, data, context, ulysses, tensor. The model-parallel ones are named as the
engine.parallel fields that set their degrees (ParallelConfig); megatron's `sequence_parallel` is a
switch of the tensor dimension, not a dimension. Use the constants below, never the strings.

`build_mesh(parallel, dist, ranks=None, backend=None)` makes one over every rank of the default
group, or over a sub-world a host gives the critic (ranks 2 and 3 of 4); every engine builds it when
none is passed in, or runs on the one passed in. The libraries' own state is made from it: VeOmni's
parallel state (backends/veomni/mesh_state.py), megatron-core's parallel_state (its further groups,
BackendSpec.library_groups, are built with the mesh when `backend="megatron"`; megatron refuses a
sub-world mesh by name, since megatron-core's dist_checkpointing runs on the default group). Every collective of the
engines names its group (common.parallel.distributed refuses one without a group where others would wait):
loading, DCP, loss normalisation and metric reductions use `dp_group` or `shard_group`;
collectives that every rank of the engine joins use `world_group`.

The sequence-splitting dimensions (context, ulysses) hold the same rows as their data-parallel rank
but different tokens of them, so their gradients add up: an FSDP engine shards over and averages
gradients across `shard_group` (data x context x ulysses), while the rows, the loss normaliser and
the metrics stay per data-parallel rank.

Hybrid sharding (engine.parallel.replicate = R > 1, fsdp and VeOmni) splits the data dimension into
R replicas (outer) of data / R ranks (inner): `shard_group` is then one replica's (data / R x
context x ulysses), `replicate_group` the ranks holding the same shard in the other replicas, and
`state_group` all of them (what FSDP2's 2-D mesh spans: DCP, the export's writer, loading).
"""

from __future__ import annotations

import dataclasses

import torch.distributed as torch_dist

from .config import ParallelConfig
from ..parallel.distributed import DistContext

PIPELINE, DATA, CONTEXT, ULYSSES, TENSOR = "pipeline", "data", "context", "ulysses", "tensor"
DIMS = (PIPELINE, DATA, CONTEXT, ULYSSES, TENSOR)
# The model-parallel dimensions: each one's degree is the engine.parallel field of its name.
MODEL_PARALLEL_DIMS = (PIPELINE, CONTEXT, ULYSSES, TENSOR)
# The dimensions whose ranks hold the same rows (different tokens of them, for context and ulysses):
# parameters are sharded over, and gradients averaged across, all three.
SHARD_DIMS = (DATA, CONTEXT, ULYSSES)


@dataclasses.dataclass(eq=False)
class ParallelMesh:
    sizes: dict[str, int]
    """Degree of each of DIMS."""
    coords: dict[str, int]
    """This rank's index along each of DIMS."""
    groups: dict[str, object]
    """The process group of each dimension this rank is in (a group of one rank where the degree is 1)."""
    world_group: object
    """Every rank of the engine: the default group, or a sub-world's group (build_mesh(ranks=...))."""
    device_mesh: object = None
    """The torch DeviceMesh the groups came from, when build_mesh made them."""
    shard_group: object = None
    """The ranks parameters are sharded over and gradients averaged across: data x context x
    ulysses (the data group itself when the sequence is not split)."""
    shard_device_mesh: object = None
    """shard_group as a 1-D DeviceMesh, when the groups came from one (what FSDP2 takes)."""
    replicate_size: int = 1
    """HSDP replicas of the data dimension (engine.parallel.replicate)."""
    replicate_group: object = None
    """The ranks holding the same shard in every replica (None without HSDP)."""
    state_group: object = None
    """Every rank holding a part of the FSDP-sharded state: the replicas' shard groups together
    (data x context x ulysses); the shard group itself without HSDP."""
    fsdp_mesh: object = None
    """The 2-D (replicate, shard) DeviceMesh FSDP2 takes for HSDP (None without HSDP)."""
    library_groups: dict[str, object] = dataclasses.field(default_factory=dict)
    """The further groups a backend's library keeps (megatron-core's model-parallel, tensor x data,
    embedding, gloo copies, ...), by the names its BackendSpec.library_groups gives them: built with
    the mesh by build_mesh(..., backend=name), the group of each name this rank is in (None where
    it is in none)."""

    def __post_init__(self):
        assert set(self.sizes) == set(DIMS) and set(self.coords) == set(DIMS), (self.sizes, self.coords)
        if self.shard_group is None:
            self.shard_group = self.groups.get(DATA)
        if self.state_group is None:
            self.state_group = self.shard_group

    @property
    def shard_size(self) -> int:
        """Ranks one copy of the parameters is sharded over (one replica's, with HSDP)."""
        return self.sizes[DATA] * self.sizes[CONTEXT] * self.sizes[ULYSSES] // self.replicate_size

    @property
    def gradient_ranks(self) -> int:
        """Ranks FSDP averages gradients across: data x context x ulysses (every replica)."""
        return self.sizes[DATA] * self.sizes[CONTEXT] * self.sizes[ULYSSES]

    @property
    def is_state_main(self) -> bool:
        """The first rank of state_group: the one that writes what the whole state makes (export)."""
        return self.gradient_ranks == 1 or torch_dist.get_rank(self.state_group) == 0

    @property
    def shard_rank(self) -> int:
        return torch_dist.get_rank(self.shard_group) if self.shard_size > 1 else 0

    @property
    def sequence_split(self) -> int:
        """How many ranks share each sequence (context x ulysses): 1 when every rank holds whole sequences."""
        return self.sizes[CONTEXT] * self.sizes[ULYSSES]

    @property
    def reports_outputs(self) -> bool:
        """Whether this rank is the one of its data-parallel share whose outputs (values, metrics,
        statistics) count: the last pipeline stage's first rank of the tensor, context and ulysses
        groups. Its peers hold copies (or parts) of the same."""
        return (self.coords[PIPELINE] == self.sizes[PIPELINE] - 1
                and all(self.coords[dim] == 0 for dim in (TENSOR, CONTEXT, ULYSSES)))

    @property
    def dp_group(self):
        return self.groups[DATA]

    @property
    def dp_rank(self) -> int:
        return self.coords[DATA]

    @property
    def dp_size(self) -> int:
        return self.sizes[DATA]

    @property
    def world_size(self) -> int:
        return _product(self.sizes.values())

    def fsdp_device_mesh(self, device_type: str):
        """The DeviceMesh FSDP2 shards over: with HSDP the 2-D (replicate, shard) one; else
        shard_group as a 1-D mesh, the one build_mesh made or one over the group a host's mesh
        holds (DeviceMesh.from_group creates no group)."""
        if self.fsdp_mesh is not None:
            return self.fsdp_mesh
        if self.shard_device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self.shard_device_mesh = DeviceMesh.from_group(self.shard_group, device_type)
        return self.shard_device_mesh

    def degrees(self) -> dict[str, int]:
        """{config field: degree} of the model-parallel dimensions, e.g. {"tensor": 2, ...}."""
        return {dim: self.sizes[dim] for dim in MODEL_PARALLEL_DIMS}

    def check_matches(self, parallel: ParallelConfig, *, who: str) -> None:
        """ValueError when this mesh's model-parallel degrees are not the config's."""
        wanted = {dim: getattr(parallel, dim) for dim in MODEL_PARALLEL_DIMS}
        if wanted != self.degrees():
            raise ValueError(f"{who}: the mesh passed in has degrees {self.degrees()}, engine.parallel asks for "
                             f"{wanted}; build the mesh from the same engine.parallel")

    def release(self) -> None:
        """Forget the groups (they belong to the default group; destroy_process_group ends them)."""
        self.groups.clear()
        self.library_groups.clear()
        self.world_group = self.device_mesh = self.shard_group = self.shard_device_mesh = None
        self.replicate_group = self.state_group = self.fsdp_mesh = None

    @classmethod
    def from_groups(cls, *, sizes: dict[str, int], groups: dict[str, object], world_group=None,
                    device_mesh=None, shard_group=None, shard_device_mesh=None, replicate_size: int = 1,
                    replicate_group=None, state_group=None, fsdp_mesh=None) -> "ParallelMesh":
        """A mesh over groups that already exist (a library's, or a host's): the coordinates are this
        rank's index in each group; dimensions not named have degree 1 and a group of this rank alone
        is not needed for them (None)."""
        full_sizes = {dim: sizes.get(dim, 1) for dim in DIMS}
        full_groups = {dim: groups.get(dim) for dim in DIMS}
        coords = {dim: (torch_dist.get_rank(group) if group is not None else 0) for dim, group in full_groups.items()}
        for dim, group in full_groups.items():
            if group is not None:
                actual = torch_dist.get_world_size(group)
                assert actual == full_sizes[dim], f"{dim} group has {actual} ranks, the mesh says {full_sizes[dim]}"
        assert full_groups[DATA] is not None, "a mesh needs its data-parallel group"
        split = full_sizes[CONTEXT] * full_sizes[ULYSSES]
        assert split == 1 or shard_group is not None, "a mesh that splits sequences needs its shard group (data x context x ulysses)"
        if shard_group is not None:
            actual = torch_dist.get_world_size(shard_group)
            want = full_sizes[DATA] * split // replicate_size
            assert actual == want, f"shard group has {actual} ranks, data x context x ulysses / replicate is {want}"
        return cls(full_sizes, coords, full_groups, world_group if world_group is not None else torch_dist.group.WORLD,
                   device_mesh, shard_group, shard_device_mesh, replicate_size=replicate_size,
                   replicate_group=replicate_group, state_group=state_group, fsdp_mesh=fsdp_mesh)


def check_spans_world(mesh: ParallelMesh, *, who: str, why: str) -> None:
    """ValueError when `mesh` is a sub-world (fewer ranks than the default group): for a backend
    whose library keeps process-wide groups."""
    world = torch_dist.get_world_size()
    if mesh.world_size != world:
        raise ValueError(f"{who} runs on every process ({why}): the mesh passed in has {mesh.world_size} of the "
                         f"{world} ranks; give this backend the whole world, or use backend fsdp or veomni on a sub-world")


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def mesh_sizes(parallel: ParallelConfig, world_size: int) -> dict[str, int]:
    """Degree of each of DIMS for `world_size` ranks; data parallel takes what the others leave."""
    sizes = {dim: getattr(parallel, dim) for dim in MODEL_PARALLEL_DIMS}
    sizes[DATA] = parallel.data_parallel_size(world_size)  # ValueError naming --nproc when it (or replicate) does not divide
    return {dim: sizes[dim] for dim in DIMS}


def ranks_along(layout, *dims: str) -> list[list[int]]:
    """The rank lists of the groups spanning `dims` of a layout (the engine's global ranks laid out
    over DIMS, one axis each, degree-1 axes included): the ranks that differ only in those
    coordinates, each list in ascending order (torch.Tensor layout)."""
    return ranks_along_axes(layout, *(DIMS.index(d) for d in dims))


def ranks_along_axes(grid, *axes: int) -> list[list[int]]:
    """ranks_along for any rank grid (a torch tensor of ranks): the groups spanning `axes`."""
    rest = [a for a in range(grid.dim()) if a not in axes]
    width = _product(grid.shape[a] for a in axes)
    return sorted(sorted(row) for row in grid.permute(*rest, *axes).reshape(-1, width).tolist())


def _library_groups(spec_groups, layout, parallel, rank: int, existing: dict[tuple[int, ...], object]
                    ) -> dict[str, object]:
    """The groups a backend's library keeps (BackendSpec.library_groups), made over the whole
    default group in one order on every process (like new_group). `existing`: every group the mesh
    already has, by its rank list (None for the ones this rank is not in; the same keys on every
    process), which is reused instead of made again, as is a list made for an earlier name."""
    default_backend = torch_dist.get_backend()
    made = {(ranks, default_backend): group for ranks, group in existing.items()}
    out = {}
    for name, (rank_lists, backend) in spec_groups(layout, parallel).items():
        backend = backend or default_backend
        out[name] = None
        for ranks in rank_lists:
            key = (tuple(ranks), backend)
            if key not in made:
                made[key] = torch_dist.new_group(list(ranks), backend=None if backend == default_backend else backend)
            if rank in ranks:
                out[name] = made[key]
    return out


def build_mesh(parallel: ParallelConfig, dist: DistContext, ranks=None, *, backend: str | None = None
               ) -> ParallelMesh | None:
    """The mesh of the engine's ranks: every rank of the default group, or `ranks` of it (a host
    that gives the critic a sub-world, e.g. ranks 2 and 3 of 4). Collective over the whole default
    group, like torch's new_group: every process calls it with the same `ranks`, in the same order;
    a process outside `ranks` gets None. `backend`: a registered backend whose library keeps groups
    of its own (BackendSpec.library_groups, e.g. megatron): they are built with the mesh, from it.

    The DeviceMesh has the dimensions of degree > 1, plus DATA always, so FSDP has a data-parallel
    mesh to shard over even when it is one rank; with a split sequence (context or ulysses > 1),
    FSDP shards over data x context x ulysses flattened into one dimension, "shard"."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    world = torch_dist.get_world_size()
    members = list(range(world)) if ranks is None else sorted(int(r) for r in ranks)
    if not members or len(set(members)) != len(members) or members[0] < 0 or members[-1] >= world:
        raise ValueError(f"build_mesh: ranks {ranks} are not distinct ranks of the world of {world} processes")
    sizes = mesh_sizes(parallel, len(members))
    names = tuple(dim for dim in DIMS if sizes[dim] > 1 or dim == DATA)
    layout = torch.tensor(members).reshape(tuple(sizes[d] for d in names))
    device_mesh = DeviceMesh(dist.device.type, layout, mesh_dim_names=names)
    world_group = torch_dist.group.WORLD if len(members) == world else torch_dist.new_group(members)
    split_dims = tuple(dim for dim in SHARD_DIMS if dim in names)
    shard_mesh = device_mesh[split_dims]._flatten("shard") if len(split_dims) > 1 else device_mesh[DATA]
    inside = dist.rank in members
    groups = {dim: device_mesh.get_group(dim) for dim in names} if inside else {}
    library = {}
    spec_groups = _library_groups_of(backend)
    if spec_groups is not None:
        full_layout = torch.tensor(members).reshape(tuple(sizes[d] for d in DIMS))
        # The mesh's own groups, by rank list (a rank list of a group this rank is not in: None).
        existing = {tuple(members): world_group if inside else None}
        own = [((dim,), groups.get(dim)) for dim in names] + [(split_dims, shard_mesh.get_group() if inside else None)]
        for dims, group in own:
            for ranks in ranks_along(full_layout, *dims):
                existing[tuple(ranks)] = group if dist.rank in ranks else None
        library = _library_groups(spec_groups, full_layout, parallel, dist.rank, existing)
    hsdp = _hsdp_mesh(parallel.replicate, sizes, names, layout, dist.device.type)
    if not inside:
        return None
    if hsdp is None:
        mesh = ParallelMesh.from_groups(sizes=sizes, groups=groups, world_group=world_group, device_mesh=device_mesh,
                                        shard_group=shard_mesh.get_group(), shard_device_mesh=shard_mesh)
    else:
        two_d, shard, replicas = hsdp
        mesh = ParallelMesh.from_groups(sizes=sizes, groups=groups, world_group=world_group, device_mesh=device_mesh,
                                        shard_group=shard.get_group(), shard_device_mesh=shard,
                                        replicate_size=parallel.replicate, replicate_group=replicas.get_group(),
                                        state_group=shard_mesh.get_group(), fsdp_mesh=two_d)
    mesh.library_groups = library
    return mesh


def _hsdp_mesh(replicate: int, sizes: dict[str, int], names: tuple[str, ...], layout, device_type: str):
    """(the 2-D (replicate, shard) DeviceMesh of HSDP, its shard and its replicate 1-D meshes), or
    None when replicate is 1: the data axis of `layout` split into replicate (outer) x data /
    replicate (inner), the inner part flattened with context and ulysses into "shard". Collective
    over the default group, like build_mesh."""
    if replicate == 1:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    shape, split_names = [], []
    for name in names:
        if name == DATA:
            shape += [replicate, sizes[DATA] // replicate]
            split_names += ["replicate", "data_shard"]
        else:
            shape.append(sizes[name])
            split_names.append(name)
    mesh = DeviceMesh(device_type, layout.reshape(shape), mesh_dim_names=tuple(split_names))
    inner = ("data_shard",) + tuple(dim for dim in (CONTEXT, ULYSSES) if dim in names)
    shard_name = "data_shard"
    if len(inner) > 1:
        mesh[inner]._flatten("shard")
        shard_name = "shard"
    return mesh[("replicate", shard_name)], mesh[shard_name], mesh["replicate"]


def _library_groups_of(backend: str | None):
    """The backend's BackendSpec.library_groups callable, or None."""
    if backend is None:
        return None
    from .registry import backend_spec, resolve

    spec = backend_spec(backend)
    return None if spec.library_groups is None else resolve(spec.library_groups)
