"""common.storage.checkpoints.staged_checkpoint on one rank: a failure or a Ctrl-C (also when DCP wraps it
mid-save) leaves no staging directory and the previous checkpoint as it was."""

import os

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from critic_adapters.common.storage import checkpoints
from critic_adapters.common.parallel.distributed import init_distributed
from critic_adapters.common.tests.helpers import run_pytest


def _save(directory, content):
    with checkpoints.staged_checkpoint(str(directory), is_main=True, group=None, timeout_s=60) as staging:
        with open(os.path.join(staging, "data"), "w") as f:
            f.write(content)


@pytest.mark.parametrize("raised,expected", [
    (OSError(28, "No space left on device"), OSError),
    (KeyboardInterrupt(), KeyboardInterrupt),
    # Ctrl-C during dcp.save reaches us wrapped; the trainer must still see an interruption.
    (CheckpointException("save failed", {1: (KeyboardInterrupt(), None)}), KeyboardInterrupt),
])
def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, raised, expected):
    init_distributed()
    target = tmp_path / "step_000004"
    _save(target, "old")
    with pytest.raises(expected):
        with checkpoints.staged_checkpoint(str(target), is_main=True, group=None, timeout_s=60) as staging:
            with open(os.path.join(staging, "data"), "w") as f:
                f.write("new")
            raise raised
    assert (target / "data").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["step_000004"], "a staging directory was left behind"
    _save(target, "newer")
    assert (target / "data").read_text() == "newer"


def test_extra_tensors_each_rank_saved_come_back_to_that_rank_and_only_at_that_world_size():
    """issue 49: what gather_extra_tensors keeps (one rank here: nothing differs) and what each rank gets back."""
    import torch

    kept = checkpoints.gather_extra_tensors({"step": torch.tensor(5)}, group=None)
    assert kept.per_rank is None and torch.equal(kept.shared["step"], torch.tensor(5))
    state = {checkpoints.EXTRA_TENSORS: {"step": torch.tensor(5)},
             checkpoints.PER_RANK: {"world_size": 2, "ranks": [{"replay": torch.zeros(2)}, {"replay": torch.ones(2)}]}}
    for rank in (0, 1):
        got = checkpoints.extra_tensors_for(state, rank, 2, "ckpt")
        assert sorted(got) == ["replay", "step"] and torch.equal(got["replay"], torch.full((2,), float(rank)))
    with pytest.raises(ValueError, match=r"ckpt: the extra tensors \['replay'\] were saved by each of 2 ranks .*this "
                                         r"engine has 4: load it on 2 ranks"):
        checkpoints.extra_tensors_for(state, 0, 4, "ckpt")
    assert checkpoints.extra_tensors_for({checkpoints.EXTRA_TENSORS: {}}, 3, 4, "ckpt") == {}


if __name__ == "__main__":
    run_pytest(__file__)
