"""Strategies: what each client does each round and how results combine (never the network).

Each method's strategy is named by its entry in :mod:`edge_client.registry` and built
by :func:`coordinator.strategy_setup.make_strategy`; the shared types are in :mod:`.base`.
"""
