"""The decoding engine: plain and speculative decoding of a batch of requests, one round at a time.  Imports
``core``, ``ops``, ``data`` and ``dspark``; never training, evaluation or store code.

    engine.py             SpeculativeEngine: requests, rounds (draft -> schedule -> one target forward -> verify)
    target_runner.py      TargetRunner: the target's forward over a ragged batch with its KV cache
    scheduler.py          verification-depth schedulers: fixed, threshold, Algorithm 1 (the paper's), async
    cost_table.py         the SPS(B) cost table the load-aware schedulers price with, profiled once and cached
    rejection_sampler.py  lossless verification (greedy, token-wise, block)
    cuda_graphs.py        fixed-shape forwards replayed as CUDA graphs (GPU)
"""
