"""FedMA: layer-wise matched averaging with a global model that may grow (docs/fedma.md)."""
