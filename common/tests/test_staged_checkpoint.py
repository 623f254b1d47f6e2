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


if __name__ == "__main__":
    run_pytest(__file__)
