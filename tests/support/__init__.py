"""Plain helpers shared by several test modules: builders and validators, no tests, no fixtures.

Fixtures live in the nearest common `conftest.py`; test modules import helpers
from here, never from one another.
"""
