"""Several processes under faults: 3 and 4 ranks finish; a failure on one rank ends every rank with its
message; workers die with a SIGKILLed launcher; Ctrl-C (forked and spawned workers) and a read-only
run_dir give one line."""

import os
import signal
import subprocess
import sys
import time

import pytest

from critic_adapters.backends.fsdp.tests.launch import launcher_env, run_launcher, torchrun_command
from critic_adapters.common.job.forked_workers import WORKER_START_ENV
from critic_adapters.common.tests.helpers import read_only_dir, run_pytest

# 20 rollouts: 18 train in mini-batches of 8, 8, 2 and 2 held out, so with 3 or 4 ranks some ranks
# get no rows of a mini-batch or of the held-out set.
TINY = ["data.num_rollouts=20", "data.mini_batch_size=8", "trainer.epochs=1", "trainer.tensorboard=false",
        "trainer.plot=false", "trainer.progress=false"]
SHORT = ["data.num_rollouts=512", "data.mini_batch_size=32", "trainer.epochs=2", "trainer.save_every_steps=4",
         "trainer.tensorboard=false", "trainer.plot=false", "trainer.progress=false"]


@pytest.mark.parametrize("nproc", [3, 4])
def test_three_and_four_processes_finish(tmp_path, nproc):
    start = time.monotonic()
    result = run_launcher("--nproc", str(nproc), f"trainer.run_dir={tmp_path}", *TINY, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1].startswith("final explained_variance=")
    print(f"{nproc} processes: {time.monotonic() - start:.0f} s")


def test_a_failure_on_one_rank_ends_every_rank_promptly_with_its_message(tmp_path):
    command = torchrun_command(2, "critic_adapters.backends.fsdp.tests.fault_worker", f"trainer.run_dir={tmp_path}", *SHORT)
    start = time.monotonic()
    result = subprocess.run(command, env=launcher_env(), capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "error: rank 1: RuntimeError: injected fault on rank 1 at update 2" in result.stderr, result.stderr[-4000:]
    assert elapsed < 120, f"took {elapsed:.0f} s"


def test_an_export_failing_on_the_writing_rank_ends_the_job_with_its_message_alone(tmp_path):
    # Issue 27, 2: rank 0 writes the export and fails; rank 1, waiting for it, raises with its message.
    (tmp_path / "hf_export").write_text("a file where the export goes")
    result = run_launcher("--nproc", "2", f"trainer.run_dir={tmp_path}", *TINY, timeout=240)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'hf_export'} exists and is not a directory"], \
        result.stderr[-3000:]  # one line: no torchrun report after it

def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _name(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _start(run_dir, *args, env: dict | None = None):
    env = dict(launcher_env(), PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "critic_adapters.backends.fsdp.train", "--nproc", "2", f"trainer.run_dir={run_dir}",
                             *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for(process, text: str) -> None:
    for line in process.stdout:
        if text in line:
            return
    raise AssertionError(f"{text!r} never printed:\n{process.stderr.read()[-3000:]}")


def test_workers_die_with_a_killed_launcher(tmp_path):
    process = _start(tmp_path, *SHORT, "trainer.epochs=50")  # minutes of training left when it is killed
    workers = []
    try:
        _wait_for(process, "rollouts:")  # the workers are training
        workers = _descendants(process.pid)
        assert len(workers) >= 2, workers  # its 2 workers (torchrun's agent runs in the launcher itself)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.2)
        survivors = [p for p in workers if _alive(p)]
        assert not survivors, f"processes {survivors} outlived the launcher by 10 s"
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("start", ["auto", "spawn"])  # auto: forked from the launcher on this CPU machine
def test_ctrl_c_stops_every_rank_with_one_line(tmp_path, start):
    # Forked, the launcher passes the signal on itself (common.job.forked_workers.torchrun_main); spawned,
    # torchrun's agent does (the path a GPU run takes).
    process = _start(tmp_path, *SHORT, env={WORKER_START_ENV: start})
    _wait_for(process, "/checkpoints/step_000004")
    names = sorted(_name(pid) for pid in _descendants(process.pid))
    assert (names == ["rank-0", "rank-1"]) == (start == "auto"), names
    os.kill(process.pid, signal.SIGINT)  # what a terminal sends the launcher (torchrun has its own session)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr[-3000:]
    assert "interrupted at step " in stderr and "; resume with --resume (from step_0000" in stderr, stderr[-3000:]
    assert "Traceback" not in stdout + stderr, stderr[-3000:]


def test_read_only_run_dir_is_one_line_before_any_process_starts(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with read_only_dir(str(run_dir)):
        result = run_launcher("--nproc", "2", f"trainer.run_dir={run_dir}", *TINY, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: trainer.run_dir={run_dir} is not writable: cannot create files in {run_dir} (Read-only file system); "
        f"choose another trainer.run_dir"] or "(Permission denied)" in result.stderr, result.stderr[-3000:]


if __name__ == "__main__":
    run_pytest(__file__)
