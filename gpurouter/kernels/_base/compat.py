"""Import shims that must run before ``numba.cuda`` is imported anywhere.

Every kernel module imports this module first (``from . import _compat``).
"""

import numpy as np

# numba-cuda 0.30.4 registers ``overload(np.row_stack)`` when it compiles its
# first kernel; NumPy 2.5 removed ``np.row_stack``, so the first compile raises
# AttributeError.  Upstream will not fix it (numba-cuda is in maintenance
# mode: NVIDIA/numba-cuda issue #907, fix PR #916 closed unmerged).  The alias
# is exactly what NumPy < 2.5 had (``row_stack`` was ``vstack``), so it changes
# nothing for any other user of NumPy.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
