"""DSpark, one concept per module (docs/dspark.md); the same modules serve training and inference.

    config.py           DrafterConfig: every shape and switch of a DSpark / DFlash drafter (§1-§4)
    drafter.py          DSparkDrafter: the parallel block backbone (§2), teacher-forced heads and block proposal
    markov_head.py      the sequential Markov logit-bias heads (§3)
    confidence_head.py  the confidence head and its soft label (§4)
    calibration.py      STS fit / apply, ECE / AUROC / Brier, online calibration (§4)
    draft_vocab.py      the reduced draft vocabulary (d2t / t2d)
    anchors.py          anchor sampling and block labels for training (§5)
    losses.py           the training losses (§4-§5)
    checkpoint.py       export / load in the vLLM / speculators checkpoint format (docs/checkpoint_format.md)
    target_weights.py   the target's frozen embedding and LM head the drafter shares

Imports ``core``, ``ops`` and ``data``; no engine, training or store code.
"""
