"""Backend specs: what a backend implements is declared once, in its registry entry, and every
check and hint reads it; a host stack registers its own backend without editing the package."""

import dataclasses

import pytest
import torch

from critic_adapters.common.engine.config import (EngineConfig, ModelConfig, OptimConfig, ParallelConfig,
                                                  resolve_mixed_precision)
from critic_adapters.common.parallel.distributed import init_distributed
from critic_adapters.common.engine.registry import (
    BACKENDS,
    BackendSpec,
    backend_spec,
    backends_for_family,
    build_engine,
    check_engine_config,
    register_backend,
    unregister_backend,
)
from critic_adapters.common.tests.helpers import run_pytest


class ToyEngine:
    """A host's own engine: only what building needs."""

    def __init__(self, config, dist, mesh=None):
        self.config, self.dist, self.mesh = config, dist, mesh


@pytest.fixture
def toy():
    register_backend("toy", BackendSpec(factory=f"{__name__}:ToyEngine", parallel_dims=frozenset({"tensor"}),
                                        knobs=frozenset({"cpu_offload"})))
    yield "toy"
    unregister_backend("toy")


def test_a_backend_registered_from_outside_is_built_and_checked_by_its_spec(toy):
    config = EngineConfig(model=ModelConfig(path="unused"), parallel=ParallelConfig(tensor=2), cpu_offload=True)
    engine = build_engine(toy, config, init_distributed())
    # engine.mixed_precision=auto resolved (none: the toy does not honour it), nothing else changed
    assert isinstance(engine, ToyEngine) and engine.config == dataclasses.replace(config, mixed_precision="none")
    with pytest.raises(ValueError, match=r"engine\.parallel\.tensor=2 \(offered by backend=megatron or backend=toy\)"):
        check_engine_config("fsdp", config)


def test_mixed_precision_defaults_to_bf16_on_cuda_and_fp32_on_cpu_on_every_backend_that_honours_it(toy):
    """issue 49: engine.mixed_precision=auto (the default) is bf16 where the ranks compute on CUDA, as every
    stack trains critics on GPUs, and none on CPU; an explicit value stays; a backend without the knob
    (the toy) gets none, so the default is never refused."""
    class Dist:
        def __init__(self, device):
            self.device = torch.device(device)

    assert EngineConfig().mixed_precision == "auto"
    for backend in ("fsdp", "megatron", "veomni"):
        assert "mixed_precision" in backend_spec(backend).knobs
    for device, expected in (("cuda", "bf16"), ("cpu", "none")):
        assert resolve_mixed_precision(EngineConfig(), device).mixed_precision == expected
        assert build_engine(toy, EngineConfig(), Dist(device)).config.mixed_precision == "none"
    register_backend("toy_bf16", BackendSpec(factory=f"{__name__}:ToyEngine", knobs=frozenset({"mixed_precision"})))
    try:
        assert build_engine("toy_bf16", EngineConfig(), Dist("cuda")).config.mixed_precision == "bf16"
        assert build_engine("toy_bf16", EngineConfig(), Dist("cpu")).config.mixed_precision == "none"
        assert build_engine("toy_bf16", EngineConfig(mixed_precision="none"), Dist("cuda")).config.mixed_precision == "none"
        assert build_engine("toy_bf16", EngineConfig(mixed_precision="bf16"), Dist("cpu")).config.mixed_precision == "bf16"
    finally:
        unregister_backend("toy_bf16")
    check_engine_config(toy, EngineConfig())  # auto is never a knob the toy ignores


def test_knobs_a_backend_ignores_are_errors_naming_the_backends_that_honour_them():
    with pytest.raises(ValueError, match=r"megatron backend does not implement engine\.cpu_offload=True "
                                         r"\(honoured by backend=fsdp or backend=veomni\)"):
        check_engine_config("megatron", EngineConfig(cpu_offload=True))
    with pytest.raises(ValueError, match=r"engine\.model\.attn_implementation=eager"):
        check_engine_config("megatron", EngineConfig(model=ModelConfig(attn_implementation="eager")))
    check_engine_config("fsdp", EngineConfig(cpu_offload=True, transforms=["freeze_backbone"]))
    check_engine_config("megatron", EngineConfig(transforms=["freeze_backbone"]))  # freezing works there too


def test_a_refused_setting_is_answered_with_the_settings_the_backend_honours_not_its_layouts():
    """issue 49: an optimizer key refused by megatron listed its parallel dimensions, not the question asked."""
    with pytest.raises(ValueError) as refused:
        check_engine_config("megatron", EngineConfig(optim=OptimConfig(name="muon")))
    message = str(refused.value)
    assert "engine.optim.name=muon (honoured by backend=fsdp or backend=veomni" in message
    assert "it offers engine.gradient_checkpointing, engine.lora.rank" in message and "engine.parallel" not in message
    with pytest.raises(ValueError, match=r"it offers data parallel and engine.parallel.replicate, engine.parallel.ulysses; "
                                         r"and engine.cpu_offload, .*: unset those keys"):
        check_engine_config("fsdp", EngineConfig(parallel=ParallelConfig(tensor=2),
                                                 optim=OptimConfig(distributed_optimizer=False)))


def test_the_replicated_optimizer_is_a_megatron_knob_the_fsdp2_backends_refuse_by_name():
    """engine.optim.distributed_optimizer defaults to true, which every backend accepts (fsdp and
    veomni shard the optimizer with FSDP2); false is megatron's plain optimizer only."""
    plain = EngineConfig(optim=OptimConfig(distributed_optimizer=False))
    for backend in ("fsdp", "veomni"):
        with pytest.raises(ValueError, match=rf"{backend} backend does not implement "
                                             r"engine\.optim\.distributed_optimizer=False \(honoured by backend=megatron\)"):
            check_engine_config(backend, plain)
        check_engine_config(backend, EngineConfig())
    check_engine_config("megatron", plain)
    assert EngineConfig().optim.distributed_optimizer is True


def test_the_backends_for_a_family_are_those_that_declare_it_or_declare_none():
    """A refusal names them; a backend whose families module this build lacks (a Bazel target
    without it) is left out rather than failing the refusal."""
    register_backend("lacking", BackendSpec(factory=f"{__name__}:ToyEngine", families="no_such_module:FAMILIES"))
    register_backend("picky", BackendSpec(factory=f"{__name__}:ToyEngine", families=("qwen3_moe",)))
    try:
        assert "picky" in backends_for_family("qwen3_moe") and "picky" not in backends_for_family("mixtral")
        assert "lacking" not in backends_for_family("qwen3_moe")
        assert "fsdp" in backends_for_family("mixtral")  # declares none: any family transformers builds
        assert "fsdp" not in backends_for_family("mixtral", besides="fsdp")
    finally:
        unregister_backend("lacking")
        unregister_backend("picky")


def test_unknown_backends_transforms_and_spec_fields_are_refused_by_name(toy):
    with pytest.raises(ValueError, match="backend='nope' is not registered; available: fsdp, megatron, toy, veomni"):
        backend_spec("nope")
    with pytest.raises(ValueError, match=r"engine\.transforms names \['lora9'\], which are not registered"):
        check_engine_config("fsdp", EngineConfig(transforms=["lora9"]))
    with pytest.raises(ValueError, match="BackendSpec names \\['warp'\\]"):
        BackendSpec(factory="x:y", parallel_dims=frozenset({"warp"}))
    with pytest.raises(ValueError, match="already registered"):
        register_backend("toy", BACKENDS["toy"])


if __name__ == "__main__":
    run_pytest(__file__)
