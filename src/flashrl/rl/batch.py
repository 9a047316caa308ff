"""One rollout batch as padded tensors, and the trainer policy's logprobs of its response tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrl.core.rollout import Rollout
from flashrl.core.sampling import SamplingParams, process_logits, replay_processed_logprobs
from flashrl.model.batch import pad_right


@dataclass
class Batch:
    """Padded tensors of one rollout batch; response token t of row i sits at position
    ``prompt_lens[i] + t`` of `input_ids`."""

    input_ids: torch.Tensor  # [N, L] prompt + response, right-padded with 0
    attention_mask: torch.Tensor  # [N, L]
    prompt_lens: torch.Tensor  # [N]
    response_ids: torch.Tensor  # [N, R]
    response_mask: torch.Tensor  # [N, R] bool
    rollout_logprobs: torch.Tensor  # [N, R] fp32, 0 on padding
    advantages: torch.Tensor  # [N]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor | slice) -> Batch:
        return Batch(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))

    @classmethod
    def build(
        cls, rollouts: list[Rollout], advantages: torch.Tensor, device: torch.device
    ) -> Batch:
        """Right-pad the rollouts' sequences and responses (`flashrl.model.batch.pad_right`)."""
        sequences = pad_right([r.prompt_ids + r.response_ids for r in rollouts])
        responses = pad_right([r.response_ids for r in rollouts] + [[0]])  # at least one column
        response_ids, mask = responses.ids[:-1], responses.valid[:-1]
        mask[:, 0] &= responses.lengths[:-1] > 0
        logprobs = torch.zeros(mask.shape, dtype=torch.float32)
        logprobs[mask] = torch.tensor(
            [lp for r in rollouts for lp in r.logprobs], dtype=torch.float32
        )
        prompt_lens = torch.tensor([len(r.prompt_ids) for r in rollouts])
        return cls(
            sequences.ids.to(device),
            sequences.valid.long().to(device),
            prompt_lens.to(device),
            response_ids.to(device),
            mask.to(device),
            logprobs.to(device),
            advantages.to(device),
        )


def response_logprobs(
    model: torch.nn.Module, batch: Batch, params: SamplingParams, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Trainer logprobs [N, R] of the response tokens under the processed distribution (the
    rollout's temperature and top-k/top-p replayed), computing the LM head only at response
    positions; with `with_entropy`, also the entropy [N, R] of the processed distribution."""
    hidden = model.get_decoder()(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask
    ).last_hidden_state
    r = batch.response_ids.shape[1]
    positions = batch.prompt_lens[:, None] - 1 + torch.arange(r, device=hidden.device)
    positions = positions.clamp(max=hidden.shape[1] - 1)
    picked = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
    logits = model.get_output_embeddings()(picked).float()
    temperature = params.temperature if params.temperature > 0 else 1.0
    lp = replay_processed_logprobs(
        logits, batch.response_ids, temperature, params.top_k, params.top_p
    )
    lp = torch.where(batch.response_mask, lp, torch.zeros_like(lp))
    if not with_entropy:
        return lp, None
    with torch.no_grad():
        processed = process_logits(logits.detach(), temperature, params.top_k, params.top_p)
        logp = torch.log_softmax(processed, -1)
        entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    return lp, entropy
