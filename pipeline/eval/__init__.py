"""Measuring drafters.  Imports everything below it (the engine included), nothing above.

    evaluation.py    tau, per-position acceptance, calibration and speed against the fastest plain decoder
    sts_rollouts.py  engine rollouts on held-out prompts for Sequential Temperature Scaling
"""
