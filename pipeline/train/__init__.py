"""A drafter's training run.  Imports ``core``, ``ops``, ``data``, ``dspark`` and ``stores``; no engine code.

    config.py        TrainConfig (jobs.train's flags), the drafter config it implies, the learning-rate schedule
    dataset.py       the held-out split, the data order of a step, the driver-side plan every worker receives
    step.py          one optimizer step's forward / backward over micro-batches
    heldout.py       held-out acceptance length in the middle of training
    metrics.py       metrics.jsonl, loss and learning-curve plots, the latest checkpoint
    trainer.py       Trainer: the one training loop, under Ray Train or in one process
    ray_train.py     the Ray Train launch (TorchTrainer, rendezvous and gloo on loopback)
    fsdp.py          the drafter sharded over the workers (FSDP2)
    local_stages.py  generation and extraction with transformers in the training process (--backend local)
"""
