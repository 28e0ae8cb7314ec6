"""The CPU kernels: paged attention, linears, LoRA and the layer ops in C++ (csrc/, built on first use by
extension.py) and the torch / oneDNN paths beside them, each linear kernel timed per batch bucket on this
machine within its accuracy budget (linear.py). The engine reaches them through `kernels` only."""
