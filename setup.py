"""Build shim. All metadata lives in pyproject.toml; this file exists so that `pip wheel .` works with older
front ends and to keep the wheel pure (no GPU probing, no compiled extensions at install time)."""
from setuptools import setup

setup()
