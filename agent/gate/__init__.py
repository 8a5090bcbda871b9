"""The gate: the certificate and its calibration, the threshold τ, the evicted-key sketch signal, and the decision to
re-read."""
