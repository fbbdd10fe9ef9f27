"""GPU kernels of the rollout engine, one op per module: ``paged_attention`` (KV write
and ragged causal attention over a paged cache) and ``sampling`` (Gumbel-max sampling
with a counter-based RNG). Each holds its Triton kernel, the checked wrapper, the
PyTorch reference and the dispatcher between them."""
