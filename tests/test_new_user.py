"""What a new user trips over (issue 14), one test per item, through the real commands where there
is one, asserting the exit code, the message and what is left on disk. Runs that train go through a
subprocess as a user would; launches that end before training (refusals, dry runs, --print-config,
--help) run the launcher's main in this process (`launch`), the same exit code and output."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import pytest

from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import run_launcher, run_launcher_in_process as launch, worker_env

FSDP, MEGATRON, VEOMNI = (f"critic_adapters.backends.{name}.train" for name in ("fsdp", "megatron", "veomni"))
VALUEHEAD = "critic_adapters.common.valuehead"
TINY = ["data.num_rollouts=48", "data.mini_batch_size=16", "trainer.epochs=1"]


def cli(*args: str, umask: int | None = None) -> subprocess.CompletedProcess:
    """python -m critic_adapters.common.valuehead ARGS: its main in this process (it starts nothing),
    under `umask` when given."""
    if umask is None:
        return launch(f"{VALUEHEAD}.cli", *args)
    old = os.umask(umask)
    try:
        return launch(f"{VALUEHEAD}.cli", *args)
    finally:
        os.umask(old)


def refused(result, *fragments):
    assert result.returncode == 2, f"rc={result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    for fragment in fragments:
        assert fragment in result.stderr, f"{fragment!r} not in:\n{result.stderr[-3000:]}"


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def printed_config(result) -> dict:
    import yaml

    assert result.returncode == 0, result.stderr[-3000:]
    return yaml.safe_load(result.stdout)


def lr_only_yaml(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("engine:\n  optim:\n    lr: 1.0e-4\n")
    return str(path)


# 1. A backend's launcher defaults `backend` to itself.
def test_1_the_megatron_launcher_takes_a_yaml_without_backend(tmp_path):
    config = printed_config(launch(MEGATRON, "--nproc", "2", lr_only_yaml(tmp_path), "engine.parallel.tensor=2",
                                         "--print-config"))
    assert config["backend"] == "megatron"
    ok = launch(MEGATRON, "--nproc", "2", lr_only_yaml(tmp_path), "engine.parallel.tensor=2", "--dry-run",
                      f"trainer.run_dir={tmp_path / 'run'}")
    assert ok.returncode == 0 and "config OK" in ok.stdout, ok.stderr[-3000:]
    # Written by the user, a mismatch is still refused.
    (tmp_path / "fsdp.yaml").write_text("backend: fsdp\n")
    refused(launch(MEGATRON, str(tmp_path / "fsdp.yaml"), "--dry-run"),
            "backend=fsdp in the config, but this is the megatron launcher")


# 2. Layers: dataclass defaults < the default job < the backend's job_defaults < the user's YAML files < overrides.
def test_2_yaml_files_layer_on_the_backends_defaults(tmp_path):
    config = printed_config(launch(MEGATRON, lr_only_yaml(tmp_path), "--print-config"))
    engine = config["engine"]
    assert engine["optim"]["lr"] == 1e-4                                   # the user's file
    assert engine["optim"]["lr_schedule"] == "cosine" and engine["optim"]["warmup_ratio"] == 0.1  # the default job's
    assert engine["batching"]["micro_batch_tokens"] == 2048 and engine["parallel"]["tensor"] == 2
    assert config["trainer"]["run_dir"] == "outputs/megatron-default"
    (tmp_path / "second.yaml").write_text("engine:\n  optim:\n    lr: 3.0e-4\n    warmup_steps: 2\n")
    config = printed_config(launch(MEGATRON, lr_only_yaml(tmp_path), str(tmp_path / "second.yaml"),
                                         "engine.optim.warmup_steps=5", "--print-config"))
    assert config["engine"]["optim"]["lr"] == 3e-4 and config["engine"]["optim"]["warmup_steps"] == 5
    assert config["engine"]["optim"]["lr_schedule"] == "cosine"
    help_text = launch(MEGATRON, "--help").stdout
    assert "later wins, key by key" in help_text and "common/job/default_job.yaml" in help_text


# 3. The dry run and the launcher check the process count, the layout and the heads first.
def test_3_layout_errors_before_any_process_starts_and_leave_nothing(tmp_path):
    run_dir = tmp_path / "run"
    heads = "engine.parallel.tensor=3 must divide the attention heads (4)"
    refused(launch(MEGATRON, "--nproc", "3", "engine.parallel.tensor=3", "--dry-run",
                         f"trainer.run_dir={run_dir}"), heads)
    refused(launch(MEGATRON, "--nproc", "3", "engine.parallel.tensor=3", f"trainer.run_dir={run_dir}"), heads)
    refused(launch(MEGATRON, "engine.parallel.tensor=3", f"trainer.run_dir={run_dir}"), heads)
    refused(launch(MEGATRON, "--nproc", "2", "engine.parallel.tensor=3", "--dry-run",
                         f"trainer.run_dir={run_dir}"), "2 processes cannot be split into groups of")
    refused(launch(MEGATRON, "--nproc", "3", "--dry-run", f"trainer.run_dir={run_dir}"),
            "3 processes cannot be split into groups of engine.parallel tensor x pipeline x context x ulysses = 2")
    for count in ("0", "-1"):
        refused(launch(FSDP, "--nproc", count, f"trainer.run_dir={run_dir}"), f"--nproc {count}: the process "
                "count must be >= 1")
    assert not run_dir.exists()
    ok = launch(MEGATRON, "--nproc", "4", "--dry-run", f"trainer.run_dir={run_dir}")
    assert ok.returncode == 0 and "processes: 4 (tensor 2 x data parallel 2)" in ok.stdout, ok.stderr[-3000:]


# 4. A bad value type is one line: the key, where it came from, the type expected.
def test_4_bad_value_types_are_one_line_naming_key_file_and_type(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("engine:\n  optim:\n    lr: fast\n")
    result = launch(FSDP, str(path), "--dry-run")
    refused(result, f"engine.optim.lr='fast' in {path}: expected float")
    assert len(error_lines(result)) == 1, result.stderr
    result = launch(FSDP, "engine.parallel.sequence_parallel=maybe", "--dry-run")
    refused(result, "engine.parallel.sequence_parallel='maybe' in the command line: expected true/false")
    assert len(error_lines(result)) == 1, result.stderr


# 5. --resume with only trainer.run_dir resumes from the run's own config.yaml (here the run test 7
# interrupted after its final checkpoint, trained with data.num_rollouts=40: a setting the resume
# must take from the run's config.yaml, not from the defaults).
def test_5_resume_with_only_the_run_dir(interrupted_run):
    run_dir, _ = interrupted_run
    resumed = run_launcher(FSDP, "--resume", f"trainer.run_dir={run_dir}", "trainer.epochs=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume: the run's settings from {run_dir / 'config.yaml'}" in resumed.stdout
    assert "resume: trainer.epochs changed from 1 to 2" in resumed.stdout
    assert "resume: data.num_rollouts" not in resumed.stdout
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert max(row["epoch"] for row in rows) == 2 and max(row["step"] for row in rows) == 6  # 40 rollouts: 3 steps an epoch
    # A setting that cannot change is still refused, naming the key.
    refused(launch(FSDP, "--resume", f"trainer.run_dir={run_dir}", "engine.optim.lr=1"),
            "engine.optim.lr: 0.002 in the run, 1.0 now")


def clean_run(launcher: str, run_dir, *extra: str) -> subprocess.CompletedProcess:
    # A new interpreter, as a user's (env= keeps run_launcher from running the launcher part in this
    # process, where pytest would collect the warnings it prints).
    result = run_launcher(launcher, *extra, *TINY, "trainer.save_every_steps=2", f"trainer.run_dir={run_dir}",
                          env=worker_env())
    assert result.returncode == 0, result.stderr[-4000:]
    return result


NOISE = re.compile(r"WARN|ERROR|Warning|\[INFO", re.IGNORECASE)


# The fsdp run's export is split into files of at most 300 kB (issue 40, 8: the job's export size key).
CLEAN_RUNS = {FSDP: ("--nproc", "2", "trainer.export_max_shard_size=300KB"), MEGATRON: (), VEOMNI: ("--nproc", "2")}


@pytest.fixture(scope="module")
def clean_runs(tmp_path_factory) -> dict:
    """{launcher: (run_dir, result)} of one clean default run per backend (tests 6, 7 and 8)."""
    runs = {}
    for launcher, extra in CLEAN_RUNS.items():
        run_dir = tmp_path_factory.mktemp("clean") / "run"
        runs[launcher] = run_dir, clean_run(launcher, run_dir, *extra)
    return runs


# 6. A clean default run prints no library line at WARNING or above on stdout (and no known noise anywhere).
@pytest.mark.parametrize("launcher", list(CLEAN_RUNS))
def test_6_a_clean_run_prints_no_warning_on_stdout(clean_runs, launcher):
    _, result = clean_runs[launcher]
    noisy = [line for line in result.stdout.splitlines() if NOISE.search(line)]
    assert not noisy, "\n".join(noisy)
    known = ("UserWarning", "cache_position", "all-zero values", "Environment Variables", "torch_dtype",
             "CUDA_DEVICE_MAX_CONNECTIONS", "cuda_graph_scope", "sequence parallelism support",
             "Loading checkpoint shards")  # VeOmni's bar over our own staging copy (issue 27, 3)
    assert not [k for k in known if k in result.stderr], result.stderr[-4000:]
    assert "final explained_variance=" in result.stdout
    # Issue 41, item 13: the run's first lines say which kernels run and why.
    kernels = [line for line in result.stdout.splitlines() if line.startswith("  kernels      ")]
    assert len(kernels) == 1 and "attention " in kernels[0] and "(" in kernels[0], result.stdout[:3000]


@pytest.fixture(scope="module")
def fsdp_run(clean_runs):
    """(run_dir, result) of the clean two-process fsdp run, for tests 7 and 8."""
    return clean_runs[FSDP]


# 7. The console says where things went; a Ctrl-C after training finished says so.
def test_7_the_console_names_every_output(fsdp_run):
    run_dir, result = fsdp_run
    out = result.stdout
    assert f"run dir: {run_dir} (metrics.jsonl, tensorboard/, checkpoints/, hf_export/, training.png)" in out
    assert f"checkpoint saved: {run_dir / 'checkpoints' / 'step_000002'}" in out
    assert f"metrics: {run_dir / 'metrics.jsonl'}, TensorBoard logs: {run_dir / 'tensorboard'}" in out
    assert f"exported {run_dir / 'hf_export'}" in out and f"plot: {run_dir / 'training.png'}" in out
    shards = sorted(p.name for p in (run_dir / "hf_export").glob("*.safetensors"))
    assert len(shards) > 1 and (run_dir / "hf_export" / "model.safetensors.index.json").is_file(), shards
    assert all((run_dir / "hf_export" / name).stat().st_size <= 300_000 + 10_000 for name in shards)  # + header


INTERRUPT_AFTER_EXPORT = """
import sys
import critic_adapters.common.job.trainer as trainer
from critic_adapters.backends.fsdp.train import main

