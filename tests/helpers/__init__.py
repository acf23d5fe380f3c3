"""What the tests share: real git repositories, the real command, the small trainers, the
composed config, the trainer's own runs and the mesh-equivalence harness. Fixtures that wrap
these live in tests/conftest.py; test modules import from here, never from one another."""
