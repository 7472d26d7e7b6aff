"""Setup shared by the Triton kernel tests: the kernels run in Triton's interpreter on CPU tensors, on one torch
thread. Import this module before triton, torch or kernels (`from tests.kernelfixture import single_thread`).
"""

import os

# Before triton is imported: the kernels are decorated in interpreter mode. Only CPU tensors reach them here, and
# CPU tensors never reach a kernel elsewhere, so this setting changes nothing for other tests in the process.
os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.threadfixture import single_thread  # noqa: E402,F401  (re-exported: the kernel tests use it by name)
