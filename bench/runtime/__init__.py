"""Benches of the onnxruntime runtime in process: the recurrence, the load-time check, CPU profiles, windows."""
