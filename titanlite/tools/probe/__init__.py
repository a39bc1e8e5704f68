"""Probing the machine: what this device, its host and its vendor's datasheet can do.

    matmul_peak       the measured matmul peak for MFU: timed, cached, re-measured when beaten
    roofline          memory bandwidth and the roofline
    datasheet, vendors  published peaks per device and dtype; GPUs, links and topology
    precision_support which dtypes and mixed-precision modes work here, tried
    cpu, mps          a CPU's features, threads and memory; what Apple's MPS supports

May import the core and `predict` (cpu compares measured memory with the predicted bytes)."""
