"""Our critic in verl 0.9.1's engine slot, driven by verl's own TrainingWorker (no Ray, CPU, fp32)
in the verl overlay (tools/setup.sh: .overlays/verl-0.9.1, transformers 5.10.4), in verl_worker.py
processes (the one-process checks batched into two processes, the two-process ones into one
torchrun): values equal our compute_values, one update equals verl's own fsdp2 value-model engine on
the same weights, a value_mask in verl's batch trains as that response_mask would, a vision-language
critic reads the multi_modal_inputs in verl's batch, a checkpoint resumes bit-identically, and critics
from other formats train there with their heads."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests import checkpoint_builders as build
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import torchrun_command, worker_env
from critic_adapters.common.valuehead import load_critic, save_critic
from critic_adapters.tests.environments import REPO
from critic_adapters.tests.environments import verl_overlay_env as overlay_env


def run_check(check: str, tmp_path, *args: str) -> dict:
    """verl_worker CHECK in the verl overlay; its result."""
    out = tmp_path / f"{check}.pt"
    env = overlay_env()
    result = subprocess.run([sys.executable, "-m", "critic_adapters.tests.verl.verl_worker", check,
                             str(out), *args], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"verl_worker {check} {args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return torch.load(out, weights_only=False)


def test_importing_verl_registers_the_engine(import_probe):
    """The package's verl.plugins entry point: a plain `import verl` (plugins on, verl's default) has
    the engine registered, found for this machine's device (cpu here, through our CPU platform)."""
    assert import_probe["verl-overlay"]["registered"] == "CriticAdaptersEngine"


# What a fresh interpreter must not have after importing our entry points (or verl, which loads our
# plugin), one after another: a backend's library, verl's engines, a new transformers attention
# function, output. What the later imports bring is a superset of what each alone would. After the
# probe, in the verl overlay, the engine verl's registry finds for a value model (on stdout).
IMPORT_PROBE = """
import importlib, sys
from transformers import AttentionInterface
before = set(AttentionInterface._global_mapping)
seen = []
for module in sys.argv[1:]:
    importlib.import_module(module)
    loaded = [m for m in ("veomni", "megatron.core", "verl.workers.engine") if m in sys.modules]
    added = sorted(set(AttentionInterface._global_mapping) - before)
    seen.append((module, loaded, added))
sys.stderr.write(repr(seen))
if "verl" in sys.argv[1:]:  # verl's engines (VeOmni's banner among them) may log: not ours to judge
    import os
    sys.stdout.flush()
    sys.stderr.flush()
    stdout, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    from verl.workers.engine import EngineRegistry
    engine = EngineRegistry.get_engine_cls("value_model", "critic_adapters").__name__
    sys.stdout.flush()
    os.write(stdout, (engine + chr(10)).encode())
"""
ENTRY_POINTS = ["critic_adapters.common.engine", "critic_adapters.common.engine.registry", "critic_adapters.integrations.ray"]


