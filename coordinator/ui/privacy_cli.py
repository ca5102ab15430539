"""``fedge-coordinator privacy``: the noise multiplier a target epsilon needs, before a run (coordinator.privacy)."""

from __future__ import annotations

import argparse
import sys

from coordinator.privacy_account import DEFAULT_SAMPLING, SAMPLINGS, CentralAccount
from coordinator.privacy_noise import OVERRIDE_KEY, REFUSE_RATIO, WARN_RATIO, NoiseOnMean
from edge_client.argcheck import at_least, positive
from edge_client.privacy_account import ACCOUNTANTS, DEFAULT_ACCOUNTANT

__all__ = ["add_command"]


def add_command(sub, name: str = "privacy") -> None:  # sub: the parser's subparsers
    cmd = sub.add_parser(
        name, help="the noise multiplier that keeps a run within a target epsilon (central or local DP)",
        description="Print privacy.noise_multiplier so that the run's account (dp_accounting's PLD or RDP "
                    "accountant, --accountant, as the run keeps it) ends at --epsilon at --delta. Central DP "
                    "(--mode central): a run of --rounds rounds drawing --per-round of --expected devices each round "
                    "as --sampling draws them; it also prints the noise on the mean per unit of clip norm "
                    "(z / per-round) and what that does at this fleet size: from 0.1 a run refuses it, from 0.02 it "
                    "warns. Under --sampling seeded nothing is amplified and the account is a device's: "
                    "--rounds is then the most rounds one device may be drawn in (all of them, to be safe). Local DP "
                    "(--mode local): a device that takes part in --participations rounds; the noise each device adds "
                    "has std z x the clip norm. docs/privacy.md says what the epsilon covers and what it assumes.")
    cmd.add_argument("--epsilon", type=positive, required=True, action="append",
                     help="target epsilon (repeatable: one line each)")
    cmd.add_argument("--mode", choices=("central", "local"), default="central", help="privacy.mode (default central)")
    cmd.add_argument("--rounds", type=at_least(1), help="central: training rounds of the run")
    cmd.add_argument("--per-round", type=at_least(1), help="central: clients.per_round")
    cmd.add_argument("--expected", type=at_least(1), help="central: clients.expected: the devices that can be drawn")
    cmd.add_argument("--participations", type=at_least(1),
                     help="local: rounds one device takes part in (at most run.rounds; about run.rounds x "
                          "clients.per_round / clients.expected on average with random selection)")
    cmd.add_argument("--release-noise", type=positive, metavar="Z", action="append", default=[],
                     help="central: the noise multiplier of one more release with every device in it (q = 1), such "
                          "as a method's calibration pass over all devices (repeatable: one per release); prints "
                          "what the releases alone cost and composes them into the account (docs/privacy.md)")
    cmd.add_argument("--delta", type=positive, default=1e-5, help="privacy.delta (default 1e-5)")
    cmd.add_argument("--accountant", choices=ACCOUNTANTS, default=DEFAULT_ACCOUNTANT,
                     help=f"privacy.accountant: pld (tighter) or rdp (default {DEFAULT_ACCOUNTANT})")
    cmd.add_argument("--sampling", choices=SAMPLINGS, default=DEFAULT_SAMPLING,
                     help=f"central: privacy.sampling, how rounds are drawn (default {DEFAULT_SAMPLING}): poisson and "
                          "fixed are secret draws that amplify, fixed under replace-one; seeded is public and does not")
    cmd.set_defaults(handler=_privacy)


def _refuse(message: str) -> int:
    print(f"fedge-coordinator privacy: {message}", file=sys.stderr)
    return 2


def _privacy(args: argparse.Namespace) -> int:
    from coordinator.privacy import local_noise_for_epsilon

    if not args.delta < 1:
        return _refuse("--delta must be below 1 (1e-5 is usual: below 1 / number of devices)")
    if args.mode == "local":
        if args.participations is None or any(v is not None for v in (args.rounds, args.per_round, args.expected)):
            return _refuse("--mode local takes --participations (rounds one device takes part in), "
                           "not --rounds, --per-round or --expected")
        print(f"local DP, {args.participations} participations per device, delta {args.delta:g}, "
              f"{args.accountant.upper()}:")
        for epsilon in args.epsilon:
            z = local_noise_for_epsilon(epsilon, participations=args.participations, delta=args.delta,
                                        accountant=args.accountant)
            print(f"  epsilon {epsilon:g}: privacy.noise_multiplier = {z:.4g}  (noise on each device's update: "
                  f"{z:.4g} x the clip norm per coordinate)")
        return 0
    if args.release_noise and args.mode != "central":
        return _refuse("--release-noise is for --mode central")
    if None in (args.rounds, args.per_round, args.expected) or args.participations is not None:
        return _refuse("--mode central takes --rounds, --per-round and --expected, not --participations")
    if args.per_round > args.expected:
        return _refuse("--per-round cannot exceed --expected")
    q = args.per_round / args.expected
    account = CentralAccount(args.sampling, q, args.expected, args.accountant)
    releases = [float(z) for z in args.release_noise]
    extra = ""
    if releases:
        alone = account.epsilon(0, 1.0, args.delta, releases)
        zs = ", ".join(f"{z:g}" for z in releases)
        extra = f" and {len(releases)} release(s) of every device at z = {zs}"
        print(f"{len(releases)} release(s) of every device (q = 1) at z = {zs}, alone: epsilon {alone:.4g} "
              f"at delta {args.delta:g}")
    print(f"{args.rounds} rounds, {args.per_round} of {args.expected} devices a round (q = {q:g}){extra}, "
          f"delta {args.delta:g}; {account.describe()}:")
    for epsilon in args.epsilon:
        try:
            z = account.noise_for(epsilon, args.rounds, args.delta, releases)
        except ValueError as exc:
            print(f"  epsilon {epsilon:g}: out of reach: {exc}")
            continue
        print(f"  epsilon {epsilon:g}: privacy.noise_multiplier = {z:.4g}  (noise on the mean: {z / args.per_round:.4g} "
              "x the clip norm per coordinate)")
        print(f"    {_noise_verdict(NoiseOnMean(z, 1.0, args.per_round, q), account, args, releases)}")
    return 0


def _noise_verdict(noise: NoiseOnMean, account: CentralAccount, args: argparse.Namespace,
                   releases: list[float]) -> str:
    """What that noise does at --per-round devices a round, by the thresholds a run applies
    (coordinator/privacy_noise.py), and what would bring it down."""
    at = f"at {args.per_round} devices a round, {noise.ratio:.4g} x C"
    if noise.level == "small":
        return f"{at}: {noise.verdict()}"
    way_out = noise.way_out(lambda z: account.epsilon(args.rounds, z, args.delta, releases),
                            REFUSE_RATIO if noise.level == "swamps" else WARN_RATIO)
    refused = f"; a run refuses it unless {OVERRIDE_KEY} = true" if noise.level == "swamps" else ""
    return f"{at}: {noise.verdict()}{refused}. To bring it down: {way_out}"
