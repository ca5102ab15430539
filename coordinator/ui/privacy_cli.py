"""``fedge-coordinator privacy``: the noise multiplier a target epsilon needs, before a run (coordinator.privacy)."""

from __future__ import annotations

import argparse
import sys

from edge_client.argcheck import at_least, positive

__all__ = ["add_command"]


def add_command(sub, name: str = "privacy") -> None:  # sub: the parser's subparsers
    cmd = sub.add_parser(
        name, help="the noise multiplier that keeps a run within a target epsilon (central DP)",
        description="Print privacy.noise_multiplier for a run of --rounds rounds drawing --per-round of --expected "
                    "devices each round, so that its account (dp_accounting's RDP accountant, as the run keeps it) "
                    "ends at --epsilon at --delta, and the noise on the mean per unit of clip norm (z / per-round). "
                    "docs/privacy.md says what the epsilon covers and what it assumes.")
    cmd.add_argument("--epsilon", type=positive, required=True, action="append",
                     help="target epsilon (repeatable: one line each)")
    cmd.add_argument("--rounds", type=at_least(1), required=True, help="training rounds of the run")
    cmd.add_argument("--per-round", type=at_least(1), required=True, help="clients.per_round")
    cmd.add_argument("--expected", type=at_least(1), required=True, help="clients.expected: the devices that can be drawn")
    cmd.add_argument("--delta", type=positive, default=1e-5, help="privacy.delta (default 1e-5)")
    cmd.set_defaults(handler=_privacy)


def _privacy(args: argparse.Namespace) -> int:
    from coordinator.privacy import noise_for_epsilon

    if args.per_round > args.expected:
        print("fedge-coordinator privacy: --per-round cannot exceed --expected", file=sys.stderr)
        return 2
    if not args.delta < 1:
        print("fedge-coordinator privacy: --delta must be below 1 (1e-5 is usual: below 1 / number of devices)",
              file=sys.stderr)
        return 2
    q = args.per_round / args.expected
    print(f"{args.rounds} rounds, {args.per_round} of {args.expected} devices a round (q = {q:g}), delta {args.delta:g}:")
    for epsilon in args.epsilon:
        z = noise_for_epsilon(epsilon, rounds=args.rounds, sampling_rate=q, delta=args.delta)
        print(f"  epsilon {epsilon:g}: privacy.noise_multiplier = {z:.4g}  (noise on the mean: {z / args.per_round:.4g} "
              "x the clip norm per coordinate)")
    return 0