def interrupted(*args, **kwargs):
    raise KeyboardInterrupt  # Ctrl-C while the plot is drawn: after the final checkpoint and the export
trainer.plot_metrics = interrupted
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory):
    """(run_dir, result) of a one-process fsdp run of 40 rollouts (3 steps) interrupted by a Ctrl-C
    while its plot is drawn (tests 7 and 5)."""
    run_dir = tmp_path_factory.mktemp("interrupted") / "run"
    result = subprocess.run([sys.executable, "-c", INTERRUPT_AFTER_EXPORT, *TINY, "data.num_rollouts=40",
                             f"trainer.run_dir={run_dir}"], env=worker_env(), capture_output=True, text=True,
                            timeout=300)
    return run_dir, result


def test_7_ctrl_c_after_training_finished_says_so(interrupted_run):
    run_dir, result = interrupted_run
    assert result.returncode == 130, result.stderr[-3000:]
    lines = error_lines(result)
    assert lines[-1].startswith("interrupted after training had finished (step 3): the final checkpoint "
                                f"{run_dir / 'checkpoints' / 'step_000003'} is complete"), lines
    assert "interrupted before training began" not in result.stderr
    assert (run_dir / "hf_export" / "config.json").is_file()


# 8. The plot compares like with like; metrics rows carry epoch and time; the README links the definitions.
def test_8_plot_and_metrics_rows(fsdp_run):
    from critic_adapters.common.job.metrics import metrics_figure

    records = [{"step": 0, "split": "eval", "epoch": 0, "value_loss": 2.0, "explained_variance": -3.0},
               {"step": 1, "split": "train", "epoch": 1, "value_loss": 9.0, "mse": 1.5, "explained_variance": -2.0}]
    fig = metrics_figure(records)
    ax_loss, ax_ev = fig.axes
    train_line, eval_line = ax_loss.get_lines()
    assert list(train_line.get_ydata()) == [1.5]  # the unclipped mse, not the clipped PPO loss (9.0)
    assert train_line.get_marker() == "o" and eval_line.get_marker() == "o"  # single points are visible
    assert ax_loss.get_ylabel() and ax_ev.get_ylabel()
    assert ax_ev.get_ylim()[0] <= -3.0  # explained variance is not clipped at -0.5

    run_dir, _ = fsdp_run
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert all("epoch" in row and isinstance(row["time"], float) for row in rows)
    train = [row for row in rows if row["split"] == "train"]
    assert all(row["epoch"] == 1 and row["mse"] > 0 for row in train)
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        assert "docs/METRICS.md" in f.read()


