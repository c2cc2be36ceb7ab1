"""DSpark speculator pipeline: the library (model, data stages, training, calibration, decoding engine).

Importable and testable without a Ray cluster.  Import order is one-way: jobs -> serve_app / actors -> pipeline.
"""
