"""GAE over agentic rollouts: the plain per-token Python loop against the blocked scan
(common.learning.gae.gae), side by side in one process, per timestep unit (token and turn).

  python -m critic_adapters.bench.gae_speed [--repeats 5] [--shapes 8x65536,64x4096] [--threads 1]
      [--out FILE.json]
  python bench/gae_speed.py ...
  bazel run //bench:gae_speed -- ...

Rows as common/tests/test_gae.py's random_rollouts makes them (a prompt, turns of 1-40 tokens, tool
outputs of 0-20 with some rewards on them, placed with off_mask_rewards="previous"), every other
row truncated with a bootstrap value; lam_critic 1, lam_policy 0.95, gamma 0.99. Both sides compute
the critic's returns and the policy's advantages (the loop: one pass per lambda). Reported: the
median wall time of each (--repeats loop calls, 10x as many scan calls), their ratio, and the
largest difference between them. One torch thread by default: like for like, and steadier on a
shared machine (two threads waited on a busy core and measured 2-10x slower). Printed last:
  gae: [8, 65536] token <loop> s -> <scan> s (<ratio>x), turn ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

if __package__ in (None, ""):  # run as a file: this checkout as the package critic_adapters
    import as_a_file  # noqa: F401  (bench/as_a_file.py)

import torch  # noqa: E402

GAMMA, LAM_CRITIC, LAM_POLICY = 0.99, 1.0, 0.95


def median_time(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of `repeats` calls, and the last call's result."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def one_case(rows: int, width: int, unit: str, repeats: int) -> dict:
    from critic_adapters.common.learning.gae import gae
    from critic_adapters.common.tests.test_gae import gae_loop, random_rollouts

    batch = random_rollouts(rows, width, seed=0, off_mask_rewards=True)
    rewards, values, mask, turn_ids = (batch[k] for k in ("rewards", "values", "response_mask", "turn_ids"))
    truncated = torch.arange(rows) % 2 == 0
    bootstrap = torch.randn(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    loop_turns = turn_ids if unit == "turn" else None
    next_values = torch.where(truncated, bootstrap, 0.0)

    def loop():
        returns = gae_loop(rewards, values, mask, GAMMA, LAM_CRITIC, turn_ids=loop_turns, next_values=next_values)[1]
        advantages = gae_loop(rewards, values, mask, GAMMA, LAM_POLICY, turn_ids=loop_turns, next_values=next_values)[0]
        return advantages, returns

    def scan():
        return gae(rewards, values, mask, GAMMA, LAM_CRITIC, LAM_POLICY, turn_ids=turn_ids, timestep_unit=unit,
                   truncated=truncated, bootstrap_values=bootstrap, off_mask_rewards="previous")

    scan()  # warm-up: first-call allocations
    scan_s, (advantages, returns) = median_time(scan, 10 * repeats)  # cheap: more calls, less noise
    loop_s, (loop_advantages, loop_returns) = median_time(loop, repeats)
    difference = max(float((advantages - loop_advantages).abs().max()), float((returns - loop_returns).abs().max()))
    return {"rows": rows, "width": width, "unit": unit, "response_tokens": int(mask.sum()),
            "loop_s": loop_s, "scan_s": scan_s, "ratio": loop_s / scan_s, "max_abs_difference": difference}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", default="8x65536,64x4096", help="ROWSxWIDTH, comma-separated")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the scan (the loop runs on one core; so, by default, does the scan)")
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    results = []
    for rows, width in shapes:
        for unit in ("token", "turn"):
            row = one_case(rows, width, unit, args.repeats)
            results.append(row)
            print(f"[{rows}, {width}] {unit:5s} loop {row['loop_s']:.3f} s  scan {row['scan_s'] * 1e3:.1f} ms  "
                  f"{row['ratio']:.0f}x  max |difference| {row['max_abs_difference']:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": args.repeats,
                       "gamma": GAMMA, "lam_critic": LAM_CRITIC, "lam_policy": LAM_POLICY, "results": results},
                      f, indent=1)
    for rows, width in shapes:
        cases = [r for r in results if (r["rows"], r["width"]) == (rows, width)]
        print(f"gae: [{rows}, {width}] " + ", ".join(
            f"{r['unit']} {r['loop_s']:.3f} s -> {r['scan_s']:.4f} s ({r['ratio']:.0f}x)" for r in cases))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
