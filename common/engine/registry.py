"""The backend registry: one BackendSpec per backend says how to build its engine and what it can do.

Everything that asks "which backends are there, and what does this one support" reads the specs:
the launcher (the checks, the backend's default job settings), the trainer, error hints, the
long-context benchmark's backend list and the conformance suite (tests/conformance). A host stack adds its own backend with
`register_backend(name, spec)` without editing this package.

Importing this module imports no backend: factories are "module:callable" strings, imported only
when that backend is built (a module name with a leading dot is relative to this package's root,
so a vendored copy builds its own backends).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from .config import EngineConfig, ModelConfig, ParallelConfig, resolve_mixed_precision

# The package this tree is imported as: critic_adapters, or wherever a stack vendored it.
PACKAGE_ROOT = __package__.removesuffix("common.engine").removesuffix(".")

# Model-parallel dimensions a backend may implement (engine.parallel.<name>).
PARALLEL_DIMS = ("tensor", "pipeline", "sequence_parallel", "context", "ulysses", "replicate", "expert")
# Engine settings only some backends honour (dotted under engine.), with their neutral values: one
# set away from it on a backend that ignores it is an error, never silently dropped.
OPTIONAL_KNOBS: dict[str, object] = {
    "mixed_precision": "none",  # "auto" resolves to none on a backend that does not honour it
    "gradient_checkpointing": False,
    "cpu_offload": False,
    "model.attn_implementation": None,
    "transforms": [],
    "lora.rank": 0,
    "optim.distributed_optimizer": True,  # fsdp / veomni shard the optimizer always (FSDP2)
    "optim.name": "adamw",
    "optim.state_dtype": "float32",
    "optim.offload_state": False,
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BackendSpec:
    factory: str | Callable
    """"module:callable" (module relative to the package root when it starts with a dot) or the
    callable itself; factory(config, dist) -> CriticEngine."""
    parallel_dims: frozenset[str] = frozenset()
    """The model-parallel dimensions of PARALLEL_DIMS it implements (data parallel: always)."""
    knobs: frozenset[str] = frozenset()
    """The OPTIONAL_KNOBS it honours."""
    launcher: str | None = None
    """Its launcher alias module ("python -m <package><launcher>", the one launcher with the
    backend fixed; common/job/launcher.py), or None when it has none."""
    job_defaults: tuple[str, ...] = ()
    """key=value settings layered on the embedded default job (common/job/default_job.yaml) for this
    backend, below the user's YAML files and overrides."""
    check_layout: str | Callable | None = None
    """"module:callable" (as factory) or the callable: check_layout(critic_config, engine_config,
    world_size) raises a ValueError for what the backend refuses to build from the config alone: a
    layout the model or the process count cannot take (heads a tensor degree does not divide, ...),
    a family it has no modeling for, a setting it cannot combine with the layout. The launcher, the
    dry run and the trainer call it before any process starts or anything is written, and the
    engine should call the same function when it is built (one list of refusals); critic_config is
    the checkpoint's critic config (common.valuehead.critic_config: TokenClassification)."""
    library_groups: str | Callable | None = None
    """"module:callable" (as factory) or the callable, for a backend whose library keeps process
    groups of its own beyond the mesh's dimensions (megatron-core's parallel_state):
    library_groups(layout, parallel) -> {name: (rank lists, process-group backend or None for the
    default)}, where layout is the engine's global ranks laid out over common.engine.mesh.DIMS (a
    torch tensor, one axis per dimension, degree-1 axes included) and parallel engine.parallel. build_mesh(..., backend=name) makes
    them with the mesh (collectively, so a host's sub-world works too); ParallelMesh.library_groups
    holds this rank's group of each name."""
    families: str | tuple[str, ...] | None = None
    """The model_types it builds, as a tuple or "module:attribute" of one (a module that imports no
    heavy library); None: not declared (whatever its library builds). Refusals name the backends
    that take a family (backends_for_family)."""
    unsupported: tuple[tuple[str, str], ...] = ()
    """(a PARALLEL_DIMS name or an OPTIONAL_KNOBS key it does not implement, why): said with
    check_engine_config's refusal."""
    requires: tuple[str, ...] = ()
    """Requirements ("megatron-core>=0.16.1,<0.20") of the library it runs on, checked against the
    installed distributions before anything is built (check_installed)."""
    install: str = ""
    """The command that installs what `requires` names, said when it is missing."""
    state_memory: str | Callable | None = None
    """"module:callable" (as factory) or the callable: state_memory(engine_config, critic_config,
    world_size, rank) -> (parameters, gradients, optimizer) bytes of global `rank` as the engine's
    resident_bytes() reports them after a step, from the config alone (rank None: the rank holding
    the most). The job plan's `memory per rank:` line (common.engine.memory); None: not computed."""
    activation_memory: str | Callable | None = None
    """"module:callable" (as factory) or the callable: activation_memory(engine_config, model, tokens,
    checkpointing) -> the bytes one rank's micro-batch of `tokens` tokens saves for its backward (None: not
    estimated), `model` the HF critic on the meta device in the compute dtype; None: the HF critic's own
    count (common.engine.memory.activation_bytes), right for backends that run transformers' modeling."""

    def __post_init__(self):
        unknown = sorted(set(self.parallel_dims) - set(PARALLEL_DIMS)) + sorted(set(self.knobs) - set(OPTIONAL_KNOBS))
        if unknown:
            raise ValueError(f"BackendSpec names {unknown}; parallel_dims come from {PARALLEL_DIMS}, knobs from "
                             f"{tuple(OPTIONAL_KNOBS)}")

    @property
    def launcher_module(self) -> str | None:
        if self.launcher is None:
            return None
        return f"{PACKAGE_ROOT}{self.launcher}" if self.launcher.startswith(".") else self.launcher


