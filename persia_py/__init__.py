"""persia_py: hybrid recommender training with embedding parameter servers.

Importing the package itself loads nothing heavy; import the submodules you use
(``persia_py.ctx``, ``persia_py.embedding.data``, ``persia_py.data``, ...).
"""

import os as _os

__version__ = "0.1.0"

# Every import of persia_py passes here, so a user's script that persia-launcher started
# stops for good on a config error from any of its modules (persia_py/ops/final_errors.py);
# the variable's name is persia_py.env.ENV_FINAL_CONFIG_ERRORS, not imported: only such a
# process pays for the import.
if _os.environ.get("PERSIA_FINAL_CONFIG_ERRORS"):
    from persia_py.ops.final_errors import install_from_environ as _install

    _install()

__all__ = ["__version__"]
