"""Launching jobs: processes started, watched, stopped and restarted for a notebook cell or the
command line.

    launcher      torchrun from a cell: `launch(cfg, nproc=...)`, `launch_function(fn, nproc=...)`
    forkserver    a warm parent with torch imported that forks a job's ranks in a second
    run_function  the entry of a rank that runs a function (the labs' experiments)
    worker_errors a failing rank's traceback, written for the launcher to show
    hpo           Optuna's trials over the trainer, each a run or a job

May import the core, `display` (a notebook's quiet imports) and `formats` (a Hugging Face start is
checked before any process starts)."""
