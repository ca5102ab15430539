"""What central DP's noise on the mean, z / m x the clip norm, does to a small fleet's training on digits.

Short real runs (in-process devices, FedAvg, the coordinator's test split), one per ratio z / m: m devices, every
one in every round, clip norm 1, z = ratio x m. The noise comes from the OS's entropy, so a second sweep gives
other figures of the same size. What docs/privacy.md ("How much noise a fleet can take") quotes came from

    python bench/privacy_fleet_noise.py --model mlp --ratios 0.001 0.01 0.03 0.1
    python bench/privacy_fleet_noise.py --model cnn --ratios 0.01 0.03 0.1 0.3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from coordinator.config import load_config  # noqa: E402
from coordinator.runtime.run import run_federated  # noqa: E402
from coordinator.runtime.run_error import RunError  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.01, 0.03, 0.1])
    args = parser.parse_args()
    for ratio in args.ratios:
        with tempfile.TemporaryDirectory() as out:
            sets = {"run.rounds": args.rounds, "run.out": out, "model.name": args.model, "data.eval": "digits",
                    "clients.expected": args.devices, "clients.spawn": args.devices, "clients.max_attempts": 1,
                    "transport.kind": "inproc", "export.enabled": False, "privacy.mode": "central",
                    "privacy.clip_norm": 1.0, "privacy.noise_multiplier": ratio * args.devices,
                    "privacy.allow_swamping_noise": True}
            config = load_config(None, [(*k.split(".", 1), v) for k, v in sets.items()])
            ended = ""
            try:
                run_federated(config, say=lambda s: None)
            except RunError as exc:   # every device diverged on the noisy model: the rounds before it are kept
                ended = f"; ended: {str(exc)[:80]}..."
            rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        accuracy = " ".join(f"{r['test_accuracy']:.3f}" for r in rows if "test_accuracy" in r)
        answered = " ".join(str(r["returned"]) for r in rows[1:])
        print(f"{args.model} z/m {ratio:g}: test accuracy by round (0 first) {accuracy}; results a round "
              f"{answered}{ended}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
