"""Numerical building blocks shared by the drafter and the target runner; imports only ``core``.

    layers.py         RMSNorm, RoPE, the full-vocabulary logsumexp of an LM head
    sampling.py       SamplingParams and the probability shaping (temperature, top-k, top-p) both sides sample with
    packed_linear.py  the CPU linear back ends (oneDNN pre-packed weights, MKL, hybrid) and their choice
    small_m_linear.py the small-M AVX2 fp32 linear kernel (kernels/small_m_linear.cpp)
    extensions.py     how a C++ kernel is built once and loaded without a lock
    hugepages.py      weights in one block backed by transparent huge pages
"""
