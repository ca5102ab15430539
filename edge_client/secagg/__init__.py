"""Secure aggregation (SecAgg+, Bell et al. 2020): the server learns the sum of the clients' vectors, not one of them.

The cryptographic core as pure functions over explicit state; docs/privacy.md says what
exists and what does not yet. :mod:`.protocol` holds the steps, :mod:`.messages` the
bodies they exchange and the round's parameters.
"""

from edge_client.secagg.errors import (DecryptionError, MessageError, ParamsError, RefusedError, RoundFailedError,
                                       SecAggError, ShareError)
from edge_client.secagg.messages import (Advertise, ForwardedShares, MaskedInput, PublicKeys, SecAggParams,
                                         ShareBundle, UnmaskRequest, UnmaskResponse)
from edge_client.secagg.protocol import (AggregateResult, ClientState, MaskedSum, advertise, aggregate,
                                         check_masked_input, check_share_bundle, check_unmask_response, collect_keys,
                                         masked_input, request_unmask, route_shares, share, unmask)

__all__ = ["SecAggError", "ParamsError", "MessageError", "ShareError", "DecryptionError", "RefusedError",
           "RoundFailedError", "SecAggParams", "Advertise", "PublicKeys", "ShareBundle", "ForwardedShares",
           "MaskedInput", "UnmaskRequest", "UnmaskResponse", "ClientState", "AggregateResult", "advertise", "share",
           "masked_input", "unmask", "collect_keys", "check_share_bundle", "route_shares", "check_masked_input",
           "MaskedSum", "request_unmask", "check_unmask_response", "aggregate"]
