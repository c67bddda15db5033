"""persia_py: hybrid recommender training with embedding parameter servers.

Importing the package itself loads nothing heavy; import the submodules you use
(``persia_py.ctx``, ``persia_py.embedding.data``, ``persia_py.data``, ...).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
