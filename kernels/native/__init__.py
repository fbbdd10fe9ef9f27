"""The CPU sampler's RNG in C++ (gumbel.cpp), built by `make install`
(services/rollout/drafter/native/build.py --target gumbel) into libgumbel.so, which
kernels/gumbel_native.py loads."""
