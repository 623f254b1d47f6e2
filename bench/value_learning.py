"""Compare how well a critic learns with the MSE loss and with HL-Gauss (common/learning/hl_gauss.py): the
default training job (embedded tiny Qwen2 critic, 2048 rollouts, 4 epochs, the same seeds and
steps) run with engine.loss.kind=mse and =hl_gauss, on two rollout sets:

  default        the embedded rollouts (docs/DATA.md): returns in [-1.25, 1.25]
  heavy-tailed   the same prompts and responses, each task's value drawn from a Student-t with 2
                 degrees of freedom (scale 0.5) and a Student-t(2) noise of scale 0.05 per rollout:
                 most returns near 0, a few tasks far out

MSE runs twice: as the default job has it (engine.loss.clip_range=0.5 around the old values, which
these rollouts lack: the job renews them from the current critic every data.rollout_batch_size
rollouts) and unclipped (clip_range=null, as HL-Gauss, which has no clip). HL-Gauss takes its
support from the rollout set's returns (their min and max; 51 bins, sigma_ratio 0.75): what a
user without tuning would set. Everything else is the default job's. Reported per
run: held-out explained variance and held-out RMSE of the values against the returns (the last
evaluation). Printed last (mse: the default job's clipped loss):
  hl_gauss vs mse held-out EV: <a> vs <b> (default data), <c> vs <d> (heavy-tailed)

  python -m critic_adapters.bench.value_learning [--backend fsdp] [--nproc 2] [--out FILE.json]
                                                 [--sets default,heavy-tailed] [--losses mse,mse_unclipped,hl_gauss]
  bazel run //bench:value_learning -- ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

if __package__ in (None, ""):  # run as a file: this checkout as the package critic_adapters
    import as_a_file  # noqa: F401  (bench/as_a_file.py)

import torch  # noqa: E402

NUM_ROLLOUTS = 2048  # the default job's
SEED = 0


def response_bonus(record: dict) -> float:
    """The default rollouts' token-dependent part of the reward (common/learning/data.py: make_default_records)."""
    response = [t for t, m in zip(record["input_ids"], record["response_mask"]) if m]
    return 0.5 * (sum(1 for t in response if t % 2 == 0) / len(response) - 0.5)


def heavy_tailed_records(num_rollouts: int, seed: int) -> list[dict]:
    """The default rollouts with heavy-tailed task values and noise (see the module docstring)."""
    from critic_adapters.common.learning.data import TASK_TOKENS, make_default_records

    t2 = torch.distributions.StudentT(2.0)
    with torch.random.fork_rng(devices=[]):  # the sampler draws from the global RNG: seed a copy of it
        torch.manual_seed(seed + 1)
        task_value = 0.5 * t2.sample((len(TASK_TOKENS),))
        noise = 0.05 * t2.sample((num_rollouts,))
    records = make_default_records(num_rollouts, seed)
    for record, eps in zip(records, noise.tolist()):
        task = TASK_TOKENS.index(record["input_ids"][1])
        record["rewards"][-1] = float(task_value[task]) + response_bonus(record) + eps
    return records


def write_jsonl(records: list[dict], path: str) -> str:
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path


def return_range(records: list[dict]) -> tuple[float, float]:
    """min and max of the final rewards (the returns, at gamma = lambda = 1) of all rollouts."""
    finals = [r["rewards"][-1] for r in records]
    return min(finals), max(finals)


def run_job(backend: str, nproc: int, run_dir: str, overrides: list[str]) -> dict:
    """The default job through the backend's launcher; its last held-out evaluation."""
    command = [sys.executable, "-m", f"critic_adapters.backends.{backend}.train", "--nproc", str(nproc),
               f"trainer.run_dir={run_dir}", "trainer.tensorboard=false", "trainer.plot=false",
               "trainer.progress=false", *overrides]
    print("$ " + " ".join(command[1:]), flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"the job failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    evals = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    evals = [row for row in evals if row.get("split") == "eval"]
    last = evals[-1]
    return {"explained_variance": last["explained_variance"], "rmse": math.sqrt(2 * last["value_loss"])}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),  # the sentence and its list
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="fsdp")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--sets", default="default,heavy-tailed", help="rollout sets to run (comma-separated)")
    parser.add_argument("--losses", default="mse,mse_unclipped,hl_gauss", help="losses to run (comma-separated)")
    args = parser.parse_args(argv)

    from critic_adapters.common.learning.data import make_default_records

    results = {}
    with tempfile.TemporaryDirectory(prefix="critic_value_learning_") as tmp:
        sets = {"default": ("embedded:default", make_default_records(NUM_ROLLOUTS, SEED)),
                "heavy-tailed": (None, heavy_tailed_records(NUM_ROLLOUTS, SEED))}
        sets = {name: sets[name] for name in args.sets.split(",")}
        for name, (path, records) in sets.items():
            path = path or write_jsonl(records, os.path.join(tmp, f"{name}.jsonl"))
            low, high = return_range(records)
            support = [f"engine.loss.hl_gauss.min_value={low}", f"engine.loss.hl_gauss.max_value={high}"]
            data = [f"data.train_path={path}", f"data.num_rollouts={NUM_ROLLOUTS}", f"engine.seed={SEED}"]
            variants = (("mse", []),  # the default job's loss: clipped at 0.5 around the renewed old values
                        ("mse_unclipped", ["engine.loss.clip_range=null"]),
                        ("hl_gauss", ["engine.loss.kind=hl_gauss", "engine.loss.clip_range=null", *support]))
            variants = [(kind, loss) for kind, loss in variants if kind in args.losses.split(",")]
            for kind, loss in variants:
                result = run_job(args.backend, args.nproc, os.path.join(tmp, f"{name}-{kind}"), data + loss)
                results[f"{name}/{kind}"] = dict(result, returns=[low, high])
                print(f"{name:13s} {kind:14s} held-out EV {result['explained_variance']:.4f}  "
                      f"held-out RMSE {result['rmse']:.4f}  (returns in [{low:.3g}, {high:.3g}])", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"backend": args.backend, "nproc": args.nproc, "results": results}, f, indent=2)
            f.write("\n")
    ev = {key: value["explained_variance"] for key, value in results.items()}
    if len(ev) < 6:
        return
    print(f"hl_gauss vs mse held-out EV: {ev['default/hl_gauss']:.4f} vs {ev['default/mse']:.4f} (default data), "
          f"{ev['heavy-tailed/hl_gauss']:.4f} vs {ev['heavy-tailed/mse']:.4f} (heavy-tailed)")


if __name__ == "__main__":
    main()
