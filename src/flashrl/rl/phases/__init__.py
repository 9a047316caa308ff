"""One RL step as its phases, in the order `Trainer.train_step` calls them.

- ``generate``: the step's prompts and the rollout backend's responses (`Generator`, one step
  ahead with async rollouts) -> `Generated`;
- ``score``: rewards (task score + overlong penalty), group advantages and the dynamic-sampling
  keep mask -> `Scored`;
- ``update``: the trainer's logprobs of the kept rows, the rollout correction and the policy update
  (`Learner`, `ppo_update`) -> `Updated`;
- ``weight_update``: the updated weights into the rollout backend or workers -> `WeightUpdate`;
- ``record``: the step's metrics and its lines of samples.jsonl (`StepResult` -> metrics).

Each phase takes what it needs as arguments and returns a small dataclass; nothing is shared
through the trainer's attributes. A step without an informative group (dynamic sampling) skips
the update and the weight update. The `Trainer` (`flashrl.rl.trainer`) keeps set-up, the loop and checkpoints.
"""
