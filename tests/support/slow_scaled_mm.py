"""A float8 host simulated on any host: with WEFT_SLOW_SCALED_MM=<seconds> set, every
`torch._scaled_mm` call sleeps that long first and is counted, so a run shows what a host whose
float8 matmuls are slow (one 512 x 256 x 256 call taking 1 s) would spend on them.

Installed when tests.support is imported: in the pytest process and in the ranks that
`run_distributed` starts (they import the test module, which imports tests.support). Processes
started as `python train.py` are not covered; no float8 test trains that way. Each call appends
one line to the file named by WEFT_SCALED_MM_LOG (conftest.py sets it and prints the count)."""

from __future__ import annotations

import os
import time

import torch

ENV, LOG_ENV = "WEFT_SLOW_SCALED_MM", "WEFT_SCALED_MM_LOG"


def install() -> None:
    seconds = float(os.environ.get(ENV) or 0)
    if not seconds or getattr(torch._scaled_mm, "_weft_slowed", False):
        return
    real = torch._scaled_mm

    def slow_scaled_mm(*args, **kwargs):
        time.sleep(seconds)
        if os.environ.get(LOG_ENV):
            with open(os.environ[LOG_ENV], "a") as log:
                log.write(f"{os.getpid()}\n")
        return real(*args, **kwargs)

    slow_scaled_mm._weft_slowed = True
    torch._scaled_mm = slow_scaled_mm


def calls_logged() -> int:
    path = os.environ.get(LOG_ENV)
    return sum(1 for _ in open(path)) if path and os.path.exists(path) else 0


def emulated_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """`torch._scaled_mm` computed in fp32 from the float8 operands and their scales, for tests that
    count float8 matmuls or run float8 plumbing rather than measure the kernel: a real one takes
    about a second on some CPUs this suite runs on."""
    out = (a.float() @ b.float()) * scale_a * scale_b
    return (out if bias is None else out + bias).to(out_dtype or torch.bfloat16)
