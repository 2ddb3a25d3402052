"""Framework adapters: a plan applied to Lightning's Trainer, an Accelerate loop or the HF Trainer in a few lines.

    runtime.adapters.lightning    LightningPlan: a DDPStrategy subclass (planned training DataLoader through
                                  ``process_dataloader``, exact loss scale in ``backward``) and a Callback
                                  (epoch shuffle, timing, re-planning and the run log at epoch ends)
    runtime.adapters.accelerate   planned_dataloader: accelerate's own DataLoaderShard over the planned sampler,
                                  left alone by ``accelerator.prepare``; ``loader.loss_scale()`` for
                                  ``accelerator.backward``; timing, re-planning and the run log at each epoch end
    runtime.adapters.hf           planned_trainer: a Hugging Face Trainer (any subclass) whose training loader is the
                                  planned sampler's (never re-sharded by accelerate), with exact token-mean weighting
                                  (one scalar all-reduce per optimizer step), timing, re-planning and the run log
    runtime.adapters.ray          planned_dataloader / planned_epoch (RayPlan): inside a Ray Train
                                  ``train_loop_per_worker``, a planned loader that ``prepare_data_loader`` keeps, the
                                  weighting hook on ``prepare_model``'s DDP, PlannedRun's epochs; auto mode
                                  (``profile_fn``) profiles and plans in the workers, again for a group of another size
    runtime.run                   PlannedRun: the runtime protocol they (and own loops, and `planner train`) run on

The frameworks are optional and imported only when an adapter is used; a missing one is one ValidationError line
naming ``pip install ddp-planner[lightning]`` / ``[accelerate]`` / ``[hf]`` / ``[ray]``.  docs/FRAMEWORKS.md shows the 5-line changes.
"""

from __future__ import annotations

from runtime.run import PlannedRun

__all__ = ["PlannedRun"]