BACKENDS: dict[str, BackendSpec] = {
    "fsdp": BackendSpec(
        factory=".backends.fsdp.engine:FSDPCriticEngine",
        parallel_dims=frozenset({"ulysses", "replicate"}),
        knobs=frozenset({"mixed_precision", "gradient_checkpointing", "cpu_offload", "model.attn_implementation",
                         "transforms", "lora.rank", "optim.name", "optim.state_dtype", "optim.offload_state"}),
        launcher=".backends.fsdp.train",
        check_layout=".common.parallel.ulysses:check_layout",
        state_memory=".common.engine.memory:fsdp2_state_memory",
    ),
    "megatron": BackendSpec(
        factory=".backends.megatron.engine:MegatronCriticEngine",
        parallel_dims=frozenset({"tensor", "pipeline", "sequence_parallel", "context", "expert"}),
        knobs=frozenset({"mixed_precision", "gradient_checkpointing", "transforms", "lora.rank",
                         "optim.distributed_optimizer", "optim.offload_state"}),
        unsupported=(("optim.name", "megatron-core 0.16's Muon (megatron.core.optimizer.muon) needs NVIDIA's "
                      "emerging_optimizers package, which is not on PyPI (only a 999.9.9 placeholder)"),
                     ("optim.state_dtype", "megatron-core's precision-aware optimizer (exp_avg_dtype) runs "
                      "TransformerEngine's FusedAdam, which needs CUDA and is not installed")),
        launcher=".backends.megatron.train",
        requires=("megatron-core>=0.16.1,!=0.17.*,!=0.18.*,<0.20",),
        install="pip install 'critic-adapters[megatron]' (megatron-core 0.16 on Python <= 3.11, 0.19 on 3.12+)",
        library_groups=".backends.megatron.mesh_groups:megatron_groups",
        families=".backends.megatron.config:SUPPORTED_FAMILIES",
        # The two processes of the default job split every layer (a data-parallel degree of 1).
        job_defaults=("engine.parallel.tensor=2", "trainer.run_dir=outputs/megatron-default"),
        check_layout=".backends.megatron.config:check_layout",
        state_memory=".backends.megatron.memory:state_memory",
        activation_memory=".backends.megatron.memory:activation_memory",
    ),
    "veomni": BackendSpec(
        factory=".backends.veomni.engine:VeOmniCriticEngine",
        parallel_dims=frozenset({"ulysses", "replicate"}),
        knobs=frozenset({"mixed_precision", "gradient_checkpointing", "cpu_offload", "model.attn_implementation",
                         "transforms", "lora.rank", "optim.name", "optim.state_dtype", "optim.offload_state"}),
        launcher=".backends.veomni.train",
        # 0.1.10 and 0.1.11 silently build a causal LM for a critic; 0.1.12 breaks on transformers >= 5.23.
        requires=("veomni==0.1.12", "transformers<5.23"),
        install="pip install 'critic-adapters[veomni]' && pip install --no-deps 'veomni==0.1.12' (--no-deps: "
                "veomni's timm pulls torchvision, which replaces your torch)",
        job_defaults=("trainer.run_dir=outputs/veomni-default",),
        families=".backends.veomni.value_model:VEOMNI_FAMILIES",
        unsupported=(("expert", "VeOmni 0.1.12 builds the token-classification critic on transformers' own MoE "
                      "backbone, whose eager experts loop has no token dispatch (IndexError on a rank's local "
                      "experts), and its one dispatching path, group_gemm_fused_moe_forward, needs triton on a GPU"),),
        check_layout=".backends.veomni.value_model:check_layout",
        state_memory=".common.engine.memory:fsdp2_state_memory",
    ),
}


