"""The worker's engine: one `step()` admits waiting requests, prefills them, and runs one speculative
decoding step (draft, verify, accept) for every running sequence. It returns what each sequence emitted.

Randomness is a function of (request seed, output position, purpose) only, so a seeded request yields the
same tokens alone or in any batch (services/worker/spec/random.py).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.config import EngineConfig
from shared.frames import FinishReason
from shared.schemas import WorkRequest
from shared.tokenizer import Tokenizer
from services.worker.model.loader import load_model
from services.worker.proposer import Proposer, build_proposer
from services.worker.runner import ModelRunner
from services.worker.scheduler import Scheduler
from services.worker.sequence import Sequence
from services.worker.spec.logprobs import point_mass_logprobs, token_logprobs
from services.worker.spec.rejection import PAD_TOKEN, VerifyInput, verify
from services.worker.spec.sampling import process_logits, sample

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TokenLogprobs:
    """Frame-ready arrays for n tokens: ids and logprobs [n, top_k + 1] (slot 0 = the token), ranks [n]."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray

    @classmethod
    def of(cls, arrays: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> "TokenLogprobs":
        return cls(*(a.cpu().numpy() for a in arrays))


@dataclass
class SeqOutput:
    """What one sequence produced in one step."""

    seq: Sequence
    offset: int  # output index of the first emitted token
    tokens: list[int]
    target: TokenLogprobs
    num_accepted: int = 0
    draft_tokens: list[int] = field(default_factory=list)
    draft: TokenLogprobs | None = None  # only when the request asked for draft logprobs

    @property
    def finish_reason(self) -> FinishReason:
        return self.seq.finish_reason


@dataclass
class EngineStats:
    """Speculation counters in the vocabulary of vLLM's metrics: acceptance length = 1 + accepted / drafts."""

    num_steps: int = 0
    num_emitted_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model = load_model(config.model, _DTYPES[config.dtype], config.device)
        self.runner = ModelRunner(model, config.max_num_seqs, config.max_model_len)
        self.scheduler = Scheduler(config.max_num_seqs)
        self.proposer: Proposer = build_proposer(config.speculative)
        self.eos_token_ids = Tokenizer(config.model).eos_token_ids
        self.step_no = 0
        self.stats = EngineStats()

    def add_request(self, request: WorkRequest) -> Sequence:
        sampling = request.sampling
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        if num_tokens >= self.config.max_model_len:
            raise ValueError(f"{num_tokens} tokens leave no room in max_model_len {self.config.max_model_len}")
        if len(request.output_token_ids) >= sampling.max_tokens:
            raise ValueError(f"{len(request.output_token_ids)} tokens already reach max_tokens {sampling.max_tokens}")
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        if sampling.seed is None:
            log.debug("request %s runs with seed %d", request.request_id, seed)
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_token_ids)
        seq = Sequence(
            request.request_id, list(request.prompt_token_ids), sampling, seed, stop_ids,
            output_ids=list(request.output_token_ids),
        )
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[SeqOutput]:
        self.step_no += 1
        self.stats.num_steps += 1
        self.scheduler.release_finished()  # aborted since the last step: their slots go to waiting requests now
        admitted = self.scheduler.admit()
        decoding = [s for s in self.scheduler.running if s not in admitted and not s.is_finished]
        top_k = max((s.sampling.logprobs or 0 for s in self.scheduler.running), default=0)
        outputs = self._prefill(admitted, top_k) if admitted else []
        if decoding:
            outputs += self._decode(decoding, top_k)
        self.scheduler.release_finished()
        self.stats.num_emitted_tokens += sum(len(o.tokens) for o in outputs)
        return outputs

    def _sampling_tensors(self, seqs: list[Sequence], rows: int) -> tuple[torch.Tensor, ...]:
        """Per-row temperature, top_k, top_p for `rows` consecutive rows of each sequence."""
        device = self.runner.device
        temp = torch.tensor([s.sampling.temperature for s in seqs], device=device).repeat_interleave(rows)
        top_k = torch.tensor([s.sampling.top_k for s in seqs], device=device).repeat_interleave(rows)
        top_p = torch.tensor([s.sampling.top_p for s in seqs], device=device).repeat_interleave(rows)
        return temp, top_k, top_p

    def _prefill(self, seqs: list[Sequence], top_k: int) -> list[SeqOutput]:
        """Computes the cache for every known token and samples each sequence's next token."""
        tokens = [s.token_ids for s in seqs]
        hidden = self.runner.forward(tokens, [0] * len(seqs), [s.slot for s in seqs])
        last = torch.tensor([len(t) - 1 for t in tokens], device=self.runner.device)
        logits = self.runner.logits(hidden[torch.arange(len(seqs)), last])  # [B, vocab]
        probs = process_logits(logits, *self._sampling_tensors(seqs, 1))
        seeds, positions = self._seeds_positions(seqs)
        chosen = sample(probs, seeds, positions)
        target = token_logprobs(logits, chosen, top_k)
        outputs = []
        for b, seq in enumerate(seqs):
            seq.num_computed = seq.num_tokens
            offset = len(seq.output_ids)
            kept = seq.append([int(chosen[b])], self.config.max_model_len)
            outputs.append(SeqOutput(seq, offset, kept, TokenLogprobs.of(tuple(a[b : b + 1] for a in target))))
        return outputs

    def _seeds_positions(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.runner.device
        seeds = torch.tensor([s.seed for s in seqs], dtype=torch.long, device=device)
        positions = torch.tensor([len(s.output_ids) for s in seqs], dtype=torch.long, device=device)
        return seeds, positions

    def _decode(self, seqs: list[Sequence], top_k: int) -> list[SeqOutput]:
        # Draft: at most what the sequence may still emit, less the token verification always adds.
        max_drafts = self.config.speculative.num_drafts
        drafts = [
            self.proposer.propose(s, min(max_drafts, s.max_new_tokens(self.config.max_model_len) - 1)) for s in seqs
        ]
        width = max(len(d) for d in drafts)
        # Verify: score the last token and every draft in one pass; row j holds p for the token at j.
        hidden = self.runner.forward(
            [[s.output_ids[-1], *d] for s, d in zip(seqs, drafts)], [s.num_computed for s in seqs], [s.slot for s in seqs]
        )
        logits = self.runner.logits(hidden[:, : width + 1])  # [B, width + 1, vocab]
        batch, rows, vocab = logits.shape
        probs = process_logits(logits.reshape(-1, vocab), *self._sampling_tensors(seqs, rows)).view(batch, rows, vocab)
        draft_tokens = torch.full((batch, width), PAD_TOKEN, dtype=torch.long)
        for b, d in enumerate(drafts):
            draft_tokens[b, : len(d)] = torch.tensor(d, dtype=torch.long)
        seeds, positions = self._seeds_positions(seqs)
        device = self.runner.device
        result = verify(
            VerifyInput(
                target_probs=probs,
                draft_tokens=draft_tokens.to(device),
                num_drafts=torch.tensor([len(d) for d in drafts], device=device),
                draft_probs=None,  # ngram proposals are point masses: q(x) = 1
                greedy=torch.tensor([s.sampling.greedy for s in seqs], device=device),
                seeds=seeds,
                positions=positions,
            ),
            self.config.speculative.accept_policy,
        )
        # Accept: keep accepted drafts plus the recovered or bonus token, and rewind the cache past rejections.
        num_accepted = result.num_accepted.tolist()
        emitted = [result.output_tokens[b, : num_accepted[b] + 1].tolist() for b in range(batch)]
        outputs = []
        for b, seq in enumerate(seqs):
            seq.num_computed = seq.num_tokens + num_accepted[b]
            offset = len(seq.output_ids)
            kept = seq.append(emitted[b], self.config.max_model_len)
            rows_b = logits[b, : len(kept)]
            target = TokenLogprobs.of(token_logprobs(rows_b, torch.tensor(kept, device=device), top_k))
            out = SeqOutput(seq, offset, kept, target, num_accepted=min(num_accepted[b], len(kept)), draft_tokens=drafts[b])
            if drafts[b] and seq.sampling.include_draft_logprobs and seq.sampling.logprobs is not None:
                out.draft = TokenLogprobs.of(point_mass_logprobs(torch.tensor(drafts[b]), top_k))
            self._count(seq, len(drafts[b]), num_accepted[b])
            outputs.append(out)
        return outputs

    def _count(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        if not num_drafted:
            return
        seq.num_drafts += 1
        seq.num_draft_tokens += num_drafted
        seq.num_accepted_tokens += num_accepted
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafted
        self.stats.num_accepted_tokens += num_accepted
