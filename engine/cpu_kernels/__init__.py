"""C++ kernels for the CPU path, where torch's own are far from the machine's limit (bench/README.md,
"The bf16 GEMM kernel against oneDNN on cold weights", "Decode step against the roofline bound").

Each kernel is one C++ file here, compiled on first use with the system's C++ compiler into the spindle
cache (engine/cpu_kernels/build.py) and called through ctypes, which releases the GIL. When a kernel
cannot run (no compiler, a CPU without the instructions it needs, SPINDLE_CPU_KERNELS=0, a failed
self-check), callers keep torch's path: the kernels change speed, never results.
"""
