"""Resident memory after a load: glibc keeps freed heap pages for reuse; give them back to the OS."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    """The C library (find_library runs ldconfig in a subprocess: once), or None."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def return_freed_memory() -> None:
    """Loading frees about as much as it keeps (a checkpoint's tensors, decoded blocks, fused and re-laid-out
    copies), in blocks glibc's heap keeps for reuse (its mmap threshold rises after large frees, so later
    large buffers come from the heap); malloc_trim gives the free pages back (~260 MB of resident memory for
    SmolLM2 on the CPU). A no-op where the C library has no malloc_trim."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