# 9. Outputs honour the umask.
def test_9_exports_honour_the_umask(tmp_path):
    model = tmp_path / "model"
    from critic_adapters.common.testdata import save_tiny_causal_lm

    save_tiny_causal_lm("qwen2", str(model))
    result = cli("convert", str(model), str(tmp_path / "critic"), umask=0o002)
    assert result.returncode == 0, result.stderr
    mode = stat.S_IMODE(os.stat(tmp_path / "critic").st_mode)
    assert mode == 0o775, oct(mode)
    assert stat.S_IMODE(os.stat(tmp_path / "critic" / "config.json").st_mode) == 0o664
    result = cli("convert", str(model), str(tmp_path / "private"), umask=0o077)
    assert stat.S_IMODE(os.stat(tmp_path / "private").st_mode) == 0o700


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# 10. / 11. One alignment for both values outputs; values need no returns; a missing column is one line.
def test_10_11_values_cli_one_alignment_and_no_returns_needed(tmp_path):
    import pyarrow.parquet as pq
    from critic_adapters.common.testdata import save_tiny_causal_lm

    model = str(tmp_path / "model")
    save_tiny_causal_lm("qwen2", model)
    tokens = [1, 22, 642, 7, 9, 30]
    printed = cli("values", model, "--tokens", " ".join(map(str, tokens)))
    assert printed.returncode == 0, printed.stderr
    line = next(line for line in printed.stdout.splitlines() if line.startswith("values  "))
    shown = json.loads(line.split("  ")[1].split("  (")[0])
    assert "values[t] is the critic's value for token t, read at position t-1" in printed.stdout
    rollouts = write_jsonl(tmp_path / "ids_only.jsonl", [{"input_ids": tokens, "response_mask": [0, 0, 0, 1, 1, 1]}])
    written = cli("values", model, "--rollouts", rollouts, "--out", str(tmp_path / "v.parquet"))
    assert written.returncode == 0, written.stderr  # no returns or rewards needed
    (row,) = pq.read_table(tmp_path / "v.parquet").to_pylist()
    assert shown[0] == 0.0 and row["values"][0] == 0.0
    assert shown == pytest.approx([round(v, 5) for v in row["values"]], abs=1e-5)
    assert "values[t] is the critic's value for token t" in cli("values", "--help").stdout

    no_mask = write_jsonl(tmp_path / "no_mask.jsonl", [{"input_ids": tokens}] * 30)
    result = cli("values", model, "--rollouts", no_mask, "--out", str(tmp_path / "w.parquet"))
    refused(result, "no row has the field(s) ['response_mask']")
    assert len(error_lines(result)) == 1, result.stderr  # once, not once per row
    assert not (tmp_path / "w.parquet").exists()


