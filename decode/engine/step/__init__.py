"""What runs under jit on the device: the compiled programs (programs), one decoding step per
method (steps, and verified for the verified method), token choice (sampling), the decode state's
pytrees (state) and constrained decoding inside the loop (guide, with host_guide: the host
parser asked through `io_callback` from the compiled step)."""
