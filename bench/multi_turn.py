"""What the multi-turn machinery changes in what a critic learns: the default job (embedded tiny Qwen2
critic, 4 epochs) on the embedded multi-turn rollouts (common/learning/multi_turn.py: 2-4 turns,
tool output between them, 30% ending on a tool output with the reward there, 15% truncated), with
data.off_mask_rewards=previous, in these variants:

  token            GAE per token; truncated rows bootstrap from the critic (the default)
  turn             data.timestep_unit=turn (each turn one timestep)
  terminal         the `truncated` field left out: truncated rows end with return 0, as every stack but
                   AReaL treats them
each at gamma = lambda_critic = 1 (the default job's) and at gamma 0.99, lambda_critic 0.95.

Reported per run, on the held-out rollouts (the job's own split) with the exported critic:
  ev           the job's held-out explained variance (over the value-mask tokens, against the returns
               the job computes: a truncated row's bootstrapped from the critic)
  ev_outcome   explained variance of the critic's values against each rollout's would-be outcome (the
               reward it earned, or would have earned had it not been cut off): how well the critic
               predicts what happens, whatever targets it was trained on
  bias         mean (return target - outcome) over the truncated rows' response tokens (gamma = 1
               runs only, where the return of an ended row is its outcome)

  python -m critic_adapters.bench.multi_turn [--backend fsdp] [--nproc 2] [--out FILE.json] [--variants ...]
  bazel run //bench:multi_turn -- ...
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

if __package__ in (None, ""):  # run as a file: this checkout as the package critic_adapters
    import as_a_file  # noqa: F401  (bench/as_a_file.py)

import torch  # noqa: E402

NUM_ROLLOUTS = 2048  # the default job's
SEED = 0
VARIANTS = {"token": [], "turn": ["data.timestep_unit=turn"], "terminal": []}
DISCOUNTS = {"gamma1": ["data.gamma=1.0", "data.lam_critic=1.0"],
             "gamma0.99": ["data.gamma=0.99", "data.lam_critic=0.95"]}


def held_out_rows(num_rollouts: int, seed: int) -> torch.Tensor:
    """The rows the default job holds out (data.eval_fraction 0.1)."""
    from critic_adapters.common.learning.data import held_out_index

    return held_out_index(num_rollouts, 0.1, seed=seed)[1]


def measure(run_dir: str, records: list[dict], outcomes: list[float], config) -> dict:
    """ev_outcome and bias of the job's exported critic on its held-out rows."""
    from critic_adapters.common.engine import shift_to_tokens
    from critic_adapters.common.job.trainer import critic_returns
    from critic_adapters.common.learning.data import to_rollouts
    from critic_adapters.common.learning.loss import explained_variance
    from critic_adapters.common.valuehead import compute_values, load_critic

    rows = held_out_rows(len(records), SEED)
    held = to_rollouts([records[i] for i in rows.tolist()])
    held.old_values = torch.zeros_like(held.rewards)  # unused: gae's values are the critic's (none brought)
    critic, _ = load_critic(os.path.join(run_dir, "hf_export"))
    with torch.no_grad():
        values = compute_values(critic, held.input_ids, held.attention_mask).float()
    outcome = torch.tensor([outcomes[i] for i in rows.tolist()])[:, None].expand_as(held.rewards)
    mask = held.response_mask.bool()
    out = {"ev_outcome": explained_variance(shift_to_tokens(values), outcome, mask)}
    if config.data.gamma == 1.0:
        returns = critic_returns(held, values, config) if held.truncated is not None else torch.zeros_like(outcome)
        truncated = torch.tensor([bool(records[i]["truncated"]) for i in rows.tolist()])
        cut = mask & truncated[:, None]
        out["bias"] = float((returns - outcome)[cut].mean())
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="fsdp")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--discounts", default=",".join(DISCOUNTS), help="comma-separated, of " + ", ".join(DISCOUNTS))
    args = parser.parse_args(argv)

    from critic_adapters.bench.value_learning import run_job, write_jsonl
    from critic_adapters.common.engine.config import load_train_config
    from critic_adapters.common.learning.multi_turn import make_multi_turn_records

    outcomes: list[float] = []
    records = make_multi_turn_records(NUM_ROLLOUTS, SEED, outcomes=outcomes)
    results = {}
    with tempfile.TemporaryDirectory(prefix="critic_multi_turn_") as tmp:
        with_field = write_jsonl(records, os.path.join(tmp, "multi_turn.jsonl"))
        without = write_jsonl([{k: v for k, v in r.items() if k != "truncated"} for r in records],
                              os.path.join(tmp, "terminal.jsonl"))
        for discount in args.discounts.split(","):
            for variant in args.variants.split(","):
                path = without if variant == "terminal" else with_field
                overrides = [f"data.train_path={path}", "data.off_mask_rewards=previous", f"engine.seed={SEED}",
                             *DISCOUNTS[discount], *VARIANTS[variant]]
                run_dir = os.path.join(tmp, f"{discount}-{variant}")
                result = run_job(args.backend, args.nproc, run_dir, overrides)
                config = load_train_config([], overrides)
                result.update(measure(run_dir, records if variant != "terminal" else
                                      [dict(r, truncated=False) for r in records], outcomes, config))
                if variant == "terminal" and "bias" in result:  # its returns: 0 on every truncated row
                    cut = [outcomes[i] for i in held_out_rows(len(records), SEED).tolist() if records[i]["truncated"]]
                    result["bias"] = -sum(cut) / len(cut)
                results[f"{discount}/{variant}"] = result
                print(f"{discount:9s} {variant:9s} held-out EV {result['explained_variance']:.4f}  "
                      f"EV vs outcome {result['ev_outcome']:.4f}"
                      + (f"  truncated-row bias {result['bias']:+.3f}" if "bias" in result else ""), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"backend": args.backend, "nproc": args.nproc, "rollouts": NUM_ROLLOUTS, "results": results},
                      f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
