"""Torchrun worker: build the VeOmni engine with VeOmni's qwen2 registry entry replaced by one without
*ForTokenClassification (what veomni 0.1.10 / 0.1.11 ship), so VeOmni dispatches the critic to a causal LM.

  python -m critic_adapters.backends.veomni.tests.dispatch_worker MODEL_DIR OUT.pt
Rank 0 writes {"veomni_class": the class VeOmni picks for the critic config, "error": the engine's
error (None if it built), "values_shape": the shape compute_values returned if it built}.
"""

import sys

import torch

from critic_adapters.backends.veomni.tests.worker_common import quiet
from critic_adapters.common.engine.config import EngineConfig, ModelConfig
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.common.engine import build_engine
from critic_adapters.common.valuehead.load import plan_load


def qwen2_without_token_classification(architecture: str):
    """veomni 0.1.11's qwen2 entry: CausalLM, SequenceClassification, Model, else CausalLM."""
    from veomni.models.transformers.qwen2.generated.patched_modeling_qwen2_gpu import (
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
        Qwen2Model,
    )

    if "ForSequenceClassification" in architecture:
        return Qwen2ForSequenceClassification
    if "ForCausalLM" not in architecture and "Model" in architecture and "For" not in architecture:
        return Qwen2Model
    return Qwen2ForCausalLM


def main():
    model_dir, out_file = sys.argv[1:3]
    dist = init_distributed()
    with quiet():
        from veomni.models.loader import MODELING_REGISTRY, get_model_class

        MODELING_REGISTRY["qwen2"] = qwen2_without_token_classification  # an in-process (local) override
        out = {"veomni_class": get_model_class(plan_load(model_dir).config).__name__, "error": None}
        try:
            engine = build_engine("veomni", EngineConfig(model=ModelConfig(path=model_dir)), dist)
        except ValueError as err:
            out["error"] = str(err)
        else:
            ids = torch.arange(3, 9)[None]
            out["values_shape"] = tuple(engine.compute_values(ids, torch.ones_like(ids)).shape)
            engine.close()
        del MODELING_REGISTRY["qwen2"]
    if dist.is_main:
        torch.save(out, out_file)
    shutdown()


if __name__ == "__main__":
    main()
