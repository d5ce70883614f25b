"""OpRAG server package.

Importing it asks Intel MKL (the BLAS inside PyTorch's CPU build) for strict conditional
numerical reproducibility (``MKL_CBWR=AUTO,STRICT``) unless ``MKL_CBWR`` is already set: MKL reads
the variable at its first call, and in strict mode a GEMM row's bits do not depend on the
matrix's row count or the thread count, which the CPU encoder needs to embed a text to the same
bits alone or batched (:mod:`oprag_server.models.encoder`). The mode is process-wide: it cost
the in-process CPU generator ~12 % CPU per token at batch 1 (none measurable at batch 4);
``MKL_CBWR=AUTO`` set beforehand opts out.
"""

import os as _os

_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
