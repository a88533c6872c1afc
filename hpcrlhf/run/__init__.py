"""The run folder (`--output-dir`) and what keeps it safe: everything a job writes besides its models'
own files goes through this package.

    folder.py      `Run`: checks and prepares the folder, resume, metrics, timings, stop requests,
                   checkpoints and the summary -- what every trainer does around its own maths
    lock.py        `run.lock`: one job per folder, a dead owner's lock taken over
    checkpoint.py  `checkpoints/step_N`: staged, committed with a manifest, `latest`, kept/pruned
    metrics.py     `metrics.jsonl` (and TensorBoard), read back on resume
    stats.py       metrics as (sum, count) pairs, summed over micro-batches, workers and ranks
    guard.py       the NaN/Inf guard: a step's non-finite loss or inputs skipped or stopping the run
    signals.py     stop requests (SIGTERM, SIGUSR1 at a time limit, Ctrl-C) turned into a flag
    diskspace.py   a full disk reported as an error that names the folder and the space needed
    files.py       writes that never follow a planted link and never leave half a file
    usercode.py    deadlines for the user's code (reward rules, eval metrics)

Who writes what: the main rank writes `config.yaml`, `environment.jsonl`, `metrics.jsonl`,
`summary.json` and commits checkpoints; every rank writes its own part of a checkpoint.
"""
