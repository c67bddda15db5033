"""persia_py: hybrid recommender training with embedding parameter servers.

Importing the package itself loads nothing heavy; import the submodules you use
(``persia_py.ctx``, ``persia_py.embedding.data``, ``persia_py.data``, ...).
"""

from persia_py.ops.final_errors import install_from_environ as _install_from_environ

__version__ = "0.1.0"

# Every import of persia_py passes here: a user's script that persia-launcher started stops
# for good on a config error from any of persia_py's modules (persia_py/ops/final_errors.py).
_install_from_environ()

__all__ = ["__version__"]
