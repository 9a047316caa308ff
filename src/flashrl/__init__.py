"""flashrl: fast RL for LLMs with 8-bit rollouts re-quantized online, exact logprobs and IS correction."""

__version__ = "0.1.0"
