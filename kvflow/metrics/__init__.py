"""Instrumentation shared by the processes: the roofline estimate of a step's work,
the device's calibrated peaks, and the start-up phase timings."""
