"""What a central-DP run file's epsilon is, given how its rounds were really drawn.

The privacy matrix's runs drew exactly ``clients.per_round`` devices a round, seeded by the run's seed (today's
``privacy.sampling = "seeded"``), and reported the account of Poisson sampling at q (RDP). Every task carries the
seed, so any device can recompute who took part in every round: no amplification by sampling holds against the
devices. This module replays a run's draws with the coordinator's own sampler, counts each device's rounds and
accounts them three ways (coordinator/privacy_account.py):

- ``seeded``: the draw as it ran, public: each device composes one Gaussian of multiplier z per round it was drawn
  in, and the run's epsilon is its most-drawn device's;
- ``fixed``: what the same fixed-size draw would have given had it been secret (replace-one);
- ``poisson``: what Poisson sampling at q gives, the account the rows carry (RDP) and its PLD figure.

    python bench/privacy_draws.py bench/results/privacy/f100-a0.5-e1-s0-r100.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from coordinator.config import load_config  # noqa: E402
from coordinator.ops.spawn import sim_client_id  # noqa: E402
from coordinator.privacy_account import CentralAccount  # noqa: E402
from coordinator.runtime.round_times import RoundTimes  # noqa: E402
from coordinator.runtime.selection import Absences, Sampler  # noqa: E402

__all__ = ["replayed_participations", "run_accounts"]


def replayed_participations(seed: int, expected: int, per_round: int, rounds: int) -> Counter[str]:
    """Device id -> rounds it was drawn in, by the seeded sampler the run used (every device online, first attempt,
    none benched: what the run files' ``selected`` column shows for the privacy matrix)."""
    config = load_config(None, [("run", "seed", seed), ("clients", "expected", expected),
                                ("clients", "per_round", per_round), ("clients", "max_attempts", 1),
                                ("privacy", "mode", "central"), ("privacy", "sampling", "seeded")])
    sampler = Sampler(config, Absences(0), RoundTimes())
    online = [sim_client_id(i) for i in range(expected)]
    counts: Counter[str] = Counter()
    for round in range(1, rounds + 1):
        counts.update(sampler.draw(online, round, 0).clients)
    return counts


def run_accounts(record: dict[str, Any]) -> dict[str, Any] | None:
    """The run's epsilon under each draw, from its recorded configuration and rows; None without central DP or
    when its rows do not show full fixed-size rounds (the replay would not be the draw that ran)."""
    config = record["config"]
    privacy, clients = config.get("privacy", {}), config.get("clients", {})
    if privacy.get("mode") != "central" or privacy.get("sampling") not in (None, "fixed", "seeded"):
        return None
    trained = [r for r in record["rows"] if r.get("round", 0) > 0 and "dp_epsilon" in r]
    n, m = int(clients["expected"]), int(clients["per_round"])
    if not trained or any(r.get("selected") != m for r in trained):
        return None
    z, delta, rounds = float(privacy["noise_multiplier"]), float(privacy["delta"]), len(trained)
    counts = replayed_participations(int(config["run"]["seed"]), n, m, rounds)
    most = max(counts.values())

    def account(sampling: str, accountant: str, k: int) -> float:
        return CentralAccount(sampling, m / n, n, accountant).epsilon(k, z, delta)

    return {"rounds": rounds, "noise_multiplier": z, "delta": delta, "sampling_rate": m / n,
            "quoted": trained[-1]["dp_epsilon"],
            "max_participations": most, "devices_drawn": len(counts),
            "seeded": {"pld": account("seeded", "pld", most), "rdp": account("seeded", "rdp", most)},
            "fixed": {"pld": account("fixed", "pld", rounds), "rdp": account("fixed", "rdp", rounds)},
            "poisson": {"pld": account("poisson", "pld", rounds), "rdp": account("poisson", "rdp", rounds)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_files", nargs="+", type=Path, help="run files of bench/run_matrix.py")
    args = parser.parse_args()
    for path in args.run_files:
        accounts = run_accounts(json.loads(path.read_text()))
        if accounts is None:
            print(f"{path}: not a central-DP run of full fixed-size rounds")
            continue
        print(f"{path.name}: quoted {accounts['quoted']:.3f}; seeded draw as run (device drawn "
              f"{accounts['max_participations']} of {accounts['rounds']} rounds) PLD {accounts['seeded']['pld']:.3f} "
              f"RDP {accounts['seeded']['rdp']:.3f}; secret fixed draw PLD {accounts['fixed']['pld']:.3f}; "
              f"Poisson PLD {accounts['poisson']['pld']:.3f} RDP {accounts['poisson']['rdp']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
