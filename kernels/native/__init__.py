"""The CPU worker's compiled kernels, C++17 behind flat C ABIs, built by `make install`
(services/rollout/drafter/native/build.py --target gumbel|attention): the sampler's RNG
(gumbel.cpp -> libgumbel.so, loaded by kernels/gumbel_native.py) and the paged
attention's passes over the KV cache (attention.cpp -> libattention.so, loaded by
kernels/paged_attention_native.py)."""
