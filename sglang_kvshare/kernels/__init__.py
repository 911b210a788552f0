"""Triton kernels, each with a torch reference beside it and a dispatcher (Triton on CUDA only).

(A top-level ``kernels`` package would collide with the ``kernels`` distribution SGLang installs.)
"""
