"""Apps fedge ships: its own networks and data sets, declared through the same interface as a user's."""
