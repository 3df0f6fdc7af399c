"""XLA reference implementations of the kernels (the fallback and the test oracle of kernels/cpu and kernels/pallas)."""
