"""The worker's engine: one `step()` admits waiting requests, prefills them, and runs one speculative
decoding step (draft, verify, accept) for every running sequence. It returns what each sequence emitted.

Randomness is a function of (request seed, output position, purpose) only, so a seeded request yields the
same tokens alone or in any batch (services/worker/sampling/random.py). When KV blocks run out, the scheduler
preempts sequences; one that comes back (or arrives from another worker with output already sent) recomputes
its cache up to its last token and then decodes like any other, so its output does not change.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.config import EngineConfig
from shared.frames import FinishReason
from shared.schemas import WorkRequest
from shared.tokenizer import Tokenizer
from services.worker.batch import greedy_mask, sampling_tensors, seeds_positions
from services.worker.block_manager import BlockManager, blocks_for
from services.worker.drafting.draft import Draft, stack_probs
from services.worker.model.loader import load_model
from services.worker.drafting.proposer import Proposer, build_proposer
from services.worker.runner import ModelRunner
from services.worker.scheduler import Scheduler
from services.worker.sequence import Sequence
from services.worker.drafting.adaptive import AdaptiveSpeculation, SpeculationGate
from services.worker.sampling.logprobs import token_logprobs
from services.worker.drafting.mtp import MtpDrafter
from services.worker.sampling.rejection import PAD_TOKEN, VerifyInput, verify
from services.worker.sampling.sample import process_logits, sample

log = logging.getLogger(__name__)

CALIBRATION_MAX_ROWS = 32
CALIBRATION_REPEATS = 3
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
        spec = config.speculative
        if spec.method == "mtp" and model.config.num_mtp_layers == 0:
            raise ValueError(
                f'speculative method "mtp" needs a checkpoint with MTP modules; {config.model} has none '
                "(no num_nextn_predict_layers in config.json): use method \"ngram\" or \"naive\""
            )
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            num_blocks = config.max_num_seqs * blocks_for(config.max_model_len, config.block_size)
        self.runner = ModelRunner(model, config.max_num_seqs, config.max_model_len, config.block_size, num_blocks)
        # The MTP drafter writes its cache after every trunk pass, so it exists only when it will draft.
        self.mtp = (
            MtpDrafter(self.runner, spec.num_model_steps, config.max_num_seqs)
            if spec.method == "mtp" and spec.num_drafts > 0 else None
        )
        # A step writes a sequence's drafts past its tokens, and MTP drafting its self-fed entries past those.
        lookahead = spec.num_drafts + (spec.num_model_steps if self.mtp is not None else 0)
        blocks = BlockManager(num_blocks, config.block_size, config.max_model_len)
        self.scheduler = Scheduler(config.max_num_seqs, blocks, lookahead)
        self.last_preempted: list[Sequence] = []  # sequences the last step preempted, newest first
        self.proposer: Proposer = build_proposer(spec, self.mtp)
        # Adaptive speculation trims each request's drafts when they do not pay for their share of the step.
        self.adaptive = AdaptiveSpeculation(spec.num_drafts) if spec.adaptive and spec.num_drafts > 0 else None
        self._adaptive_drafts: dict[str, int] = {}
        # The gate's decisions for this step and the next: the MTP drafter prepares the next step's drafts at the
        # end of this one, so it must know then whether they will be used.
        self._speculate = self._speculate_next = True
        # MTP drafting for a step happens at the end of the one before; its time is charged to the step it serves.
        self._drafting_seconds = self._prepared_seconds = 0.0
        self.gate = SpeculationGate() if self.adaptive is not None else None
        if self.adaptive is not None:
            self._calibrate_step_cost()
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

    @property
    def kv_usage(self) -> float:
        """Share of the KV cache's blocks held by running sequences."""
        blocks = self.scheduler.blocks
        return blocks.num_used / blocks.num_blocks

    def abort(self, request_id: str) -> Sequence | None:
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[SeqOutput]:
        self.step_no += 1
        self.stats.num_steps += 1
        self._release_finished()  # aborted since the last step: their slots go to waiting requests now
        self.last_preempted = self.scheduler.reserve()
        # Blocks just freed by preemption would only readmit what was preempted: admission waits a step.
        admitted = [] if self.last_preempted else self.scheduler.admit()
        for slot, table in self.scheduler.blocks.take_changed().items():
            self.runner.cache.set_block_table(slot, table)
        top_k = max((s.sampling.logprobs or 0 for s in self.scheduler.running), default=0)
        outputs = self._prefill(admitted, top_k) if admitted else []
        sampled = {o.seq.request_id for o in outputs}
        decoding = [s for s in self.scheduler.running if s.request_id not in sampled and not s.is_finished]
        if decoding:
            outputs += self._decode(decoding, top_k)
        self._release_finished()
        self.stats.num_emitted_tokens += sum(len(o.tokens) for o in outputs)
        return outputs

    def _calibrate_step_cost(self) -> None:
        """Times verify-shaped steps of a few sizes on the idle engine (forward pass, sampling of every scored row,
        logprobs), so that adaptive speculation starts from this device's own ratio of per-token to fixed step
        cost: compute-bound CPUs and memory-bound GPUs differ by orders of magnitude, and the steps of one steady
        batch cannot tell the two costs apart."""
        device = self.runner.device
        for num_rows in (1, min(self.config.max_num_seqs, CALIBRATION_MAX_ROWS)):
            for width in (1, 1 + self.config.speculative.num_drafts):
                n = num_rows * width
                ones = torch.ones(n, device=device)
                for _ in range(CALIBRATION_REPEATS):
                    started = time.perf_counter()
                    hidden = self.runner.forward([[0] * width] * num_rows, [0] * num_rows, list(range(num_rows)))
                    logits = self.runner.logits(hidden).reshape(n, -1)
                    probs = process_logits(logits, ones, torch.zeros(n, dtype=torch.long, device=device), ones)
                    chosen = sample(probs, torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device))
                    token_logprobs(logits, chosen, 0)[2].sum().item()  # waits for the device
                    self.adaptive.observe_step(n, time.perf_counter() - started)

    def _release_finished(self) -> None:
        for seq in self.scheduler.release_finished():
            self.proposer.on_finished(seq)
            if self.adaptive is not None:
                self.adaptive.forget(seq.request_id)
                self._adaptive_drafts.pop(seq.request_id, None)

    def _draft_budget(self, seq: Sequence, next_step: bool = False) -> int:
        """Drafts for the sequence's step (this one, or the next for the MTP drafter): at most what it may still
        emit, less the token verification adds; with adaptive speculation, what its acceptance earns at the
        current batch size, and none in a step the gate keeps to plain decoding."""
        if not (self._speculate_next if next_step else self._speculate):
            return 0
        budget = min(self.config.speculative.num_drafts, seq.max_new_tokens(self.config.max_model_len) - 1)
        return min(budget, self._adaptive_drafts.get(seq.request_id, budget))

    def _catch_up(self, seqs: list[Sequence], hidden: torch.Tensor, tokens: list[list[int]], starts: list[int]) -> None:
        """Brings the MTP drafter's cache up to the sequences' new tokens (see drafting/mtp.py); finished ones need none."""
        if self.mtp is None:
            return
        started = time.perf_counter()
        live = [b for b, s in enumerate(seqs) if not s.is_finished]
        self.mtp.catch_up(
            [seqs[b] for b in live], hidden[live], [tokens[b] for b in live], [starts[b] for b in live],
            [self._draft_budget(seqs[b], next_step=True) for b in live],
        )
        self._drafting_seconds += time.perf_counter() - started

    def _prefill(self, seqs: list[Sequence], top_k: int) -> list[SeqOutput]:
        """Computes the cache of admitted sequences. A new one gets every token cached and samples its next
        token here. One that already has output (preempted, or handed back by another worker) is recomputed up
        to its last token and emits nothing here: it decodes in this step as if it had never left, so its
        drafts and noise, and therefore its tokens, are the ones it would have had."""
        fresh = [b for b, s in enumerate(seqs) if not s.output_ids]
        tokens = [s.token_ids if not s.output_ids else s.token_ids[:-1] for s in seqs]
        hidden = self.runner.forward(tokens, [0] * len(seqs), [s.slot for s in seqs])
        for seq, row in zip(seqs, tokens):
            seq.num_computed = len(row)
        outputs = self._sample_first(seqs, fresh, hidden, [len(t) - 1 for t in tokens], top_k)
        # Trunk row j (position j) pairs with token j + 1 in the MTP module.
        self._catch_up(seqs, hidden, [s.token_ids[1:] for s in seqs], [1] * len(seqs))
        return outputs

    def _sample_first(
        self, seqs: list[Sequence], fresh: list[int], hidden: torch.Tensor, last: list[int], top_k: int
    ) -> list[SeqOutput]:
        """Samples the next token of seqs[b] for b in fresh from its trunk row last[b] of hidden [B, L, hidden]."""
        if not fresh:
            return []
        device = self.runner.device
        rows, last_rows = torch.tensor(fresh, device=device), torch.tensor([last[b] for b in fresh], device=device)
        logits = self.runner.logits(hidden[rows, last_rows])  # [len(fresh), vocab]
        seqs = [seqs[b] for b in fresh]
        probs = process_logits(logits, *sampling_tensors(seqs, device))
        seeds, positions = seeds_positions(seqs, device)
        chosen = sample(probs, seeds, positions)
        target = token_logprobs(logits, chosen, top_k)
        outputs = []
        for b, seq in enumerate(seqs):
            offset = len(seq.output_ids)
            kept = seq.append([int(chosen[b])], self.config.max_model_len)
            outputs.append(SeqOutput(seq, offset, kept, TokenLogprobs.of(tuple(a[b : b + 1] for a in target))))
        return outputs

    def _decode(self, seqs: list[Sequence], top_k: int) -> list[SeqOutput]:
        if self.adaptive is None:
            return self._speculative_step(seqs, top_k)[0]
        # The model picks each request's drafts; the gate checks, by measurement, that drafting pays at all.
        self._speculate = speculate = self._speculate_next
        self._speculate_next = self.gate.speculate(len(seqs))
        self._adaptive_drafts = self.adaptive.choose([s.request_id for s in seqs], len(seqs))
        prepared, self._drafting_seconds = self._prepared_seconds + self._drafting_seconds, 0.0
        started = time.perf_counter()
        outputs, num_batch_tokens = self._speculative_step(seqs, top_k)
        # The whole step (drafting, scoring, sampling, logprobs), with MTP drafting charged to the step it serves.
        self._prepared_seconds, self._drafting_seconds = self._drafting_seconds, 0.0
        seconds = time.perf_counter() - started - self._prepared_seconds + prepared
        self.adaptive.observe_step(num_batch_tokens, seconds)
        self.gate.observe(len(seqs), speculate, sum(len(o.tokens) for o in outputs), seconds)
        return outputs

    def _speculative_step(self, seqs: list[Sequence], top_k: int) -> tuple[list[SeqOutput], int]:
        """Draft, verify, accept for the running sequences; returns their outputs and the tokens scored."""
        device = self.runner.device
        drafts: list[Draft] = [self.proposer.propose(s, self._draft_budget(s)) for s in seqs]
        width = max(len(d.tokens) for d in drafts)
        # Verify: score the last token and every draft in one pass; row j holds p for the token at j.
        starts = [s.num_tokens for s in seqs]  # where this step's first emitted token goes
        hidden = self.runner.forward(
            [[s.output_ids[-1], *d.tokens] for s, d in zip(seqs, drafts)], [s.num_computed for s in seqs],
            [s.slot for s in seqs],
        )
        logits = self.runner.logits(hidden[:, : width + 1])  # [B, width + 1, vocab]
        batch, rows, vocab = logits.shape
        params = sampling_tensors(seqs, device, rows)
        probs = process_logits(logits.reshape(-1, vocab), *params).view(batch, rows, vocab)
        draft_tokens = torch.full((batch, width), PAD_TOKEN, dtype=torch.long)
        for b, d in enumerate(drafts):
            draft_tokens[b, : len(d.tokens)] = torch.tensor(d.tokens, dtype=torch.long)
        seeds, positions = seeds_positions(seqs, device)
        result = verify(
            VerifyInput(
                target_probs=probs,
                draft_tokens=draft_tokens.to(device),
                num_drafts=torch.tensor([len(d.tokens) for d in drafts], device=device),
                draft_probs=stack_probs(drafts, width, vocab, device),
                greedy=greedy_mask(seqs, device),
                seeds=seeds,
                positions=positions,
                top_p=params[2][::rows],
            ),
            self.config.speculative.accept_policy,
            self.config.speculative.verify_strategy,
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
            draft = drafts[b]
            out = SeqOutput(
                seq, offset, kept, target, num_accepted=min(num_accepted[b], len(kept)), draft_tokens=draft.tokens
            )
            if draft.tokens and seq.sampling.include_draft_logprobs and seq.sampling.logprobs is not None:
                out.draft = TokenLogprobs.of(draft.logprobs(top_k))
            self._count(seq, len(draft.tokens), num_accepted[b])
            outputs.append(out)
        # Verify row j (position start - 1 + j) pairs with emitted token j; a live sequence kept all it emitted.
        self._catch_up(seqs, hidden, emitted, starts)
        return outputs, sum(1 + len(d.tokens) for d in drafts)

    def _count(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        if not num_drafted:
            return
        seq.num_drafts += 1
        seq.num_draft_tokens += num_drafted
        seq.num_accepted_tokens += num_accepted
        if self.adaptive is not None:
            self.adaptive.observe(seq.request_id, num_drafted, num_accepted)
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafted
        self.stats.num_accepted_tokens += num_accepted