def register_backend(name: str, spec: BackendSpec, *, replace: bool = False) -> None:
    """Add a backend (a host stack's own engine) under `name`; an existing name needs replace=True."""
    if not isinstance(spec, BackendSpec):
        raise TypeError(f"register_backend({name!r}, ...) needs a BackendSpec, got {type(spec).__name__}")
    if name in BACKENDS and not replace:
        raise ValueError(f"backend {name!r} is already registered; pass replace=True to replace it")
    BACKENDS[name] = spec


def unregister_backend(name: str) -> None:
    BACKENDS.pop(name, None)


def backend_spec(name: str) -> BackendSpec:
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not registered; available: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]


def backends_with(*, dim: str | None = None, knob: str | None = None) -> list[str]:
    """Registered backends implementing a parallel dimension or honouring a knob, sorted."""
    return sorted(name for name, spec in BACKENDS.items()
                  if (dim is None or dim in spec.parallel_dims) and (knob is None or knob in spec.knobs))


def _set_dims(parallel: ParallelConfig) -> dict[str, object]:
    values = {name: getattr(parallel, name) for name in PARALLEL_DIMS}
    return {name: value for name, value in values.items() if value not in (1, False)}


def _knob_value(engine: EngineConfig, knob: str):
    obj = engine
    for part in knob.split("."):
        obj = getattr(obj, part)
    return obj


def check_installed(name: str) -> None:
    """ImportError naming each library `name` runs on that is missing or outside its supported
    versions, with the backend's install command; before anything is imported from it."""
    import importlib.metadata

    from packaging.requirements import Requirement

    spec = backend_spec(name)
    problems = []
    for text in spec.requires:
        requirement = Requirement(text)
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{requirement.name} is not installed")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement.name} {version} is installed; it needs {requirement}")
    if problems:
        raise ImportError(f"the {name} backend cannot run here: {'; '.join(problems)}. Install: {spec.install}")


def check_engine_config(name: str, engine: EngineConfig) -> None:
    """ValueError naming every parallel degree `name` does not implement and every knob it would
    ignore, with the registered backends that do; before any process group or model exists. Settings
    only: whether the backend's library is installed is check_installed's (a setting is refused the
    same with or without it)."""
    spec = backend_spec(name)
    problems, knob_problems = [], []
    for dim, value in _set_dims(engine.parallel).items():
        if dim not in spec.parallel_dims:
            others = backends_with(dim=dim)
            where = f"backend={' or backend='.join(others)}" if others else "no registered backend"
            why = dict(spec.unsupported).get(dim)
            problems.append(f"engine.parallel.{dim}={str(value).lower()} (offered by {where}"
                            + (f"; {name}: {why})" if why else ")"))
    for knob, neutral in OPTIONAL_KNOBS.items():
        value = _knob_value(engine, knob)
        if value != neutral and knob not in spec.knobs and not (knob == "mixed_precision" and value == "auto"):
            others = backends_with(knob=knob)
            where = f"backend={' or backend='.join(others)}" if others else "no registered backend"
            why = dict(spec.unsupported).get(knob)
            knob_problems.append(f"engine.{knob}={value} (honoured by {where}" + (f"; {name}: {why})" if why else ")"))
    if engine.transforms and "transforms" in spec.knobs:
        from .transforms import check_transforms

        check_transforms(engine.transforms)
    if problems or knob_problems:
        # What it offers, of the kind asked about: its parallel dimensions for a layout, its knobs for a setting.
        offers = []
        if problems:
            offers.append("data parallel and " + ", ".join(f"engine.parallel.{dim}" for dim in sorted(spec.parallel_dims))
                          if spec.parallel_dims else "data parallel only")
        if knob_problems:
            offers.append(", ".join(f"engine.{knob}" for knob in sorted(spec.knobs)) if spec.knobs else "no optional setting")
        every = problems + knob_problems
        keys = "the key" if len(every) == 1 else "those keys"
        raise ValueError(f"the {name} backend does not implement {'; '.join(every)}; it offers {'; and '.join(offers)}: "
                         f"unset {keys}, or choose a backend that offers {'it' if len(every) == 1 else 'them'}")


