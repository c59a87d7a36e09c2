"""Run torch's and vLLM's CPU kernels as an AVX2-only CPU would.

Issue 21's targets must hold on an AVX2-only machine too (an AMD EPYC seen
here, no AVX-512), which is not always the machine drawn. Put this folder
first on ``PYTHONPATH`` and every Python process started with it (the
profile, the server, its engine core and worker) runs the AVX2 builds:

    PYTHONPATH=scripts/avx2-only neuron-scheduler validate

* torch's own kernels: ``ATEN_CPU_CAPABILITY=avx2``;
* oneDNN and MKL (torch's matmuls): ``ONEDNN_MAX_CPU_ISA=AVX2``,
  ``MKL_ENABLE_INSTRUCTIONS=AVX2``;
* vLLM's CPU kernels: its CPU platform loads ``_C_AVX2`` where
  ``torch.cpu._is_avx512_supported()`` is false, so that (and the bf16 and
  AMX checks) is made to answer false.

It changes the instruction set only: the clock, caches and memory stay this
machine's, so it is a stand-in for the slower machine's kernels, not for the
machine. Variables already set are left as they are.
"""

import os

for _name, _value in (
    ("ATEN_CPU_CAPABILITY", "avx2"),
    ("ONEDNN_MAX_CPU_ISA", "AVX2"),
    ("DNNL_MAX_CPU_ISA", "AVX2"),
    ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
):
    os.environ.setdefault(_name, _value)

try:
    import torch.cpu
except ImportError:  # a process without torch (pip, a shell tool): nothing to do
    pass
else:
    for _check in (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ):
        if hasattr(torch.cpu, _check):
            setattr(torch.cpu, _check, lambda: False)
