"""Secure aggregation (SecAgg+, Bell et al. 2020): the server learns the sum of the clients' vectors, not one of them.

The cryptographic core as pure functions over explicit state; docs/privacy.md says what
exists and what does not yet. :mod:`.protocol` holds the steps, :mod:`.messages` the
bodies they exchange.
"""
