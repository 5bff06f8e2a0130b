"""Keep freed host memory mapped for reuse (glibc's allocator), so a step's large tensors do not
page-fault afresh every step.

A decode step allocates and frees tensors of megabytes: the logits (batch x vocabulary x 4 bytes,
12.6 MB at 64 rows of a 49k vocabulary), the sampler's float32 copy, probabilities and running
sums, prefill activations. glibc serves a block above its mmap threshold with a fresh mapping
and unmaps it on free (the threshold only rises to the largest size freed so far), and it gives
the top of its heap back to the kernel once more than the trim threshold is free there. Either
way the next step touches new pages, and every 4 KiB page is a fault: measured on a 2-vCPU KVM
guest, a 25 MB float64 ``cumsum`` of a batch of 64 took 11-22 ms inside an engine step against
~3 ms with its memory reused.

Once the model and the KV cache are in place (their allocations are done, so their layout is
unchanged), the worker raises both thresholds: blocks up to glibc's ceiling of 32 MiB come from
the heap, and a free heap top is kept up to 1 GiB. The process then holds its steps' high-water
mark of host memory, as a CUDA caching allocator holds device memory. The setting is the whole
process's and stays for its life: with the offline ``LLM`` API that is the user's own process.
glibc's own tunables in the environment (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``GLIBC_TUNABLES`` naming ``glibc.malloc``) are left as the user set them;
``PAGEDLLM_KEEP_FREED_MEMORY=0`` turns this off.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

from pagedllm import envs

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2): larger blocks are always mapped.
MMAP_THRESHOLD_MAX = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module docstring); False
    where it does not apply (not glibc, turned off, or the user set glibc's tunables)."""
    if not envs.enabled("PAGEDLLM_KEEP_FREED_MEMORY"):
        return False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    if (
        envs.get("MALLOC_MMAP_THRESHOLD_")
        or envs.get("MALLOC_TRIM_THRESHOLD_")
        or "glibc.malloc" in envs.get("GLIBC_TUNABLES")
    ):
        return False
    libc = ctypes.CDLL(None)
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if ok:
        logger.debug("host allocator: blocks up to 32 MiB from the heap, up to 1 GiB of free heap kept")
    else:
        logger.warning("mallopt refused the allocator thresholds; freed host memory goes back to the kernel")
    return ok
