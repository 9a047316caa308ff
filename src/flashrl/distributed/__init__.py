"""Scale-out of the rollout side on Ray: rollout workers, weight transports, async rollouts.

- `config`: `WorkersConfig`, the ``rollout.workers`` group of a training run and the pool's own
  config (no Ray, no torch);
- `sharding`: how one step's prompts split into shards (a function of the config, not of the
  number of workers) and the per-shard seeds that keep every request's random stream;
- `transport`: weight transfer in vLLM's phases (init once; start, update, finish per update):
  in-process, or a bucketed `torch.distributed` broadcast of the high-precision stream or of
  trainer-side quantized codes and scales;
- `delta`: the ``delta`` payload: scale hysteresis, only the changed codes on the wire, checksums
  and repairs (the trainer's mirror of what the workers store);
- `install`: the worker side of an update, writing into a built-in `Engine` in place;
- `worker`: `RolloutWorker`, one rollout backend plus its end of the transport (a Ray actor);
- `pool`: `WorkerPool`, the trainer's handle on N workers (Ray is imported lazily there);
- `rollouts`: the trainer-facing rollout source, in-process or on a pool, synchronous or one step ahead.

Ray is optional (``pip install 'flashrl[ray]'``); nothing here imports it at module level.
docs/distributed.md describes the layout and what crosses the wire.
"""
