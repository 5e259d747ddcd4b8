"""intqat's version, in a module of its own so that any module can read it without importing the package
(intqat/__init__.py imports convert, checkpoint, ...: importing `intqat` from them would be a cycle)."""

__version__ = "0.1.0"  # keep equal to pyproject.toml's [project] version (tests/test_install.py checks)
