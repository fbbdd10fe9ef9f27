"""Developer entry points: `make run`'s driver (local_run.py) and its summary.

The top of the import graph: devtools may import services, benchmarks and the SDK's
example scripts; services and benchmarks never import devtools, so the services ship
without the tooling that drives them (tests/test_import_direction.py checks both).
"""
