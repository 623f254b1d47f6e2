"""RayCriticGroup: a critic engine of any registered backend and parallel layout, one rank per Ray
actor, driven from one driver process (what OpenRLHF, NeMo-RL, slime, ROLL and verl do with their
critics).

  placement group (PACK / SPREAD, one bundle per worker; or bundles of a host's own placement group,
  shared with its actors) -> one CriticWorker actor per bundle ->
  rank 0's address + a free port -> every actor joins torch.distributed there (gloo on CPU, NCCL +
  gloo on GPU: common.parallel.distributed) and builds the engine -> the driver calls the engine API on all
  actors at once.

Rows: every actor reads the whole batch (from the object store: a tensor is put there once, an
object reference from a stack's own actors is passed as it is) and takes its data-parallel share
(balanced by tokens, as the torchrun trainer shares them; TP/PP/SP peers take the same rows). Values are
gathered back in row order from one actor per data-parallel rank; metrics are rank 0's (the engines
reduce them over the data-parallel ranks). A vision-language critic's images (multi_modal_inputs:
one dict of the processor's tensors or None per row, in a RolloutBatch or beside input_ids) go to
the store once too; each actor takes its rows' images with its rows, and a row's image patches count
as tokens in the balance (common.valuehead.multimodal.vision_patches).

The group has the whole engine contract (common.engine.CriticEngine): the step in pieces
(forward_backward on each actor's share, step_optimizer, zero_grad, scheduler) for a host's own
loss, as well as update(); `parallel` is None (the meshes are the actors').

Startup is bounded: within startup_timeout_s the placement group must be ready and every actor
scheduled on its bundle (a bundle whose free part is smaller than resources_per_worker, the rest held
by a host's actors, would keep its actor pending forever); otherwise the actors are killed and the
error names those bundles, what a worker reserves and what is free. The engine build after it (the
model's load) is not bounded.

Faults: every call waits on all actors together. An actor that dies (killed, OOM, node lost) makes
the call raise CriticWorkerError naming it and Ray's reason, after every actor of the group is
killed (the others would wait for it in a collective forever); a new group then loads the last
checkpoint. An error the engine raises (bad input: NaN returns, ids outside the vocabulary,
mismatched shapes) is raised again on the driver with the engine's message; the engines check
before touching the weights, so the group stays usable.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from .worker import CriticWorker

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class CriticWorkerError(RuntimeError):
    """A worker of the group died; the group is stopped."""


class _PastDeadline(Exception):
    """RayCriticGroup._gather: these ranks had not answered by the deadline."""

    def __init__(self, ranks: list[int]):
        super().__init__(ranks)
        self.ranks = ranks


def _resources(resources_per_worker: dict | None, use_gpu: bool) -> dict:
    resources = dict(resources_per_worker or ({"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}))
    if resources.get("CPU", 0) <= 0 and not resources.get("GPU"):
        raise ValueError(f"resources_per_worker={resources_per_worker}: each worker needs a CPU or a GPU")
    return resources


class RayCriticGroup:
    def __init__(self, backend: str, engine_config, num_workers: int | None = None, *,
                 resources_per_worker: dict | None = None, placement_strategy: str = "PACK",
                 placement_group=None, bundle_indices: list[int] | None = None, address: str | None = None,
                 startup_timeout_s: float = 300.0, error_grace_s: float = 60.0):
        """Start `num_workers` actors (default: what engine_config.parallel needs) and build the engine
        on them. Ray must be initialised (ray.init), or `address` names a cluster to join ("auto",
        "host:port"), or a local cluster is started (integrations.ray.cluster.ensure_ray).

        Placement: a placement group of one bundle per worker (`placement_strategy`), made and
        removed by the group; or `placement_group`, a host's own, whose bundles `bundle_indices`
        (default 0..num_workers-1) the workers join, each reserving `resources_per_worker` of its
        bundle (fractional, e.g. {"CPU": 0.5} or {"GPU": 0.5}, beside the host's actors on the same
        bundle). The host's placement group stays the host's: close() leaves it.

        Everything that can be refused is refused before any actor starts: the backend, the layout
        for this worker count, the model and LoRA settings, the bundles.

        `startup_timeout_s` bounds the placement: the placement group's readiness and every worker
        actor being scheduled on its bundle and answering, together. A worker whose bundle has too
        little free (a host's actors hold part of it) would otherwise wait forever; past the bound,
        the actors started are killed and a RuntimeError names the bundles that could not take a
        worker, what a worker reserves and what is free in them. Building the engine (loading the
        model) comes after and is not bounded by it."""
        import ray
        from ray.util.placement_group import placement_group as new_placement_group

        from ...common.engine.registry import check_layout
        from .cluster import check_fits, ensure_ray

        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy={placement_strategy!r}; use one of {', '.join(PLACEMENT_STRATEGIES)}")
        num_workers = num_workers or (len(bundle_indices) if bundle_indices else engine_config.parallel.min_world_size)
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: a group needs at least one worker")
        check_layout(backend, engine_config, num_workers)  # the backend's knobs and degrees first
        resources = _resources(resources_per_worker, use_gpu=torch.cuda.is_available())
        # Paths as the driver means them: an actor's working directory is not the driver's.
        model = dataclasses.replace(engine_config.model, path=_absolute(engine_config.model.path))
        engine_config = dataclasses.replace(engine_config, model=model)
        ensure_ray(address)
        self.backend, self.config, self.num_workers = backend, engine_config, num_workers
        self.error_grace_s = error_grace_s
        self.actors, self._closed, self._lost = [], False, None
        if placement_group is not None:
            self.bundle_indices = _check_bundles(placement_group, bundle_indices, num_workers, resources)
            self.placement_group, self._owns_placement_group = placement_group, False
        else:
            if bundle_indices is not None:
                raise ValueError("bundle_indices names bundles of a host's placement_group; pass placement_group too")
            check_fits(num_workers, resources)
            self.bundle_indices = list(range(num_workers))
            self.placement_group = new_placement_group([dict(resources) for _ in range(num_workers)],
                                                       strategy=placement_strategy)
            self._owns_placement_group = True
        deadline = time.monotonic() + startup_timeout_s  # placement group ready, then every actor scheduled
        try:
            ready, _ = ray.wait([self.placement_group.ready()], timeout=startup_timeout_s)
            if not ready:
                raise RuntimeError(f"Ray could not place {num_workers} critic workers with {resources} each "
                                   f"({placement_strategy}) within {startup_timeout_s:.0f} s; the cluster has "
                                   f"{ray.available_resources()} free. Lower num_workers or resources_per_worker, "
                                   f"or add nodes")
            self._start_actors(resources, deadline, startup_timeout_s)
        except BaseException:
            self._stop()
            raise

    # -- start ---------------------------------------------------------------------------------------
    def _start_actors(self, resources: dict, deadline: float, startup_timeout_s: float) -> None:
        """One actor per bundle; each must be scheduled and answer `where` by `deadline` (a bundle with
        too little free would keep it pending forever), then every actor builds the engine (unbounded:
        loading a model may take long; a worker that dies or raises ends it as any call)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(CriticWorker)
        threads = max(1, int(resources.get("CPU", 1)))
        for rank, bundle in enumerate(self.bundle_indices):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=bundle)
            self.actors.append(remote.options(num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
                                              resources={k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
                                              scheduling_strategy=strategy, max_restarts=0, max_task_retries=0)
                               .remote(rank, self.num_workers, threads))
        try:
            places = self._gather([actor.where.remote() for actor in self.actors], "startup", deadline=deadline)
        except _PastDeadline as late:
            raise RuntimeError(self._unscheduled(late.ranks, resources, startup_timeout_s)) from None
        self.pids = [place["pid"] for place in places]
        self.node_ids = [place["node_id"] for place in places]  # each worker's Ray node
        self.hosts = [place["host"] for place in places]  # its address (rank 0's is the rendezvous)
        master = places[0]
        self._info = self._gather([actor.build.remote(self.backend, self.config, master["host"], master["port"])
                                   for actor in self.actors], "build")
        self.load_report = self._info[0]["load_report"]
        self._counts = self._info[0]["counts"]

    # -- calls on every actor ------------------------------------------------------------------------
    def _call_all(self, method: str, *args):
        self._check_open()
        return self._gather([getattr(actor, method).remote(*args) for actor in self.actors], method)

    def _describe(self, rank: int) -> str:
        pid = self.pids[rank] if getattr(self, "pids", None) else "?"
        return f"critic worker {rank} of {self.num_workers} (actor {self.actors[rank]._actor_id.hex()[:12]}, pid {pid})"

    def _gather(self, refs: list, what: str, *, deadline: float | None = None) -> list:
        """Every actor's result, in rank order; see the module docstring for how failures end.
        `deadline` (time.monotonic()): _PastDeadline naming the ranks that have not answered by then."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results, errors, pending = {}, {}, list(refs)
        grace_end = None
        while pending:
            ends = [end for end in (grace_end, deadline) if end is not None]
            timeout = max(0.0, min(ends) - time.monotonic()) if ends else None
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready and not errors:  # past `deadline`
                raise _PastDeadline(sorted(rank_of[ref] for ref in pending))
            if not ready:  # an engine error on some workers, and the others still inside a collective
                first = min(errors)
                self._stop()
                self._lost = (f"{self._describe(first)} failed in {what}: {errors[first]}; workers "
                              f"{sorted(rank_of[r] for r in pending)} were still running {self.error_grace_s:.0f} s "
                              f"later (waiting for it in a collective), so the group is stopped")
                raise CriticWorkerError(f"{self._lost}. Start a new group and load_checkpoint to continue") \
                    from errors[first]
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except RayActorError as err:
                    self._stop()
                    self._lost = (f"{self._describe(rank)} died during {what}: {_reason(err)}. The group is "
                                  f"stopped (all its workers killed)")
                    raise CriticWorkerError(f"{self._lost}; start a new group and load_checkpoint to continue") \
                        from None
                except RayTaskError as err:
                    errors[rank] = err.cause if err.cause is not None else err
                    if grace_end is None:
                        grace_end = time.monotonic() + self.error_grace_s
        if errors:  # every worker returned: the engines refused together, the group is usable
            raise errors[min(errors)]
        return [results[rank] for rank in range(len(refs))]

    def _unscheduled(self, ranks: list[int], resources: dict, startup_timeout_s: float) -> str:
        """The startup error: which bundles did not take their worker, what one reserves, what is free."""
        import ray

        free = ray.available_resources()  # a bundle's own amounts are keys "<resource>_group_<index>_<pg id>"
        pg_id = self.placement_group.id.hex()
        specs = self.placement_group.bundle_specs
        bundles = sorted({self.bundle_indices[rank] for rank in ranks})
        in_bundles = "; ".join(
            f"bundle {index}: {({name: free.get(f'{name}_group_{index}_{pg_id}', 0.0) for name in specs[index]})} "
            f"of {specs[index]}" for index in bundles)
        outside = {name: free.get(name, 0.0) for name in resources}
        owner = "the host's placement group" if not self._owns_placement_group else "the group's placement group"
        workers = ", ".join(str(rank) for rank in ranks)
        return (f"critic worker(s) {workers} of {self.num_workers} not scheduled within {startup_timeout_s:.0f} s: "
                f"bundle(s) {', '.join(str(i) for i in bundles)} of {owner} could not take a worker reserving "
                f"{resources}. Free now in those bundles: {in_bundles}; free in the cluster outside placement "
                f"groups: {outside}. Other actors on a bundle (the host's) hold the rest: lower resources_per_worker "
                f"to what is free (fractions such as {{'CPU': 0.5}} share a bundle), free the bundles, or, if the "
                f"workers are only slow to start, raise startup_timeout_s")

    def lost(self) -> str | None:
        """Why the group cannot answer any more (a worker died, or failed while the others waited for it
        in a collective: the group was stopped), or None."""
        return self._lost

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this RayCriticGroup is closed (or was stopped by a worker failure); start a new one")

    # -- the engine API, on the driver ---------------------------------------------------------------
    # The trainer's view: the group is one data-parallel rank holding every row.
    dp_rank, dp_size, dp_group = 0, 1, None

    @property
    def data_parallel_ranks(self) -> int:
        """The engines' data-parallel size (the workers over tensor x pipeline x ... peers)."""
        return self._info[0]["dp_size"]

    parallel = None  # the engines' meshes live in the actors (common.engine.CriticEngine.parallel)

    def compute_values(self, input_ids, attention_mask, multi_modal_inputs=None, *,
                       return_version: bool = False) -> torch.Tensor:
        """float32 [B, T] values of every row, in row order (tensors or Ray object references);
        multi_modal_inputs: a vision critic's images, one dict or None per row (or a reference to
        them), each actor's share taking its rows' images; return_version=True: (values, the
        engines' version that computed them)."""
        input_ids, attention_mask = _by_reference(input_ids), _by_reference(attention_mask)
        images = None if multi_modal_inputs is None else _by_reference(multi_modal_inputs)
        values = self._in_row_order(self._call_all("compute_values", input_ids, attention_mask, images))
        return (values, self.version) if return_version else values

    @property
    def version(self) -> int:
        """Optimizer steps the engines have taken (the same on every actor)."""
        return self._call_all("version")[0]

    def _in_row_order(self, shares: list) -> torch.Tensor:
        """The values of every row from the actors' (row indices, values, ...) shares: one actor per
        data-parallel rank (its tensor / pipeline / sequence peers hold the same rows)."""
        by_dp = {}
        for info, share in zip(self._info, shares):
            by_dp.setdefault(info["dp_rank"], share[:2])
        rows = sum(len(index) for index, _ in by_dp.values())
        width = next(values.shape[1] for _, values in by_dp.values())
        out = torch.zeros(rows, width, dtype=torch.float32)
        for index, values in by_dp.values():
            out[index] = values
        return out

    # -- the step in pieces (common.engine.CriticEngine), for a host that drives its own loss ------
    def forward_backward(self, input_ids, attention_mask, loss_fn=None, multi_modal_inputs=None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The engines' forward_backward, each actor on its data-parallel share (balanced by tokens
        of these rows, as compute_values; multi_modal_inputs as compute_values'): `loss_fn` (pickled
        to the actors) is called on every actor with the values of its share and, as on any engine,
        the gradients are averaged over the data-parallel ranks, so a loss normalised over all the
        rows carries a factor data_parallel_ranks. Returns (the values of every row in row order,
        data-parallel rank 0's loss or None)."""
        input_ids, attention_mask = _by_reference(input_ids), _by_reference(attention_mask)
        images = None if multi_modal_inputs is None else _by_reference(multi_modal_inputs)
        shares = self._call_all("forward_backward", input_ids, attention_mask, loss_fn, images)
        return self._in_row_order(shares), shares[0][2]

    def step_optimizer(self) -> float:
        """Clip and step every engine on the accumulated gradients; the global gradient norm."""
        return self._call_all("step_optimizer")[0]

    # -- offload between phases (common.engine.offload), every actor's engine together -----------
    def offload(self, model: bool = True, optimizer: bool = True, grads: bool = True) -> None:
        """Every engine's offload: these parts' device storages freed, held in each actor's host memory."""
        self._call_all("offload", model, optimizer, grads)

    def onload(self, model: bool = True, optimizer: bool = True, grads: bool = True) -> None:
        """Every engine's onload: these offloaded parts (all by default) back, in place."""
        self._call_all("onload", model, optimizer, grads)

    @property
    def offloaded(self) -> frozenset:
        """What the engines hold off their devices (the same on every actor)."""
        return self._call_all("offloaded")[0]

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of each part on the actors' devices now, all actors together."""
        per_actor = self._call_all("resident_bytes")
        return {kind: sum(share[kind] for share in per_actor) for kind in per_actor[0]}

    def zero_grad(self) -> None:
        self._call_all("zero_grad")

    @property
    def scheduler(self) -> "_GroupScheduler":
        """The engines' LR schedule: step() steps it on every actor (update() does so itself)."""
        return _GroupScheduler(self)

    def update(self, batch) -> dict[str, float]:
        """One optimizer step over the whole mini-batch (a RolloutBatch or an object reference to one;
        a vision critic's images in its multi_modal_inputs go with their rows to the actors);
        the metrics of common.engine.update_step.METRICS, reduced over the data-parallel ranks."""
        return self._call_all("update", _by_reference(batch))[0]

    def checkpoint_bytes(self) -> int:
        return self._call_all("checkpoint_bytes")[0]

    def save_checkpoint(self, directory: str, extra_state: dict | None = None,
                        extra_tensors: dict | None = None) -> None:
        """The engine's checkpoint (every worker writes its part; the directory must be one every worker
        sees), with this process's extra tensors (sent to the actors once, by reference)."""
        from ...common.storage.checkpoints import check_extra

        check_extra(extra_state, extra_tensors)
        self._call_all("save_checkpoint", _absolute(directory), extra_state or {},
                       _by_reference(extra_tensors) if extra_tensors else None)

    def load_checkpoint(self, directory: str) -> dict:
        return self._call_all("load_checkpoint", _absolute(directory))[0]

    def export_hf(self, directory: str, *, max_shard_size: int | str = "5GB") -> None:
        self._call_all("export_hf", _absolute(directory), max_shard_size)

    def export_adapter(self, directory: str) -> None:
        self._call_all("export_adapter", _absolute(directory))

    def parameter_counts(self) -> tuple[int, int]:
        return self._counts

    def close(self) -> None:
        """Close every engine, then end the actors and the placement group; idempotent."""
        if self._closed:
            return
        try:
            self._call_all("close")
        finally:
            self._stop()

    def _stop(self) -> None:
        """Kill every actor and remove the placement group (no collective: used after a failure too)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self._closed = True
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if getattr(self, "placement_group", None) is not None and getattr(self, "_owns_placement_group", False):
            try:
                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001 - already removed
                pass
        self.placement_group = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _GroupScheduler:
    """A RayCriticGroup's LR schedule as the contract's scheduler: step() and get_last_lr()."""

    def __init__(self, group: RayCriticGroup):
        self._group = group

    def step(self) -> None:
        self._group._call_all("step_scheduler")

    def get_last_lr(self) -> list[float]:
        return self._group._call_all("last_lr")[0]


def _check_bundles(placement_group, bundle_indices, num_workers: int, resources: dict) -> list[int]:
    """The bundles of a host's placement group the workers join: one per worker, each holding at
    least what a worker reserves; ValueError naming the bundle and the fix otherwise."""
    bundles = placement_group.bundle_specs
    indices = list(range(num_workers)) if bundle_indices is None else [int(i) for i in bundle_indices]
    if len(indices) != num_workers:
        raise ValueError(f"bundle_indices={indices} names {len(indices)} bundles for {num_workers} workers: one each")
    for index in indices:
        if not 0 <= index < len(bundles):
            raise ValueError(f"bundle_indices names bundle {index}; the placement group has bundles 0..{len(bundles) - 1}")
        short = {name: amount for name, amount in resources.items() if amount > bundles[index].get(name, 0)}
        if short:
            raise ValueError(f"bundle {index} of the placement group holds {bundles[index]}, a critic worker reserves "
                             f"{resources}: lower resources_per_worker (fractions such as {{'CPU': 0.5}} share a bundle) "
                             f"or give the critic bigger bundles")
    return indices


def _reason(err) -> str:
    text = str(err).strip().splitlines()
    return " ".join(line.strip() for line in text[:3]) if text else type(err).__name__


def _absolute(path: str) -> str:
    return path if path.startswith("embedded:") else os.path.abspath(path)


def _by_reference(obj):
    """An object reference as it is (the stack's own, read by every actor from the object store), or
    `obj` put there once."""
    import ray

    return obj if isinstance(obj, ray.ObjectRef) else ray.put(obj)
