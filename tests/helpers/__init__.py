"""What several test modules share: builders, golden runs, servers and trials the tests start.
Test modules import from here, never from one another (tests/test_layering.py)."""
