"""DSpark speculator pipeline: the library, importable and testable without a Ray cluster.

One subpackage per concern, each importing only the floors below it (tests/test_layering.py checks it):

    core/     runtime environment (loopback, offline), locks and atomic writes, config dataclasses on the command line
    ops/      numerical building blocks: RMSNorm / RoPE, the CPU linear back ends and kernels, sampling
    data/     prompts, response shards, subsets, the target model's folder
    dspark/   the drafter: config, model, heads, losses, calibration, checkpoint (training and inference alike)
    stores/   hidden-state stores: disk (Parquet) and Mooncake
    engine/   the decoding engine: target runner, schedulers and the SPS cost table, rejection sampler
    train/    the training run: config, data order, one step, held-out measurements, the trainer, Ray Train
    eval/     evaluation and the STS calibration rollouts
    launch/   what a job launches: engine layouts, placement, the recipe's budget plan

Outside it, imports flow one way: jobs -> serve_app / actors -> pipeline.
"""
