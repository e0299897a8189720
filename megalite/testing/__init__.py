"""Test support that ships with the package: the forked gloo world every multi-process test
runs in (:mod:`megalite.testing.world`) and the plain reference train step the equivalence
tests and benchmarks compare against (:mod:`megalite.testing.reference_step`)."""
from megalite.testing.world import WorldError, free_port, run_world  # noqa: F401
