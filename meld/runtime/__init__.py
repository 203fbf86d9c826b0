"""Runtime: device buffers, kernel launch, and the CPU reference executor."""