def test_11_the_rollout_file_is_checked_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from critic_adapters.common.testdata import save_tiny_causal_lm
    from critic_adapters.common.valuehead import cli as cli_module

    model = str(tmp_path / "model")
    save_tiny_causal_lm("qwen2", model)

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the rollouts were checked")

    monkeypatch.setattr(cli_module, "load_critic", never)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"input_ids": [1, 5000], "response_mask": [0, 1]}])
    assert cli_module.main(["values", model, "--rollouts", bad, "--out", str(tmp_path / "v.parquet")]) == 2
    assert "outside the model's vocabulary [0, 1000)" in capsys.readouterr().err


# 12. Docstrings an engine user can work from.
def test_12_engine_docstrings_say_how_to_use_it():
    from critic_adapters.common.engine import CriticEngine, RolloutBatch, build_engine
    from critic_adapters.common.valuehead import compute_values

    assert "init_distributed()" in build_engine.__doc__ and "DistContext" in build_engine.__doc__
    values_doc = CriticEngine.compute_values.__doc__
    assert "UNSHIFTED" in values_doc and "shift_to_tokens" in values_doc and "float32 [B, T]" in values_doc
    assert "every field" in CriticEngine.update.__doc__ and "token-aligned" in CriticEngine.update.__doc__
    assert "value at position t - 1" in RolloutBatch.__doc__
    # compute_values agrees with the README: the value of token t is entry t - 1.
    assert "entry t - 1" in compute_values.__doc__ and "read at position t" not in compute_values.__doc__.split("\n")[0]