@pytest.fixture(scope="module")
def import_probe() -> dict:
    """IMPORT_PROBE in a fresh interpreter of the verl overlay and of the venv (verl's plugins on, its
    default): {where: {"modules", "stdout", "stderr", "registered"}}."""
    probes = {}
    for where in ("verl-overlay", "venv"):
        env = {k: v for k, v in (overlay_env() if where == "verl-overlay" else worker_env()).items()
               if k not in ("VERL_USE_EXTERNAL_PLUGINS", "PYTHONWARNINGS")}
        modules = ENTRY_POINTS + (["critic_adapters.integrations.verl", "verl"] if where == "verl-overlay" else [])
        result = subprocess.run([sys.executable, "-c", IMPORT_PROBE, *modules], env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        stdout = result.stdout.splitlines()
        probes[where] = {"modules": modules, "stderr": result.stderr,
                         "stdout": "\n".join(stdout[:-1] if "verl" in modules else stdout),
                         "registered": stdout[-1] if stdout else None}
    return probes


@pytest.mark.parametrize("where", ["verl-overlay", "venv"])
def test_importing_an_entry_point_imports_no_backend_and_prints_nothing(where, import_probe):
    probe = import_probe[where]
    assert probe["stdout"] == "", probe["stdout"][-3000:]
    assert probe["stderr"] == repr([(module, [], []) for module in probe["modules"]]), probe["stderr"][-3000:]


@pytest.fixture(scope="module")
def critic_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl")
    return save_critic(load_critic(save_tiny_causal_lm("qwen2", str(root / "causal")))[0], str(root / "critic"))


# (backend, processes): verl's own engine runs data parallel on the same processes.
# "-offload": verl's critic.fsdp.param_offload and optimizer_offload on (verl's phases move our engine);
# "-paramoffload" / "-optoffload": one of the two.
PARITY_RUNS = [("fsdp", 1), ("megatron", 1), ("veomni", 1), ("fsdp-offload", 1), ("megatron-offload", 1),
               ("veomni-offload", 1), ("fsdp-paramoffload", 1), ("fsdp-optoffload", 1), ("fsdp", 2),
               ("megatron-tp2", 2), ("fsdp-sp2", 2), ("megatron-cp2", 2), ("megatron-tp2-offload", 2)]
# A value_mask key in verl's batch (issue 42), in the same worker runs: on 2 processes it must be
# counted over both data-parallel ranks.
VALUE_MASK_RUNS = [("fsdp", 1), ("fsdp", 2)]
# A vision-language critic with multi_modal_inputs in verl's batch (issue 43), in the same worker runs
# on its own critic (vision_critic_dir): on 2 processes each rank has its rows' images, and a
# micro-batch of one rank may have images where the other's has none.
VISION_RUNS = [("fsdp", 1), ("fsdp", 2)]
PEERS = ("-tp2", "-sp2", "-cp2")  # model-parallel peers: verl collects outputs from the first rank of each


def has_peers(backend: str) -> bool:
    return any(peer in backend for peer in PEERS)


def held_off_device(backend: str) -> list[str]:
    """What our engine holds off its device outside verl's phases, by the offload keys in the name:
    param_offload the parameters and gradients, optimizer_offload the optimizer state."""
    parts = backend.split("-")
    held = {"grads", "model"} if {"offload", "paramoffload"} & set(parts) else set()
    return sorted(held | ({"optimizer"} if {"offload", "optoffload"} & set(parts) else set()))


# The parity check on the critic verl's own engine saved in bf16 (tests/testdata/verl-fsdp2-bf16), verl's
# transformers: our sharded engines in verl's slot read it as load_critic does (issue 53).
SAVED_PARITY_RUNS = [("fsdp", 2), ("veomni", 2)]
VERL_BF16 = os.path.join(REPO, "tests", "testdata", "verl-fsdp2-bf16")
# verl's own engine saving the critic with hf_model (save_hf), at model_dtype bf16: the committed
# fixture tests/testdata/verl-fsdp2-bf16 (tests/test_saved_critics.py) must be what it writes.
SAVE_RUNS = [("bf16", 1)]


def worker_runs(processes: int) -> list[tuple[str, str]]:
    """(check, backend or dtype) of verl_worker's runs on `processes` processes: parity, value_mask,
    vision, save_hf, parity_saved (parity on VERL_BF16)."""
    return ([("parity", backend) for backend, n in PARITY_RUNS if n == processes]
            + [("value_mask", backend) for backend, n in VALUE_MASK_RUNS if n == processes]
            + [("vision", backend) for backend, n in VISION_RUNS if n == processes]
            + [("save_hf", dtype) for dtype, n in SAVE_RUNS if n == processes]
            + [("parity_saved", backend) for backend, n in SAVED_PARITY_RUNS if n == processes])


@pytest.fixture(scope="module")
def vision_critic_dir(tmp_path_factory) -> str:
    """A tiny qwen2_vl critic with a non-zero head (the vision runs')."""
    from critic_adapters.common.testdata.vision import save_vision_critic

    return save_vision_critic("qwen2_vl", str(tmp_path_factory.mktemp("verl_vision") / "critic"))


def run_args(runs: list[tuple[str, str]], critic_dir: str, vision_critic_dir: str) -> str:
    """verl_worker batch's JSON for these runs: the vision runs on the vision critic; save_hf saves
    the critic into a directory beside it named by the dtype."""
    import json

    def args(check: str, backend: str) -> list[str]:
        if check == "save_hf":
            return [check, critic_dir, f"{critic_dir}-saved-by-verl-{backend}", backend]
        if check == "parity_saved":
            return ["parity", VERL_BF16, backend]
        return [check, vision_critic_dir if check == "vision" else critic_dir, backend]

    return json.dumps([args(check, backend) for check, backend in runs])


@pytest.fixture(scope="module")
def single_process_parity(critic_dir, vision_critic_dir, tmp_path_factory) -> dict:
    """The one-process runs (worker_runs), every backend's one after another in one verl-overlay
    process (one interpreter start for all): {(check, backend): its result}."""
    runs = worker_runs(1)
    results = run_check("batch", tmp_path_factory.mktemp("parity"), run_args(runs, critic_dir, vision_critic_dir))
    return dict(zip(runs, results))


@pytest.fixture(scope="module")
def two_process_parity(critic_dir, vision_critic_dir, tmp_path_factory) -> dict:
    """The two-process runs (worker_runs) one after another in one torchrun of two verl-overlay
    processes (each run's engine closed before the next: megatron keeps one layout per process):
    {(check, backend): the per-rank results}."""
    runs = worker_runs(2)
    out = tmp_path_factory.mktemp("parity2") / "parity.pt"
    command = torchrun_command(2, "critic_adapters.tests.verl.verl_worker", "batch", str(out),
                               run_args(runs, critic_dir, vision_critic_dir))
    result = subprocess.run(command, env=overlay_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{runs} on 2 failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    ranks = [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(2)]
    return {run: [rank[i] for rank in ranks] for i, run in enumerate(runs)}


def run_parity(backend: str, processes: int, request, check: str = "parity") -> list[dict]:
    """verl_worker CHECK (parity, value_mask or vision) on each process: the per-rank results."""
    if processes == 1:
        return [request.getfixturevalue("single_process_parity")[check, backend]]
    assert processes == 2, processes
    return request.getfixturevalue("two_process_parity")[check, backend]


@pytest.mark.parametrize("backend,processes", PARITY_RUNS, ids=[f"{b}-{n}" for b, n in PARITY_RUNS])
def test_values_and_one_update_equal_verls_own_engine(backend, processes, request):
    checked = 0
    for result in run_parity(backend, processes, request):
        ours, verls = result[backend], result["verl-fsdp2"]
        # What the offload keys name is off the device from verl's reset (initialize) on, as verl's own
        # engines leave it, and again after every phase (each brings back what it needs, then offloads);
        # with the keys off, nothing moves. The values and metrics below are verl's engine's all the same.
        held = held_off_device(backend)
        assert ours["phases"] == [("after reset", held), ("after infer", held), ("after train", held),
                                  ("after infer", held)], ours["phases"]
        if ours["before"] is None:  # a TP / Ulysses peer: verl collects outputs from its first rank only
            assert has_peers(backend) and ours["metrics"] is None
            continue
        checked += 1
        assert ours["engine"] == "CriticAdaptersEngine" and verls["engine"] == "FSDPEngineWithValueHead"
        # verl's infer_batch through our engine gives our compute_values (and verl's engine agrees).
        for engine in (ours, verls):
            mask = engine["response_mask"].bool()
            assert torch.allclose(engine["before"][mask], engine["reference"][mask], atol=1e-6)
        # One train_mini_batch with verl's value_loss: the same metrics as verl's own engine.
        for key in ("critic/vf_loss", "grad_norm"):
            assert float(ours["metrics"][key][0]) == pytest.approx(float(verls["metrics"][key][0]), rel=1e-5, abs=1e-6), key
        assert ours["metrics"]["lr"] == verls["metrics"]["lr"]
        # ... and the same critic after it, on verl's engine's rows (ours may hold more of them).
        start = verls["rows"][0] - ours["rows"][0]
        rows = slice(start, start + verls["rows"][1] - verls["rows"][0])
        mask = verls["response_mask"].bool()
        assert torch.allclose(ours["after"][rows][mask], verls["after"][mask], atol=1e-5)
        assert not torch.allclose(ours["after"][rows][mask], ours["before"][rows][mask], atol=1e-3)  # it trained
        # verl's v1 trainer layout (every field nested, no attention_mask), from the state after that step.
        width = ours["v1_values"].shape[1]  # padded to the longest response of these rows
        assert torch.allclose(ours["v1_values"][rows], (ours["after"][rows] * mask)[:, :width], atol=1e-6)
        for key in ("critic/vf_loss", "grad_norm"):
            assert float(ours["v1_metrics"][key][0]) == pytest.approx(float(verls["v1_metrics"][key][0]), rel=1e-5,
                                                                      abs=1e-6), key
        if processes == 1:  # one rank sees every micro-batch's metrics
            assert ours["metrics"]["critic/vf_clipfrac"] == pytest.approx(verls["metrics"]["critic/vf_clipfrac"], abs=1e-6)
            assert ours["metrics"]["critic/vpred_mean"] == pytest.approx(verls["metrics"]["critic/vpred_mean"], abs=1e-6)
    assert checked == processes // (2 if has_peers(backend) else 1)


@pytest.mark.parametrize("backend,processes", SAVED_PARITY_RUNS, ids=[f"{b}-{n}" for b, n in SAVED_PARITY_RUNS])
def test_a_critic_verl_saved_in_bf16_gives_its_values_in_verls_slot(backend, processes, request):
    """issue 53: verl's bf16 hf_model save, in verl's environment, through verl's infer_batch on our
    sharded engine (fp32): load_critic's values, as verl's own engine gives them, and one update as verl's."""
    for result in run_parity(backend, processes, request, check="parity_saved"):
        ours, verls = result[backend], result["verl-fsdp2"]
        for engine in (ours, verls):
            mask = engine["response_mask"].bool()
            assert torch.allclose(engine["before"][mask], engine["reference"][mask], atol=1e-5), (
                (engine["before"][mask] - engine["reference"][mask]).abs().max())
        for key in ("critic/vf_loss", "grad_norm"):
            assert float(ours["metrics"][key][0]) == pytest.approx(float(verls["metrics"][key][0]), rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("backend,processes", VALUE_MASK_RUNS, ids=[f"{b}-{n}" for b, n in VALUE_MASK_RUNS])
def test_a_value_mask_in_verls_batch_trains_as_that_response_mask(backend, processes, request):
    """issue 42: a value_mask key (VAGEN's verl fork) narrows verl's value_loss and its global token
    count to those tokens: the step equals one whose response_mask is response_mask & value_mask (the
    same critic and batch), padded and in the v1 layout, and differs from the step without it."""
    parity = run_parity(backend, processes, request)
    for rank, result in enumerate(run_parity(backend, processes, request, check="value_mask")):
        key, replaced, unmasked = result["key"], result["response_mask"], parity[rank][backend]
        assert 0 < int(result["value_mask"].sum()) < int(unmasked["response_mask"].sum())  # it drops tokens here
        for metrics in ("metrics", "v1_metrics"):
            for name in ("critic/vf_loss", "grad_norm"):
                assert float(key[metrics][name][0]) == pytest.approx(float(replaced[metrics][name][0]), rel=1e-6,
                                                                   abs=1e-7), (metrics, name)
            assert float(key[metrics]["critic/vf_loss"][0]) != pytest.approx(
                float(unmasked[metrics]["critic/vf_loss"][0]), rel=1e-3), metrics  # the value_mask changed the step
        for values in ("after", "v1_after"):
            assert torch.allclose(key[values], replaced[values], atol=1e-6), values
        assert not torch.allclose(key["after"], unmasked["after"], atol=1e-5)
        # A value_mask outside response_mask (one token, on the last rank's rows only) is refused on every rank.
        assert result["errors"]["outside"].startswith("value_mask marks 1 token(s) outside response_mask"), result["errors"]
        assert result["errors"]["shape"].startswith("value_mask must have response_mask's layout"), result["errors"]


@pytest.mark.parametrize("backend,processes", VISION_RUNS, ids=[f"{b}-{n}" for b, n in VISION_RUNS])
def test_a_vision_critic_reads_the_images_in_verls_batch(backend, processes, vision_critic_dir, request):
    """issue 43: multi_modal_inputs in verl's batch (its non_tensor_batch key, one dict per row, with
    [4, T] Qwen-VL position ids and verl's images_seqlens) reach our engine with their rows, through
    verl's fixed and dynamic (regrouped) micro-batches and its v1 layout: the values are our engine's
    compute_values on the same rows with those images, and transformers' own forward of each row;
    zeroed pixels change the image rows' values only; each update equals our engine's update."""
    from types import SimpleNamespace

    from critic_adapters.common.engine import shift_to_tokens
    from critic_adapters.common.testdata.vision import transformers_values

    for result in run_parity(backend, processes, request, check="vision"):
        verl, ours, tensors = result["verl"], result["ours"], result["tensors"]
        response = tensors["response_mask"].bool()
        width = tensors["prompts"].shape[1]
        images = [{k: v for k, v in row.items() if k != "images_seqlens"} for row in result["images"]]
        rows = SimpleNamespace(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                               multi_modal_inputs=images)
        reference = shift_to_tokens(transformers_values(vision_critic_dir, rows))[:, width:]
        assert (verl["before"] - reference)[response].abs().max() < 1e-4
        for values in ("before", "after", "v1_after"):
            assert torch.allclose(verl[values][response], ours[values][response], atol=1e-5), \
                (values, (verl[values] - ours[values])[response].abs().max())
        # verl's dynamic micro-batches (two) regroup the rows by length; the images go with their rows.
        groups = result["dynamic_groups"]
        assert len(groups) == 2 and sorted(sum(groups, [])) == list(range(len(images))), groups
        if processes == 1:
            assert groups != [[0, 1], [2, 3]], groups  # not verl's fixed micro-batches
        assert torch.allclose(verl["dynamic"][response], verl["before"][response], atol=1e-5)
        # Zeroed pixels: the image rows' values change, a text row's do not.
        blind = (verl["zeroed"] - verl["before"]).abs().amax(-1)
        assert all(blind[row] > 1e-2 if images[row] else blind[row] < 1e-5 for row in range(len(images))), blind
        # The image rows without multi_modal_inputs in verl's batch: refused, never computed blind (issue 49).
        assert verl["blind"] is not None and "image placeholder token(s)" in verl["blind"], verl["blind"]
        # One train_mini_batch (padded), then one in the v1 layout: our engine's two updates on the same rows.
        for metrics in ("metrics", "v1_metrics"):
            assert float(verl[metrics]["critic/vf_loss"][0]) == pytest.approx(ours[metrics]["value_loss"], rel=1e-5)
            assert float(verl[metrics]["grad_norm"][0]) == pytest.approx(ours[metrics]["grad_norm"], rel=1e-5)
        assert torch.allclose(verl["v1_values"], verl["after"][:, :verl["v1_values"].shape[1]], atol=1e-6)
        assert (verl["after"] - verl["before"])[response].abs().max() > 1e-3  # the step moved the critic


def readme_verl_section() -> str:
    """The verl guide the README links (docs/VERL.md)."""
    with open(os.path.join(REPO, "docs", "VERL.md")) as f:
        return f.read()


@pytest.fixture(scope="module")
def single_process_checks(critic_dir, tmp_path_factory):
    """The one-process checks that need no engine of their own but fsdp's (resume, formats, the
    config mappings), run one after another in one verl-overlay process: {check: its result}."""
    import json
    import re

    tmp_path = tmp_path_factory.mktemp("verl_checks")
    fixtures = {"trl": build.trl_value_head(str(tmp_path / "formats")),
                "openrlhf": build.openrlhf(str(tmp_path / "formats")),
                "megatron": build.megatron_export(str(tmp_path / "formats"))}
    section = readme_verl_section()
    path = [f"critic.model.path={critic_dir}", "critic.ppo_micro_batch_size_per_gpu=2"]
    (snippet,) = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    (tmp_path / "critic.yaml").write_text(snippet)
    overrides = re.findall(r"`(\+?critic\.[\w.]+=[^`\s]+)`", section)
    assert len(overrides) == 4, overrides
    checks = {"resume": ["resume", critic_dir, "fsdp", str(tmp_path)],
              "formats": ["formats", *(p for p, _ in fixtures.values())],
              "yaml": ["yaml", str(tmp_path / "critic.yaml"), *path],
              "command line": ["yaml", "-", *overrides, *path],
              "config": ["config", critic_dir]}
    results = run_check("batch", tmp_path, json.dumps(list(checks.values())))
    out = dict(zip(checks, results))
    out["fixtures"] = fixtures
    return out


def test_verl_saves_a_bf16_critic_as_the_committed_fixture(critic_dir, request):
    """verl's own engine at model_dtype bf16, saving hf_model: the same files, tensor names, shapes and
    dtypes and the same config as tests/testdata/verl-fsdp2-bf16 (tests/test_saved_critics.py runs it
    through every engine). When verl or the pins change what it writes, copy the new
    <critic>-saved-by-verl-bf16/huggingface over the fixture."""
    from safetensors import safe_open

    files = request.getfixturevalue("single_process_parity")["save_hf", "bf16"]
    saved = os.path.join(f"{critic_dir}-saved-by-verl-bf16", "huggingface")
    fixture = os.path.join(REPO, "tests", "testdata", "verl-fsdp2-bf16")
    assert sorted(files) == sorted(os.listdir(fixture)) == ["config.json", "model.safetensors"], files

    def layout(directory: str) -> dict:
        with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
            return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}

    def config(directory: str) -> dict:
        with open(os.path.join(directory, "config.json")) as f:
            return {k: v for k, v in json.load(f).items() if k != "transformers_version"}

    assert layout(saved) == layout(fixture)
    assert {dtype for dtype, _ in layout(saved).values()} == {"BF16"}
    assert config(saved) == config(fixture) and config(saved)["dtype"] == "bfloat16"


def test_a_checkpoint_saved_through_verl_resumes_bit_identically(single_process_checks):
    result = single_process_checks["resume"]
    (continued_metrics, continued_values), (resumed_metrics, resumed_values) = result["continued"], result["resumed"]
    assert torch.equal(continued_values, resumed_values)
    for key in ("critic/vf_loss", "grad_norm", "critic/vpred_mean"):
        assert continued_metrics[key] == resumed_metrics[key], key
    assert "critic_checkpoint.json" in result["files"]  # our engine's checkpoint, where verl asked for it


def test_critics_of_other_formats_train_there_with_their_heads(single_process_checks):
    result = single_process_checks["formats"]
    mask = result["response_mask"].bool()
    for name, (path, _) in single_process_checks["fixtures"].items():
        entry = result[os.path.basename(path)]
        # The head was loaded, not re-initialised: verl's values are the checkpoint's own (our loader's).
        assert torch.allclose(entry["verl"][mask], entry["ours"][mask], atol=1e-6), name
        assert float(entry["verl"][mask].abs().max()) > 1e-3, name
        assert torch.isfinite(torch.tensor(float(entry["metrics"]["critic/vf_loss"][0]))), name
        assert not torch.allclose(entry["after"][mask], entry["verl"][mask], atol=1e-4), name  # it trained


@pytest.mark.parametrize("form", ["yaml", "command line"])
def test_the_readmes_verl_keys_reach_the_engine_through_verls_own_config(form, critic_dir, single_process_checks):
    """The README's YAML snippet and its command-line overrides, on verl's ppo_trainer.yaml composed
    by hydra and built as verl's trainer builds its critic config."""
    result = single_process_checks[form]
    if form == "yaml":
        assert result["backend"] == "fsdp" and result["batching"]["micro_batch_tokens"] == 8192
    else:
        assert result["backend"] == "megatron" and result["parallel"]["tensor"] == 2
    assert result["strategy"] == result["engine_strategy"] == "critic_adapters"
    assert result["engine_config"] == "CriticAdaptersEngineConfig" and result["path"] == critic_dir


def test_the_engine_config_maps_verls_keys_and_refuses_what_does_not_fit(critic_dir, single_process_checks):
    result = single_process_checks["config"]
    mapped = result["mapped"]
    assert mapped["backend"] == "megatron" and mapped["path"] == critic_dir
    assert mapped["optim"] == {"lr": 3e-4, "weight_decay": 0.05, "betas": [0.9, 0.95], "grad_clip": 0.5,
                               "lr_schedule": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1, "total_steps": 100}
    assert mapped["tensor"] == 2 and mapped["micro_batch_tokens"] == 4096 and mapped["gradient_checkpointing"]
    errors = result["errors"]
    assert errors["unknown key"].startswith("critic.fsdp.critic_adapters: batching.micro_batch_token does not fit")
    assert "critic.fsdp.critic_adapters.loss.kind=hl_gauss: in verl's engine slot the critic trains with the loss " \
           "verl passes" in errors["hl_gauss"]
    assert errors["backend"] == "critic.fsdp.critic_adapters_backend='deepspeed': use one of fsdp, megatron, veomni"
    assert errors["schedule"].startswith("critic.optim.lr_scheduler_type='wsd'")


def test_verls_precision_keys_map_onto_ours(single_process_checks):
    """issue 41, item 6: verl's own FSDP engine computes in bf16 unless critic.fsdp.mixed_precision
    says otherwise; so does our critic under verl (engine.mixed_precision=bf16), and an explicit fp32
    policy maps to none. A precision our engine has no equivalent of is refused by its key."""
    for form in ("yaml", "command line"):  # verl's ppo_trainer.yaml as hydra composes it, our keys added
        result = single_process_checks[form]
        assert (result["mixed_precision"], result["dtype"]) == ("bf16", "float32"), form
    precision = single_process_checks["config"]["precision"]
    assert precision == {"default": ("bf16", "float32"), "fp32": ("none", "float32"),
                         "bf16 params": ("bf16", "bfloat16"), "explicit bf16": ("bf16", "float32")}
    errors = single_process_checks["config"]["errors"]
    assert errors["fp16"].startswith("critic.fsdp.mixed_precision.param_dtype='fp16'")
    assert errors["reduce_dtype"].startswith("critic.fsdp.mixed_precision.reduce_dtype='bf16'")
    assert errors["buffer_dtype"].startswith("critic.fsdp.mixed_precision.buffer_dtype='bf16'")
    assert errors["model_dtype"].startswith("critic.fsdp.model_dtype='fp16'")
    assert errors["bf16 params, fp32 compute"].startswith(
        "critic.fsdp.model_dtype='bf16' with critic.fsdp.mixed_precision.param_dtype='fp32'")



def test_the_readme_verl_example_runs_on_cpu_with_nothing_set_up_by_hand(tmp_path):
    # Issue 27, 4.2: TrainingWorker failed with "Duplicate device type cpu in backend string" (cpu:gloo,cpu:gloo).
    with open(os.path.join(REPO, "docs", "VERL.md")) as f:
        assert "examples/critic_in_verl.py" in f.read()
    result = subprocess.run([sys.executable, os.path.join(REPO, "examples", "critic_in_verl.py")], env=overlay_env(),
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    errors = re.search(r"squared error to the returns ([\d.]+) before the update, ([\d.]+) after", result.stdout)
    assert errors and float(errors[2]) < float(errors[1]), result.stdout[-2000:]

if __name__ == "__main__":
    run_pytest(__file__)
