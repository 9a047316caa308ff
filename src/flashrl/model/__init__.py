"""The model code shared by the built-in engine, the vLLM backend and the tools.

- `config`: `ModelConfig`, read and validated from a Hugging Face ``config.json``;
- `decoder`: the decoder (`Decoder`), written for inference over a slot KV cache;
- `batch`: right-padded batches (`pad_right`) and `ForwardBatch`, where a forward's tokens sit;
- `weights`: the Hugging Face name -> decoder parameter map (`WeightMap`) and the streaming
  safetensors loader; the same map serves weight update from a trainer;
- `kv_calibration`: the fp8 KV-scale calibration rule; `kv_scales`: the scale lifecycle
  (`KVScaleState`).

It imports `flashrl.core` and `flashrl.quant`, never the engine or a backend.
"""
