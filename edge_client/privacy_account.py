"""Privacy accounting that both ends keep: ``dp_accounting``'s RDP accountant over the events a run releases.

The coordinator accounts its rounds (:mod:`coordinator.privacy`); a device under local differential privacy
keeps its own account of what it sent (:mod:`edge_client.privacy_budget`), so that it need not believe the
coordinator's. Both read epsilon from here, so the two figures are the same computation. ``dp_accounting``
is imported only when an account is asked for: a device without a budget never needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["rdp_epsilon", "local_event", "MISSING_ACCOUNTANT"]

MISSING_ACCOUNTANT = ("privacy accounting needs the dp-accounting package: pip install dp-accounting (it comes with "
                      "pip install 'fedge[coordinator]' or 'fedge[private-client]')")


class _QuietOrders(logging.Filter):
    """dp_accounting warns (through absl) for every fractional RDP order whose series does not converge, and
    leaves that order out of the minimum: nothing is wrong, and it would say so on every round."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_QuietOrders())


def rdp_epsilon(event: Any, delta: float) -> float:
    """Epsilon at ``delta`` of a ``dp_accounting`` event, by the RDP accountant every account here keeps."""
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant()
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


def local_event(participations: Mapping[float, int]) -> Any:
    """One device's releases under local DP, ``{noise multiplier z: how many releases at it}``.

    Each release is its clipped update (norm at most C) plus N(0, (z C)^2); for any change of its data
    (replace-one: two updates within C are up to 2C apart) that is a Gaussian mechanism of multiplier
    z C / 2C = z / 2. No sampling is claimed: whoever sent the task knows who took part.
    """
    import dp_accounting

    events = [dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z / 2), count)
              for z, count in sorted(participations.items()) if count > 0]
    return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)
