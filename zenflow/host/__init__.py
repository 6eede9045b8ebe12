"""The other side of the bus: host buffers in one shared arena, the copies to and from the device
(`transfers`, the one CUDA seam), the worker process that sums gradients and runs the host AdamW,
and the pipeline that drives them for the optimizer."""
