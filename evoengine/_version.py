"""evoengine's version, in a module of its own that imports nothing, so that any module can
record it without importing the package (which would be an import cycle for the modules
that ``evoengine/__init__.py`` imports, even lazily)."""

from __future__ import annotations

__version__ = "0.1.0"
