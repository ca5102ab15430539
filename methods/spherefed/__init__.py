"""SphereFed with Fast Federated Calibration: a fixed classifier on L2-normalized features,
calibrated after training from sums the devices send (docs/spherefed.md)."""
