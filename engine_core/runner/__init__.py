"""Running one scheduled step on the device: the model runner builds the ragged batch and runs the model, the
sampler picks tokens from its per-step sampling metadata; beside them the KV cache's tensors, CUDA graphs for
decode steps, host-to-device copies and a step's output as the device produces it.
"""
