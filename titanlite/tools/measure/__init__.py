"""Measuring a run: what a run cost, counted or timed while it runs or read from what it left.

    profiling         torch.profiler over chosen steps, and reading its traces
    flops, comm       FLOPs counted op by op; collectives counted, with their bytes
    host_syncs        where the host waits for the device, and why
    compile_report    graph breaks and recompiles of torch.compile
    data_loading      DataLoader workers and pinned memory, measured
    checkpoint_io     bytes each rank reads and writes for a checkpoint
    goodput           productive time against wall time, from a run's records
    stragglers        slow ranks, from their per-step ready times (a watcher)

May import the core only (a run's watchers among it)."""