# 13. Small ones.
def test_13_small_ones(tmp_path):
    missing = cli("inspect", str(tmp_path / "does/not/exist"))
    refused(missing, "does not exist; pass a Hugging Face model directory")
    model = tmp_path / "model"
    from critic_adapters.common.testdata import save_tiny_causal_lm

    save_tiny_causal_lm("qwen2", str(model))
    refused(cli("inspect", str(model / "config.json")), f"is a file; pass the model directory that holds it ({model})")
    help_text = launch(FSDP, "--help").stdout
    first = "Train a PPO critic with the FSDP2 engine"
    assert help_text.count(first) == 1, help_text
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        assert "valuehead demo" in f.read()
    dry = launch(FSDP, "--dry-run", f"trainer.run_dir={tmp_path / 'run'}")
    assert "initialise score.weight (fresh head), score.bias (zero)" in dry.stdout and "['" not in dry.stdout
    assert not (tmp_path / "run").exists()  # a dry run writes nothing, not even the embedded model


# Issue 27, 4.3 and 4.5: a dry run refuses what the launch would refuse, and neither writes anything.
def test_27_dry_runs_refuse_what_launches_refuse_before_anything_is_written(tmp_path):
    import torch

    from critic_adapters.common.learning.hl_gauss import HLGaussSupport
    from critic_adapters.common.testdata import tiny_config
    from critic_adapters.common.valuehead import save_critic
    from critic_adapters.common.valuehead.config import critic_class, critic_config

    config = critic_config(tiny_config("qwen2"), value_head=HLGaussSupport(num_bins=11, min_value=-1.0, max_value=1.0,
                                                                          sigma_ratio=0.75))
    torch.manual_seed(0)
    save_critic(critic_class(config)(config), str(tmp_path / "hl_gauss_critic"))
    cases = {
        "hl-gauss-as-mse": ([f"engine.model.path={tmp_path / 'hl_gauss_critic'}"], "holds an HL-Gauss head"),
        "ulysses-eager": (["engine.parallel.ulysses=2", "engine.model.attn_implementation=eager"],
                          "engine.model.attn_implementation='eager' cannot split heads across ranks"),
    }
    for name, (args, message) in cases.items():
        run_dir = tmp_path / name
        for flags in (["--dry-run"], ["--nproc", "2"]):  # refused in this process: no worker starts
            refused(launch(FSDP, *flags, *args, *TINY, f"trainer.run_dir={run_dir}"), message)
            assert not run_dir.exists(), (name, flags, sorted(os.listdir(run_dir)))
    # 4.7: the dry run says what a LoRA run trains.
    dry = launch(FSDP, "--dry-run", "engine.lora.rank=8", "engine.lora.target_modules=[q_proj,v_proj]", *TINY,
                 f"trainer.run_dir={tmp_path / 'lora'}")
    assert dry.returncode == 0 and "LoRA rank 8 on q_proj, v_proj (alpha 16)" in dry.stdout, dry.stdout + dry.stderr