def backends_for_family(model_type: str, *, besides: str | None = None) -> list[str]:
    """Registered backends that declare `model_type` among their families, or declare none (fsdp:
    any family transformers builds), other than `besides` and those whose families module this
    build lacks; sorted."""
    def takes(spec: BackendSpec) -> bool:
        families = spec.families
        if isinstance(families, str):
            try:
                families = resolve(families)
            except ImportError:  # the backend is not part of this build (a Bazel target, a vendored subset)
                return False
        return families is None or model_type in families

    return sorted(name for name, spec in BACKENDS.items() if name != besides and takes(spec))


def resolve(target: str | Callable) -> Callable:
    """A "module:callable" string (module relative to the package root when it starts with a dot) -> the callable."""
    if not isinstance(target, str):
        return target
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name, package=PACKAGE_ROOT or None), attr)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelRead:
    """What a job needs of engine.model.path before anything is built, read once (config.json and
    tensor headers): the critic config, and load_critic's plan (None for `embedded:<family>`, a
    fresh random model)."""

    critic_config: object
    plan: object | None


def read_model(engine: EngineConfig) -> ModelRead:
    """engine.model.path's critic config and load plan, with the head engine.loss asks for."""
    model = engine.model
    if model.path.startswith("embedded:"):
        from ..testdata import tiny_config
        from ..valuehead.config import critic_config

        return ModelRead(critic_config(tiny_config(model.path.removeprefix("embedded:")), value_head=engine.loss.support),
                         None)
    from ..valuehead.load import plan_load

    plan = plan_load(model.path, head_prefix=model.head_prefix, trust_remote_code=model.trust_remote_code,
                     value_head=engine.loss.support)
    return ModelRead(plan.config, plan)


def model_critic_config(model: ModelConfig):
    """The critic config (TokenClassification, num_labels=1) of engine.model.path (`embedded:<family>`
    included), from config.json and tensor headers only."""
    return read_model(EngineConfig(model=model)).critic_config


def check_value_head(engine: EngineConfig, model: ModelRead) -> None:
    """The checkpoint's head can become the head engine.loss asks for (an HL-Gauss head is not
    trained as a scalar one, ...): CriticLoadError (a ValueError) otherwise, as load_critic would
    refuse it once the engine is built."""
    if model.plan is None:  # a fresh random model: no head to keep
        return
    from ..valuehead.load import check_head_change

    check_head_change(engine.model.path, model.plan, engine.model.fresh_head, engine.model.init_from_scalar_head)


def check_layout(name: str, engine: EngineConfig, world_size: int, model: ModelRead | None = None) -> ModelRead:
    """Everything `name` refuses for this config before anything is built: the parallel degrees and
    knobs it implements (check_engine_config), its library installed (check_installed), the world split into engine.parallel's groups
    (replicas included), the checkpoint's head against engine.loss (check_value_head), engine.lora
    against the model (common.engine.lora.check_lora), and the backend's own check_layout hook.
    `model`: read_model(engine) when the caller has it (else it is read here). Returns it.
    Reads config.json (and an adapter's headers), builds nothing but a meta-device copy."""
    check_engine_config(name, engine)
    check_installed(name)
    engine.parallel.data_parallel_size(world_size)
    spec = backend_spec(name)
    model = model or read_model(engine)
    check_value_head(engine, model)
    if engine.lora.rank:  # what the family lacks first, then what the backend cannot do
        from .lora import check_lora

        check_lora(model.critic_config, engine.lora)
    if spec.check_layout is not None:
        resolve(spec.check_layout)(model.critic_config, engine, world_size)
    return model


def build_engine(backend: str, config: EngineConfig, dist, **kwargs):
    """The engine of a registered backend: `factory(config, dist, **kwargs)`, a CriticEngine
    (common/engine/__init__.py has the contract).

    config: the EngineConfig (common/engine/config.py; every field has a default).
    dist: this process's DistContext, from common.parallel.distributed.init_distributed() (it joins the
      torchrun group, or makes a world of one), called once per process before any engine is built.
    engine.mixed_precision=auto is resolved for dist's device first (bf16 on CUDA where the backend
    honours it, else none). Refuses parallel degrees and knobs the backend does not implement
    (check_engine_config) before anything is built. Close the engine (engine.close()) before common.parallel.distributed.shutdown().
    """
    config = resolved_for(backend, config, dist.device.type)
    check_engine_config(backend, config)
    check_installed(backend)
    return resolve(backend_spec(backend).factory)(config, dist, **kwargs)


def resolved_for(backend: str, config: EngineConfig, device_type: str) -> EngineConfig:
    """`config` with engine.mixed_precision=auto resolved for `backend`'s ranks computing on
    `device_type`: bf16 on CUDA where the backend honours the knob, else none (build_engine, the job)."""
    honoured = "mixed_precision" in backend_spec(backend).knobs
    return resolve_mixed_precision(config, device_type, honoured=honoured)
