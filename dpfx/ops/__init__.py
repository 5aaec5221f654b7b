"""Every ``dpfx::`` operator, with its kernels and its fake (meta) implementation beside it.

Importing this package registers them all, so a graph that names one can be run, proven or
loaded whichever module built it: the noise (``noise``), the norms handed to the user
(``norms``), the loss's markers and gradient (``loss``) and the per-sample convolution products
(``conv``); ``native`` builds and loads the C kernels of ``csrc/``.
"""
from dpfx.ops import blocks, conv, loss, noise, norms  # noqa: E402,F401  (registration)
