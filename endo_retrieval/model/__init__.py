"""The local language model and what ships for it: the backbone that reads text the way the papers need,
its CUDA-graph chunk forward and decoding, the sparse autoencoders on its key projections, and the per-model
profiles."""
