"""The notebook's display: what a learner sees in JupyterLab.

    notebook          a notebook's first cell (`notebook_setup`): quiet imports, one-line errors
    live_plot         loss, tokens/s and MFU drawn live while a run (or a job) trains
    pipeline_timeline a pipeline schedule's per-rank Gantt chart

May import the core only."""
