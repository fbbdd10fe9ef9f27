"""The compiled drafter core: histo.cpp behind the flat C interface of histo.h, built by
build.py (`make install`) into libhisto.so, which services/rollout/drafter/compiled.py loads."""
