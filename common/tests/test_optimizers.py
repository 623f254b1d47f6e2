"""engine.optim.state_dtype=bfloat16 (common/engine/optimizers.py): AdamW with bf16 moments steps as
fp32 AdamW does with its moments rounded to bf16 after every step, on a tensor larger than one of the
pieces the CPU step works in and on small ones."""

from __future__ import annotations

import torch

from critic_adapters.common.engine import optimizers
from critic_adapters.common.tests.helpers import run_pytest

SHAPES = [(optimizers.ADAMW_PIECE * 2 + 17,), (70, 30), (5,)]
HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*shape, generator=g) for shape in SHAPES]


def test_bf16_moments_step_as_fp32_adamw_with_its_moments_rounded_to_bf16():
    ours, reference = _params(), _params()
    optimizer = optimizers.CriticOptimizer([{"params": ours, "kind": "adamw"}], state_dtype=torch.bfloat16, **HYPER)
    torch_adamw = torch.optim.AdamW(reference, foreach=False, **HYPER)
    for step in range(4):
        for params in (ours, reference):
            for p, grad in zip(params, _grads(step)):
                p.grad = grad.clone()
        optimizer.step()
        torch_adamw.step()
        for p in reference:  # the reference's moments, held as ours are
            for key in ("exp_avg", "exp_avg_sq"):
                torch_adamw.state[p][key].copy_(torch_adamw.state[p][key].bfloat16().float())
        for p, q in zip(ours, reference):
            assert optimizer.state[p]["exp_avg"].dtype == torch.bfloat16
            for key in ("exp_avg", "exp_avg_sq"):  # within one bf16 rounding
                torch.testing.assert_close(optimizer.state[p][key].float(), torch_adamw.state[q][key],
                                           rtol=2 ** -8, atol=0)
            # the parameters: the fp32 step's arithmetic (a step moves them by ~lr)
            assert float((p - q).detach().abs().max()) < 0.01 * HYPER["lr"], step


def test_a_step_on_pieces_equals_the_step_on_whole_tensors(monkeypatch):
    """The CPU step works in pieces: the numbers are those of one piece per tensor, bit for bit."""
    results = []
    for piece in (optimizers.ADAMW_PIECE, 1 << 40):
        monkeypatch.setattr(optimizers, "ADAMW_PIECE", piece)
        params = _params()
        optimizer = optimizers.CriticOptimizer([{"params": params, "kind": "adamw"}], state_dtype=torch.bfloat16,
                                               **HYPER)
        for step in range(2):
            for p, grad in zip(params, _grads(step)):
                p.grad = grad
            optimizer.step()
        results.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))


if __name__ == "__main__":
    run_pytest(__file__)


def test_muon_shared_out_among_the_ranks_steps_as_every_rank_orthogonalising_every_matrix(tmp_path):
    """At 2 ranks each rank orthogonalises its share of the matrices (both ranks get some), and the
    parameters after 2 steps equal those of every rank orthogonalising every matrix, bit for bit."""
    from critic_adapters.common.tests.torchrun import run_torchrun

    out = tmp_path / "muon.pt"
    run_torchrun(2, "critic_adapters.common.tests.muon_worker", str(out))
    result = torch.load(out)
    assert sorted(set(result["owners"])) == [0, 1], result["owners"]
    start = [layer.weight for layer in __import__("critic_adapters.common.tests.muon_worker",
                                                  fromlist=["model"]).model()]
    for shared, whole, before in zip(result["shared"], result["whole"], start):
        assert torch.equal(shared, whole)
        assert not torch.equal(shared, before.detach())  # the step moved them
