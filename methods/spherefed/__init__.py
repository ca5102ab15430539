"""SphereFed with Fast Federated Calibration: a fixed classifier on L2-normalized features, calibrated after training (docs/spherefed.md)."""