# Issue 40, 3: a settings file takes dotted keys, as the command line does (the README's example).
def test_40_3_a_yaml_file_takes_dotted_keys(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("engine.optim.lr: 1.0e-3\ndata:\n  mini_batch_size: 16\nengine:\n  batching.packing: false\n")
    config = printed_config(launch(FSDP, str(path), "--print-config"))
    assert config["engine"]["optim"]["lr"] == 1e-3 and config["data"]["mini_batch_size"] == 16
    assert config["engine"]["batching"]["packing"] is False
    path.write_text("engine.optim.lr: 1.0e-3\nengine:\n  optim:\n    lr: 2.0e-3\n")
    refused(launch(FSDP, str(path), "--dry-run"), f"{path}: engine.optim.lr is set twice (once dotted, once nested)")
    path.write_text("engine.optim.lrr: 1.0e-3\n")
    refused(launch(FSDP, str(path), "--dry-run"), f"unknown config key 'engine.optim.lrr' in {path}; did you mean "
                                                  "engine.optim.lr")


# Issue 40, 4: every case a launch refused after starting its processes (and writing its run_dir) is
# refused by the dry run and by the launch before anything starts, with the same message.
DRY_RUN_AND_LAUNCH_REFUSE = {
    "replicate-3-of-4": (FSDP, ["--nproc", "4", "engine.parallel.replicate=3"],
                         "engine.parallel.replicate=3 must divide the data-parallel degree 4 (4 processes over the "
                         "model-parallel degree 1): each replica shards the critic over data / replicate ranks; launch "
                         "a multiple of 3 processes (--nproc)"),
    "replicate-with-ulysses": (FSDP, ["--nproc", "2", "engine.parallel.replicate=2", "engine.parallel.ulysses=2"],
                               "engine.parallel.replicate=2 must divide the data-parallel degree 1"),
    "veomni-qwen2_moe": (VEOMNI, ["engine.model.path=embedded:qwen2_moe"],
                         "VeOmni 0.1.12 has no modeling for model_type 'qwen2_moe'"),
    "veomni-mixtral": (VEOMNI, ["engine.model.path=embedded:mixtral"],
                       "VeOmni 0.1.12 has no modeling for model_type 'mixtral'"),
    "megatron-router-aux-pp": (MEGATRON, ["engine.model.path=embedded:qwen2_moe", "engine.parallel.tensor=1",
                                          "engine.parallel.pipeline=2", "engine.loss.router_aux_coef=0.1"],
                               "engine.loss.router_aux_coef=0.1 takes engine.parallel.pipeline=1 and context=1"),
}


@pytest.mark.parametrize("case", list(DRY_RUN_AND_LAUNCH_REFUSE))
def test_40_4_the_dry_run_and_the_launch_refuse_alike_before_anything_starts(tmp_path, case):
    launcher, args, message = DRY_RUN_AND_LAUNCH_REFUSE[case]
    run_dir = tmp_path / "run"
    dry = launch(launcher, "--dry-run", *args, *TINY, f"trainer.run_dir={run_dir}")
    real = launch(launcher, *args, *TINY, f"trainer.run_dir={run_dir}")  # in this process: no worker may start
    refused(dry, message)
    refused(real, message)
    assert error_lines(dry) == error_lines(real)
    assert not run_dir.exists()


def test_40_4_replicas_count_in_the_process_count_and_the_dry_run_shows_the_layout(tmp_path):
    run_dir = f"trainer.run_dir={tmp_path / 'run'}"
    dry = launch(FSDP, "--dry-run", "engine.parallel.replicate=2", *TINY, run_dir)
    assert dry.returncode == 0 and "processes: 2 (data parallel 2: 2 replicas x 1 shard)" in dry.stdout, dry.stderr
    dry = launch(FSDP, "--dry-run", "--nproc", "4", "engine.parallel.replicate=2", *TINY, run_dir)
    assert dry.returncode == 0 and "processes: 4 (data parallel 4: 2 replicas x 2 shards)" in dry.stdout, dry.stderr
    # A refusal caused by the backend's job default names it (megatron's default job is tensor 2).
    refused(launch(MEGATRON, "--dry-run", "engine.model.path=embedded:qwen3_moe", "engine.parallel.expert=2", *TINY,
                   run_dir), "engine.parallel.tensor=2: the megatron backend's job default")


# Issue 40, 5: a resume's dry run checks what the resume checks and says what it continues; the
# layout's replicas may change on resume; a resume without --nproc keeps the run's process count.
def test_40_5_resume_dry_run_and_a_resume_at_another_replicate_degree(interrupted_run):
    import yaml

    run_dir, _ = interrupted_run
    epochs = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["epochs"]  # 2 after test 5
    refused(launch(FSDP, "--resume", "--dry-run", f"trainer.run_dir={run_dir}", "engine.optim.lr=1"),
            "engine.optim.lr: 0.002 in the run, 1.0 now")
    args = ["--resume", f"trainer.run_dir={run_dir}", f"trainer.epochs={epochs + 1}", "--nproc", "2",
            "engine.parallel.replicate=2"]
    dry = launch(FSDP, "--dry-run", *args)
    assert dry.returncode == 0, dry.stderr[-3000:]
    latest = os.path.realpath(run_dir / "checkpoints" / sorted(os.listdir(run_dir / "checkpoints"))[-1])
    for line in ("processes: 2 (data parallel 2: 2 replicas x 1 shard), the run last ran on 1",
                 f"resume: from {run_dir / 'checkpoints'}", f"resume: trainer.epochs changed from {epochs} to {epochs + 1}",
                 "resume: engine.parallel.replicate changed from 1 to 2", "config OK"):
        assert line in dry.stdout, (line, dry.stdout)
    assert "initialise" not in dry.stdout and os.path.basename(latest) in dry.stdout
    resumed = run_launcher(FSDP, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert max(row["epoch"] for row in rows) == epochs + 1
    # The run now records 2 processes: a resume's dry run without --nproc keeps them.
    dry = launch(FSDP, "--dry-run", "--resume", f"trainer.run_dir={run_dir}")
    assert "processes: 2 (data parallel 2: 2 replicas x 1 shard), as the run last ran" in dry.stdout, dry.stdout


# Issue 40, 6: the PPO iteration follows the mini-batch; a size that does not fit is refused only
# where it matters, naming the nearest that fit.
def test_40_6_a_mini_batch_alone_is_taken_and_the_iteration_is_checked_where_it_matters(tmp_path):
    run_dir = f"trainer.run_dir={tmp_path / 'run'}"
    ok = launch(FSDP, "--dry-run", "data.num_rollouts=48", "data.mini_batch_size=12", run_dir)
    assert ok.returncode == 0 and "config OK" in ok.stdout, ok.stderr[-3000:]
    uneven = ["data.num_rollouts=48", "data.mini_batch_size=12", "data.rollout_batch_size=100"]
    message = "data.rollout_batch_size=100 must be a multiple of data.mini_batch_size=12"
    refused(launch(FSDP, "--dry-run", *uneven, run_dir), message, "use 96 or 108")
    # The launch refuses it in its worker, from the rollouts, before anything is written.
    refused(run_launcher(FSDP, *uneven, "trainer.epochs=1", run_dir), message, "use 96 or 108")
    assert not (tmp_path / "run").exists()
    unclipped = launch(FSDP, "--dry-run", *uneven, "engine.loss.clip_range=null", run_dir)  # no old values to renew
    assert unclipped.returncode == 0, unclipped.stderr[-3000:]


def test_13_the_nan_hint_names_the_real_module():
    import torch
    from critic_adapters.common.engine.config import TrainConfig
    from critic_adapters.common.job.trainer import check_model_values

    with pytest.raises(ValueError, match=r"python -m critic_adapters\.common\.valuehead inspect"):
        check_model_values(torch.tensor([[0.0, float("nan")]]), torch.tensor([[0, 1]]), TrainConfig(), "values")



def test_a_job_too_short_for_its_data_says_what_to_change(tmp_path):
    """issue 49: 300 rollouts at the default job's epochs and mini-batch take 20 optimizer steps (a tour's
    agentic set learned nothing there): the dry run (and the run's first lines) say so, with settings that
    take a few hundred; following them, or the default job's 2048 rollouts, no warning."""
    run_dir = f"trainer.run_dir={tmp_path / 'run'}"
    short = launch(FSDP, "--dry-run", "data.num_rollouts=300", run_dir)
    assert short.returncode == 0, short.stderr[-2000:]
    assert ("warning: only 20 optimizer steps (270 train rollouts / data.mini_batch_size=64 = 5 per epoch, x "
            "trainer.epochs=4): a critic needs a few hundred to learn; for this data set use e.g. "
            "data.mini_batch_size=16 trainer.epochs=15") in short.stdout, short.stdout
    for settings in (("data.num_rollouts=300", "data.mini_batch_size=16", "trainer.epochs=15"), ()):
        fine = launch(FSDP, "--dry-run", *settings, run_dir)
        assert fine.returncode == 0 and "optimizer steps" not in fine.stdout, fine.stdout

if __name__ == "__main__":
    run_pytest(__file__)
