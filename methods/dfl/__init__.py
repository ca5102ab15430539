"""Disentangled FL: an invariant branch averaged, a specific branch and a predictor kept on
each device (docs/dfl.md)."""
