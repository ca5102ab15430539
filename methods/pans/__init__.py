"""Position-aware neurons (PANs): a model option any strategy trains with (docs/pans.md)."""
