"""OpRAG server package.

Importing it asks Intel MKL (the BLAS inside PyTorch's CPU build) for strict conditional
numerical reproducibility (``MKL_CBWR=AUTO,STRICT``) unless ``MKL_CBWR`` is already set: MKL reads
the variable at its first call, and in strict mode a GEMM row's bits do not depend on the
matrix's row count or the thread count, which the CPU encoder needs to embed a text to the same
bits alone or batched (:mod:`oprag_server.models.encoder`).
"""

import os as _os

_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
