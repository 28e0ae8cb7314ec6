"""The Triton kernels: paged attention, the KV-cache write, the fused layer ops and LoRA, on a CUDA GPU or in
Triton's CPU interpreter (TRITON_INTERPRET=1, as CI runs them). The engine reaches them through `kernels`."""

from kernels.compile_watch import install_triton_hook

install_triton_hook()  # before any kernel here compiles: the engine's compile monitor hears of each one
