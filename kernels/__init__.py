"""Triton kernels, each beside the plain torch twin it is tested against; imported as endo_retrieval.kernels.*"""
