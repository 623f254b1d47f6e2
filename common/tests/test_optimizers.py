"""engine.optim.state_dtype=bfloat16 (common/engine/optimizers.py, adamw_bf16.py): AdamW with bf16
moments steps as fp32 AdamW does with its moments rounded to bf16 after every step, on a tensor larger
than one of the pieces the three-pass CPU step works in and on small ones; the one-pass C kernel
(adamw_bf16.c) gives the three-pass step's numbers bit for bit, at any thread count; and where it
cannot be built or disagrees with torch, the three-pass step runs and the run says why."""

from __future__ import annotations

import pytest
import torch

from critic_adapters.common.engine import adamw_bf16, optimizers
from critic_adapters.common.engine.config import OptimConfig
from critic_adapters.common.tests.helpers import run_pytest

SHAPES = [(adamw_bf16.PIECE * 2 + 17,), (70, 30), (5,)]
HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*shape, generator=g) for shape in SHAPES]


def _optimizer(params, kernel: bool) -> optimizers.CriticOptimizer:
    optimizer = optimizers.CriticOptimizer([{"params": params, "kind": "adamw"}], state_dtype=torch.bfloat16, **HYPER)
    if kernel:  # setup installs a C compiler: the kernel must build here
        assert optimizer.adamw_kernel.step is not None, optimizer.adamw_kernel.why
    else:
        optimizer.adamw_kernel = adamw_bf16.Kernel(None, "the test asks for three passes")
    return optimizer


def _steps(optimizer, params, count: int) -> list[torch.Tensor]:
    """Parameters, then moments, after `count` steps."""
    for step in range(count):
        for p, grad in zip(params, _grads(step)):
            p.grad = grad
        optimizer.step()
    return ([p.detach().clone() for p in params] +
            [optimizer.state[p][key].clone() for p in params for key in ("exp_avg", "exp_avg_sq")])


@pytest.mark.parametrize("kernel", [True, False], ids=["one-pass kernel", "three passes"])
def test_bf16_moments_step_as_fp32_adamw_with_its_moments_rounded_to_bf16(kernel):
    ours, reference = _params(), _params()
    optimizer = _optimizer(ours, kernel)
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
    for piece in (adamw_bf16.PIECE, 1 << 40):
        monkeypatch.setattr(adamw_bf16, "PIECE", piece)
        params = _params()
        results.append(_steps(_optimizer(params, kernel=False), params, 2))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_one_pass_kernel_steps_as_the_three_passes_bit_for_bit(threads):
    """Parameters and moments after 3 steps equal the three-pass step's exactly, whatever the thread
    count (each thread a share of the elements across tensor boundaries)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = []
        for kernel in (True, False):
            params = _params()
            results.append(_steps(_optimizer(params, kernel), params, 3))
    finally:
        torch.set_num_threads(before)
    for ours, theirs in zip(*results):
        assert torch.equal(ours, theirs), (ours - theirs).abs().max()


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """kernel() decided anew, built into an empty cache (no other test's build reused)."""
    monkeypatch.setenv("CRITIC_ADAPTERS_CACHE", str(tmp_path))
    adamw_bf16.kernel.cache_clear()
    yield
    adamw_bf16.kernel.cache_clear()


def test_the_kernel_is_built_on_first_use_and_reported(fresh_kernel, tmp_path):
    kernel = adamw_bf16.kernel()
    assert kernel.step is not None, kernel.why
    assert [p.name for p in (tmp_path / "kernels").iterdir()][0].startswith("adamw_bf16-")  # only the library
    assert len(list((tmp_path / "kernels").iterdir())) == 1
    params = _params()
    line = optimizers.optimizer_line(OptimConfig(state_dtype="bfloat16"), _optimizer(params, kernel=True))
    assert "adamw's bf16 step: one-pass C kernel (built by" in line, line


@pytest.mark.parametrize("setting", ["no compiler", "switched off"])
def test_without_the_kernel_the_three_passes_run_and_the_run_says_why(fresh_kernel, monkeypatch, setting):
    if setting == "no compiler":
        monkeypatch.setenv("CC", "/nonexistent/cc")
    else:
        monkeypatch.setenv(adamw_bf16.SWITCH, "0")
    params = _params()
    optimizer = optimizers.CriticOptimizer([{"params": params, "kind": "adamw"}], state_dtype=torch.bfloat16, **HYPER)
    assert optimizer.adamw_kernel.step is None
    why = "did not build: [Errno 2]" if setting == "no compiler" else f"{adamw_bf16.SWITCH}=0"
    line = optimizers.optimizer_line(OptimConfig(state_dtype="bfloat16"), optimizer)
    assert "adamw's bf16 step: three passes (" in line and why in line, line
    reference = _params()
    assert all(torch.equal(a, b) for a, b in zip(_steps(optimizer, params, 2),
                                                 _steps(_optimizer(reference, kernel=False), reference, 2)))


def test_a_kernel_that_disagrees_with_torch_is_not_used():
    """The check run before the kernel is used can fail: a step off by 2^-20 of each parameter, or
    two bf16 units off in its second moment, is refused."""
    step = adamw_bf16.kernel().step

    def nudged(params, *args, **hyper):
        step(params, *args, **hyper)
        for p in params:
            p.mul_(1 + 2 ** -20)

    def second_moment_off(params, grads, exp_avgs, exp_avg_sqs, *args, **hyper):
        step(params, grads, exp_avgs, exp_avg_sqs, *args, **hyper)
        for v in exp_avg_sqs:  # two bf16 units toward zero (positive numbers: their bits minus 2)
            v.view(torch.int16).sub_(2)

    assert adamw_bf16.agrees_with_torch(step) == ""
    assert "param differs from torch's step" in adamw_bf16.agrees_with_torch(nudged)
    assert "exp_avg_sq differs from torch's step" in adamw_bf16.agrees_with_torch(second_moment_off)


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


if __name__ == "__main__":
    run_pytest(__file__)
