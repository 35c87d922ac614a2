"""Fitting a model to the product: SAE training, the retrieval heads, ILRe's layer, the pipeline's settings,
zero-label tasks, and `endo prepare`, which runs them all."""
