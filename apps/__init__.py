"""The programs on top of the libraries: ``planner profile | train | bench | demo | report`` and what only they need.

    apps.train        the reference trainer (train, auto_plan; TrainConfig in apps.train_config, the step in apps.steps)
    apps.cmd_train    `planner train` (arguments -> TrainConfig, torchrun set-up)
    apps.bench        `planner bench`: equal vs proportional vs plan vs re-plan vs ideal in one launch
    apps.demo         `planner demo`: profile -> plan -> train -> report as subprocesses with deadlines
    apps.cmd_profile  `planner profile`
    apps.cmd_report   `planner report`
    apps.checkpoint   atomic, data-only checkpoints of a training run
    apps.distenv      process-group set-up from torchrun's environment (or a FileStore), device per rank
    apps.launch       spawn N local ranks with a deadline, children killed on exit (the bench's launcher)

Layers read upward: planner (core) -> workloads -> profiler / runtime / reports -> apps.  Nothing below imports
``apps`` (tests/test_layers.py checks it).
"""

from __future__ import annotations
