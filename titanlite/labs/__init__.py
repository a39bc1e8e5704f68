"""Labs: the notebooks' experiments, one module per notebook (nb07_data_parallel.py is notebook
07's, and so on).

A lab measures a technique; it never implements one. The technique lives in the library
(`titanlite.distributed.fsdp`, `titanlite.resilience.checkpoint`, ...), and a lab builds a tiny
model, runs the technique on it - usually inside every rank of a `launch_function` job - and
returns plain, picklable numbers for the notebook to assert on. The tests run the same labs.

The dependency goes one way: labs import the library, the library never imports a lab
(tests/test_labs_layering.py walks every module to hold that). `_common.py` holds the few
pieces several labs share: joining the job, a seeded tiny model, random tokens, the
next-token loss, a reference AdamW loop and per-part progress reports.
"""
