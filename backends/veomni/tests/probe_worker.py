"""Torchrun worker: the dispatch probe's outcome on the critic's one-layer twin (what the engine runs,
value_model.probe_config) and on the built, sharded critic itself (what it ran before), per case.

  python -m critic_adapters.backends.veomni.tests.probe_worker OUT.pt CASE=MODEL_DIR [CASE=MODEL_DIR ...]
A CASE naming `ulysses` runs at engine.parallel.ulysses=2, `hl_gauss` with an HL-Gauss head, `lora`
with LoRA rank 4, `bad_head` with a transform whose head returns [B, T, 1, 1] (the probe refuses it).
Rank 0 writes {case: {"twin": outcome, "critic": outcome, "twin_parameters", "critic_parameters"}},
an outcome being (output on meta, output shape, check_probe_output's error or None).
"""

import sys

import torch

from critic_adapters.backends.veomni import value_model
from critic_adapters.backends.veomni.engine import reshard
from critic_adapters.backends.veomni.tests.worker_common import quiet
from critic_adapters.common.engine import build_engine
from critic_adapters.common.engine.config import (EngineConfig, HLGaussConfig, LoRAConfig, LossConfig, ModelConfig,
                                                  ParallelConfig)
from critic_adapters.common.engine.fsdp2_core import quiet_fsdp_views
from critic_adapters.common.engine.transforms import ModelTransform, register_transform
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.valuehead.config import critic_head

CHECK = value_model.check_probe_output
BAD_HEAD = "probe_worker_bad_head"


def _bad_head(model: torch.nn.Module) -> None:
    critic_head(model).register_forward_hook(lambda module, args, out: out.unsqueeze(-1))


def engine_config(case: str, model_dir: str) -> EngineConfig:
    hl_gauss = "hl_gauss" in case
    support = HLGaussConfig(num_bins=21, min_value=-3.0, max_value=3.0)
    return EngineConfig(
        model=ModelConfig(path=model_dir, init_from_scalar_head=hl_gauss),
        parallel=ParallelConfig(ulysses=2 if "ulysses" in case else 1),
        loss=LossConfig(kind="hl_gauss", clip_range=None, hl_gauss=support) if hl_gauss else LossConfig(),
        lora=LoRAConfig(rank=4 if "lora" in case else 0),
        transforms=[BAD_HEAD] if "bad_head" in case else [])


def outcome(model, critic_cfg, device, sp_group) -> tuple:
    """What the probe sees and decides: (output on meta, output shape, check_probe_output's error or None)."""
    logits = value_model.probe_output(model, critic_cfg, device, sp_group=sp_group)
    try:
        CHECK(model, critic_cfg, device, sp_group=sp_group)
    except ValueError as err:
        return logits.is_meta, tuple(logits.shape), str(err)
    return logits.is_meta, tuple(logits.shape), None


def run(case: str, model_dir: str, dist) -> dict:
    twins = []

    def record(model, critic_cfg, device, sp_group=None):  # raises nothing: the build goes on to the critic
        twins.append((outcome(model, critic_cfg, device, sp_group), sum(p.numel() for p in model.parameters())))

    value_model.check_probe_output = record  # the engine calls it through the module
    try:
        with quiet():
            engine = build_engine("veomni", engine_config(case, model_dir), dist)
    finally:
        value_model.check_probe_output = CHECK
    with quiet_fsdp_views():  # the probe as the engine ran it before: on the sharded critic
        critic = outcome(engine.model, engine.hf_config, dist.device, engine.sp_group)
    reshard(engine.model)
    critic_parameters = sum(p.numel() for p in engine.model.parameters())  # DTensors: the whole tensor's count
    engine.close()
    (twin, twin_parameters), = twins
    return {"twin": twin, "critic": critic, "twin_parameters": twin_parameters, "critic_parameters": critic_parameters}


def main():
    out_file, *cases = sys.argv[1:]
    register_transform(BAD_HEAD, ModelTransform(apply=_bad_head, doc="the head's output [B, T, 1, 1]"))
    dist = init_distributed()
    results = {}
    for spec in cases:
        case, _, model_dir = spec.partition("=")
        results[case] = run(case, model_dir, dist)
    if dist.is_main:
        torch.save(results, out_file)
    shutdown()


if __name__ == "__main__":
    main()
