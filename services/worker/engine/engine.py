"""The worker's engine. A step reads schedule -> execute -> postprocess:

- schedule: the scheduler reserves KV blocks (preempting when short), admits waiting requests from their longest
  cached prefix and shares out the step's rows, decoding sequences first and prompt pieces after (StepPlan);
- execute: one packed forward pass computes this step's prompt pieces, and one speculative step runs for the
  decoding sequences: propose (a DraftBatch), score (the last token and the drafts in one pass), verify, accept
  (token_choice.py: the sampling and verification rules);
- postprocess: plain-Python bookkeeping appends the emitted tokens, finishes sequences and builds SeqOutputs
  (accept.py); full blocks of accepted tokens are named in the prefix cache.

Work is done only for what was asked: greedy rows draw no noise, a step without drafts skips verification,
logprobs are computed in one call for the rows of the requests that asked, and a step's results reach the host
in one copy (a prefill that scores prompts for echo or prompt_logprobs copies those scores on their own, see
prompt_logprobs.py). Randomness is a function of (request seed, output position, purpose) only, so a seeded request
yields the same tokens alone or in any batch (sampling/random.py). A sequence that comes back after preemption
(or arrives from another worker with output already sent) recomputes its cache up to its last token and then
decodes like any other, so its output does not change.
"""

from __future__ import annotations

import logging
import secrets
import time

import numpy as np
import torch

from shared.config import HIDDEN_STATE_DRAFTERS, EngineConfig
from shared.frames import FinishReason
from shared.prefix_hash import root_hash
from shared.request_limits import ModelLimits, check_work_request
from shared.schemas import WorkRequest
from shared.seeds import SEED_BITS, choice_seed
from shared.tokenizer import model_eos_ids
from services.worker.engine.accept import accept
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.handoff import export_request, read_handoff, ready_to_hand_off, write_imported
from services.worker.grammar.constrain import MAX_FORCED_DRAFTS, advance, apply_masks, constrain_drafts
from services.worker.grammar.grammars import Grammars
from services.worker.drafting.controller import SpeculationController
from services.worker.drafting.draft import DraftBatch
from services.worker.drafting.draft_model import load_draft_model
from services.worker.drafting.mtp import MtpDrafter
from services.worker.drafting.prediction import PredictedOutputs
from services.worker.drafting.proposer import NaiveProposer, Proposer, build_proposer
from services.worker.engine.host_copy import fetch
from services.worker.engine.kv_budget import planned_blocks
from services.worker.model.loader import model_revision
from services.worker.engine.outputs import EngineStats, SeqOutput, TokenLogprobs
from services.worker.engine.prompt_logprobs import PromptScores
from services.worker.tensor_parallel.leader import build_runner
from services.worker.sampling.logprobs import token_logprobs
from services.worker.sampling.penalties import LogitPenalties, apply_penalties
from services.worker.sampling.sample import process_logits, sample
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import Sequence, SeqState
from services.worker.engine.token_choice import sample_tokens, verify_drafts
from services.worker.engine.window import window_reach

__all__ = ["Engine", "EngineStats", "SeqOutput", "TokenLogprobs"]

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        num_blocks = planned_blocks(config)
        self.runner = build_runner(config, num_blocks)  # the whole model, or rank 0 of a tensor-parallel group
        model = self.runner.model
        spec = config.speculative
        if spec.method == "mtp" and model.config.num_mtp_layers == 0:
            raise ValueError(
                f'speculative method "mtp" needs a checkpoint with MTP modules; {config.model} has none '
                "(no num_nextn_predict_layers in config.json): use method \"ngram\" or \"naive\""
            )
        self.vocab_size = model.config.vocab_size
        self.limits = ModelLimits(self.vocab_size, config.max_model_len)
        # The MTP drafter (which drives an EAGLE-3 head too) writes its cache after every trunk pass, so it exists only
        # when it will draft.
        self.mtp = (
            MtpDrafter(self.runner, spec.num_drafter_steps, config.max_num_seqs)
            if spec.method in HIDDEN_STATE_DRAFTERS and spec.num_drafts > 0 else None
        )
        # A prefill worker never drafts: it loads no draft model (the decode worker's catches up on its own).
        drafting_model = spec.method == "draft_model" and config.role != "prefill"
        self.draft = load_draft_model(config, self.vocab_size, num_blocks) if drafting_model else None
        for drafter in (self.mtp, self.draft):
            if drafter is not None:
                drafter.min_confidence = spec.min_draft_confidence
        if self.mtp is not None:
            self.mtp.int8 = self.runner.drafter is not None and self.runner.drafter.quantized_layer is not None
        # A step writes a sequence's drafts past its tokens, and MTP drafting its self-fed entries past those.
        # A constrained sequence may draft the tokens its grammar forces, up to MAX_FORCED_DRAFTS, whatever the method.
        self._max_forced = MAX_FORCED_DRAFTS if spec.grammar_drafts else 0
        self._draft_room = max(spec.num_drafts, self._max_forced)
        lookahead = self._draft_room + (self.mtp.num_steps if self.mtp is not None else 0)
        # The CPU's attention reads each slot's home region in one call: a cached block found elsewhere is copied
        # there (block_manager.py).
        blocks = BlockManager(
            num_blocks, config.block_size, config.max_model_len, config.max_num_seqs,
            caching=config.enable_prefix_caching, copy_hits=self.runner.device.type == "cpu",
        )
        self.revision = model_revision(config.model, config.dtype, config.load_format)
        # MTP's and a draft model's cache entries of a prompt are written per sequence and may lag (drafting/): choices
        # of a request share prompt blocks only without them. Under a sliding window, blocks out of every cache
        # layer's reach are let go; a prefill worker keeps them all, for its handoff carries every block.
        reach = window_reach(model.config.attention_window, self.mtp, self.draft) if config.role != "prefill" else None
        self.scheduler = Scheduler(
            config.max_num_seqs, blocks, lookahead, share_prompts=self.mtp is None and self.draft is None,
            max_num_batched_tokens=config.max_num_batched_tokens if config.enable_chunked_prefill else None,
            rows_per_decode=1 + spec.num_drafts, decode=config.role != "prefill", reach=reach,
        )
        self.last_preempted: list[Sequence] = []  # sequences the last step preempted, newest first
        self.proposer: Proposer
        if self.draft is not None:
            self.proposer = self.draft
        elif spec.method == "draft_model":  # a prefill worker: it never drafts
            self.proposer = NaiveProposer()
        else:
            self.proposer = build_proposer(
                spec, self.mtp, self.runner.device, config.max_num_seqs, config.max_model_len
            )
        if spec.num_drafts > 0 and config.role != "prefill":  # a request's prediction drafts under any method
            self.proposer = PredictedOutputs(self.proposer, spec.max_ngram_size)
        self.controller = SpeculationController(spec, config.max_model_len)
        self.controller.calibrate(self._calibration_step, config.max_num_seqs)
        self.eos_token_ids = model_eos_ids(config.model)
        self._grammars: Grammars | None = None  # built at the first constrained request (grammar/grammars.py)
        self.step_no = 0
        self._top_k = 0
        self._prompt_scores = PromptScores()  # of prompts prefilled in pieces, until their first token
        self.stats = EngineStats()

    def add_request(self, request: WorkRequest, handoff: bytes | None = None) -> list[Sequence]:
        """Queues a sequence per choice to run (each choice's seed derived from the request's, shared/seeds.py);
        refuses the whole request, queueing nothing, when a choice cannot run (OutOfLimits names why). `handoff`:
        the state a prefill worker exported for the request's choices (engine/handoff.py), checked against the
        request's progress; HandoffMismatch when it does not fit, so that the caller recomputes the request."""
        check_work_request(request, self.limits)  # before any of its values reaches a tensor or a frame
        imported = {}
        if handoff is not None:
            imported = read_handoff(handoff, request.progress, self.runner, self.mtp, self.revision)
        sampling = request.sampling
        choices = request.choices()
        if sampling.seed is None:
            # The drawn seed stays with the request, so a hand-back continues every choice with the same noise.
            sampling = sampling.model_copy(update={"seed": secrets.randbits(SEED_BITS)})
            log.debug("request %s runs with seed %d", request.request_id, sampling.seed)
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_token_ids)
        root = root_hash(self.revision, request.cache_salt) if self.config.enable_prefix_caching else None
        seqs = [
            Sequence(
                request.request_id, list(request.prompt_token_ids), sampling, choice_seed(sampling.seed, choice.index),
                stop_ids, output_ids=list(choice.output_token_ids), choice=choice.index,
                target_seq_no=choice.next_seq_no, cache_root=root,
            )
            for choice in choices
        ]
        if sampling.structured is not None:
            for seq in seqs:
                self.grammars.attach(seq)  # StructuredError refuses the request before anything is queued
        for seq in seqs:
            seq.timeline.outputs_before = len(seq.output_ids)
            seq.imported = imported.get(seq.choice)
            if seq.imported is not None:
                seq.num_cached_tokens = seq.imported.meta.num_cached_tokens
                seq.draft_seq_no = seq.imported.meta.draft_seq_no
                seq.num_drafts = seq.imported.meta.num_drafts
                seq.num_draft_tokens = seq.imported.meta.num_draft_tokens
                seq.num_accepted_tokens = seq.imported.meta.num_accepted_tokens
            self.scheduler.add(seq)
        return seqs

    @property
    def kv_usage(self) -> float:
        """Share of the KV cache's blocks held by running sequences."""
        blocks = self.scheduler.blocks
        return blocks.num_used / blocks.num_blocks

    def abort(self, request_id: str, choice: int | None = None) -> list[Sequence]:
        aborted = self.scheduler.abort(request_id, choice)
        for seq in aborted:  # a waiting one (never admitted, or preempted) is never released
            if seq.slot is None:
                self._let_go(seq)
            else:
                self._prompt_scores.forget(seq)
        return aborted

    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[SeqOutput]:
        self.step_no += 1
        self.stats.num_steps += 1
        self._release_finished()  # aborted since the last step: their slots go to waiting requests now
        plan = self.scheduler.schedule()
        self.last_preempted = plan.preempted
        blocks = self.scheduler.blocks
        changed, copies = blocks.take_changed(), blocks.take_copies()
        for slot, table in changed.items():
            self.runner.cache.set_block_table(slot, table)
        self.runner.cache.copy_blocks(copies)
        if self.draft is not None:
            self.draft.mirror(changed, copies)
        for seq in plan.imports:
            write_imported(seq, seq.imported, self.runner, self.mtp)
            if self.draft is not None:  # the handoff brings the target's cache alone
                self.draft.reset(seq, seq.imported.meta.first_block * blocks.block_size)
            seq.imported = None
        # One frame holds one top-K for all its records: the most any running request asked for.
        self._top_k = max((s.sampling.logprobs or 0 for s in self.scheduler.running), default=0)
        outputs = self._prefill(plan.prefills, plan.chunks) if plan.prefills else []
        if plan.decodes:
            self.controller.begin_step(plan.decodes)
            decoded, num_scored = self._speculative_step(plan.decodes)
            self.controller.end_step(len(plan.decodes), num_scored, sum(len(o.tokens) for o in decoded))
            outputs += decoded
        self._publish(plan.prefills + plan.decodes)
        self._release_finished()
        self.stats.num_emitted_tokens += sum(len(o.tokens) for o in outputs)
        return outputs

    def _publish(self, seqs: list[Sequence]) -> None:
        """Names in the prefix cache the full blocks whose every position now holds accepted tokens, in the target's
        layers and (with MTP) the module's: positions written by rejected drafts, or that the module has not caught
        up with, never enter the cache."""
        blocks = self.scheduler.blocks
        if not blocks.caching:
            return
        size = blocks.block_size
        if self.draft is not None:
            self.draft.catch_up([s for s in seqs if s.is_finished and s.cache_root is not None])
        for seq in seqs:
            computed = min(seq.num_computed, seq.num_tokens)
            if self.mtp is not None:
                computed = min(computed, self.mtp.computed_until(seq))
            if self.draft is not None:
                computed = min(computed, self.draft.computed_until(seq))
            full = computed // size
            if full > seq.num_published and seq.cache_root is not None:
                blocks.publish(seq.slot, seq.num_published, seq.names(full, size)[seq.num_published :])
                seq.num_published = full

    def hand_off_ready(self) -> list[tuple[list[Sequence], bytes]]:
        """A prefill worker's exports: every request whose unfinished choices all have their first token, with the
        handoff's bytes, let go here (a decode worker goes on from there). Called after the step's frames are built,
        so that the record numbers exported follow the records sent."""
        handoffs = []
        if self.config.role != "prefill":
            return handoffs
        for seqs in ready_to_hand_off(self.scheduler.running + list(self.scheduler.waiting)):
            handoffs.append((seqs, export_request(seqs, self.runner, self.mtp, self.revision)))
            for seq in seqs:
                if self.mtp is not None:
                    self.mtp.forget(seq.slot)
                self.scheduler.hand_off(seq)
                self._let_go(seq)
        return handoffs

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(self.config.model, self.vocab_size, self.eos_token_ids)
            for drafter in (self.mtp, self.draft):
                if drafter is not None:
                    drafter.grammars = self._grammars  # a model drafter's q is masked too
        return self._grammars

    def _constrained(self) -> Grammars | None:
        """The grammars, when some sequence has one."""
        return self._grammars if self._grammars is not None and self._grammars.active else None

    def _release_finished(self) -> None:
        for seq in self.scheduler.release_finished():
            self._let_go(seq)

    def _let_go(self, seq: Sequence) -> None:
        """Drops what the engine's parts keep for a sequence that left (finished, aborted or handed off)."""
        if self._grammars is not None:
            self._grammars.forget(seq)
        self._prompt_scores.forget(seq)
        self.proposer.on_finished(seq)
        self.controller.forget(seq)

    def _draft_budget(self, seq: Sequence, next_step: bool = False) -> int:
        return self.controller.budget(seq, next_step)

    def _catch_up(
        self, seqs: list[Sequence], hidden: torch.Tensor, first_rows: np.ndarray, tokens: list[list[int]],
        starts: list[int], drafting: list[bool] | None = None,
    ) -> None:
        """Brings the MTP drafter's cache up to the sequences' new tokens (see drafting/mtp.py); token j of
        sequence b pairs with hidden row first_rows[b] + j. A sequence drafts for its next step unless it finished
        or drafting[b] is False (a prompt piece before its last); a finished one needs its entries only when its
        blocks go to the prefix cache (a chat's next turn resends its answer)."""
        if self.mtp is None:
            return
        started = time.perf_counter()
        caching = self.scheduler.blocks.caching
        kept = [b for b, s in enumerate(seqs) if not s.is_finished or (caching and s.cache_root is not None)]
        drafts = [not seqs[b].is_finished and (drafting is None or drafting[b]) for b in kept]
        self.mtp.catch_up(
            [seqs[b] for b in kept], hidden, [int(first_rows[b]) for b in kept], [tokens[b] for b in kept],
            [starts[b] for b in kept],
            [self._draft_budget(seqs[b], next_step=True) if d else None for b, d in zip(kept, drafts)],
        )
        self.controller.charge_drafting(time.perf_counter() - started)

    def _prefill(self, seqs: list[Sequence], chunks: list[int]) -> list[SeqOutput]:
        """Computes the next piece of each sequence's cache, chunks[b] tokens from where it stands (past a cached or
        shared prefix, or its earlier pieces), in one packed pass. A new sequence whose piece ends its prompt samples
        its next token here; one that already has output is recomputed up to its last token and emits nothing
        here. Prompt scores (echo, prompt_logprobs) are gathered piece by piece and sent with the first token."""
        starts = [s.num_computed for s in seqs]
        rows = [s.token_ids[start : start + chunk] for s, start, chunk in zip(seqs, starts, chunks)]
        scorers = [b for b, s in enumerate(seqs) if s.scores_prompt]  # read before any token is sampled
        hidden, batch = self.runner.forward(rows, starts, [s.slot for s in seqs])
        for seq, start, row in zip(seqs, starts, rows):
            seq.num_computed = start + len(row)
        completing = [b for b, s in enumerate(seqs) if not s.is_prefilling]
        new = [b for b in completing if not seqs[b].output_ids]
        fresh = [b for b in new if seqs[b].sampling.max_tokens > 0]  # these sample their first token now
        scored_only = [b for b in new if seqs[b].sampling.max_tokens == 0]  # an echoed prompt and nothing more
        if scorers:
            self._prompt_scores.gather(
                self.runner, [seqs[b] for b in scorers], hidden, batch.host_query_starts[scorers],
                [starts[b] for b in scorers], [len(rows[b]) for b in scorers],
            )
        outputs = []
        if fresh:
            last_rows = torch.from_numpy(batch.last_rows[fresh]).to(self.runner.device)
            fresh_seqs = [seqs[b] for b in fresh]
            if (grammars := self._constrained()) is not None:
                masks = grammars.masks(fresh_seqs, [[] for _ in fresh_seqs], 1)  # on the host, while the pass runs
            logits = self.runner.logits(hidden[last_rows])  # [F, vocab]
            scores = self._penalised(logits, fresh_seqs, None, 1)
            if grammars is not None:
                scores = apply_masks(scores, masks)
            chosen = sample_tokens(scores, fresh_seqs)
            outputs = accept(
                fresh_seqs, logits[:, None], chosen[:, None], None, None, self._top_k, self.config.max_model_len,
                self._count,
            )
            if grammars is not None:
                advance(grammars, outputs)
        outputs += [self._score_only(seqs[b]) for b in scored_only]
        for out in outputs:
            out.prompt = self._prompt_scores.take(out.seq)
        if self.mtp is not None:
            # The module's entries of every piece; only a last piece drafts (drafting/mtp.py, prefill_inputs).
            features = self.runner.draft_features(hidden)
            self._catch_up(
                seqs, *self.mtp.prefill_inputs(seqs, features, batch.host_query_starts, starts, rows),
                [b in completing for b in range(len(seqs))],
            )
        return outputs

    def _score_only(self, seq: Sequence) -> SeqOutput:
        """A request with max_tokens 0 (completions' echo) ends with its prefill, having emitted nothing."""
        seq.state = SeqState.FINISHED
        seq.finish_reason = FinishReason.LENGTH
        return SeqOutput(seq, len(seq.output_ids), [], TokenLogprobs.tokens_only([], self._top_k))

    def _speculative_step(self, seqs: list[Sequence]) -> tuple[list[SeqOutput], int]:
        """Propose, score, verify, accept for the running sequences; returns their outputs and the tokens scored."""
        device = self.runner.device
        proposed = self.proposer.propose_batch(seqs, [self._draft_budget(s) for s in seqs])
        grammars = self._constrained()
        if grammars is not None:
            proposed = constrain_drafts(grammars, seqs, proposed, self.config.max_model_len, self._max_forced)
        drafts = DraftBatch.build(proposed, self.vocab_size, device)
        # Score: the last token and every draft in one pass; row j of a sequence holds p for its token after j.
        starts = [s.num_tokens for s in seqs]  # where this step's first emitted token goes
        hidden, batch = self.runner.forward(
            [[s.output_ids[-1], *d.tokens] for s, d in zip(seqs, drafts.drafts)], [s.num_computed for s in seqs],
            [s.slot for s in seqs],
        )
        if grammars is not None:  # on the host, while the device runs the pass
            masks = grammars.masks(seqs, [d.tokens for d in drafts.drafts], drafts.width + 1)
        logits = self.runner.logits(hidden)  # [T, vocab]
        if drafts.width == 0:
            # Nothing to verify: plain decoding, every row emits one token.
            target = logits[:, None]
            scores = self._penalised(logits, seqs, None, 1)
            if grammars is not None:
                scores = apply_masks(scores, masks)
            output_tokens, num_accepted = sample_tokens(scores, seqs)[:, None], None
        else:
            # Row j of sequence b, or its last row past its drafts (those rows are never read as emitted).
            width = drafts.width + 1
            slots = np.minimum(np.arange(width), drafts.host_counts[:, None])
            target = logits[torch.from_numpy(batch.host_query_starts[:-1, None] + slots).to(device)]  # [B, K+1, V]
            scores = self._penalised(target.view(-1, target.shape[-1]), seqs, drafts, width)
            if grammars is not None:
                scores = apply_masks(scores, masks)
            scores = scores.view(target.shape)
            spec = self.config.speculative
            output_tokens, num_accepted = verify_drafts(scores, drafts, seqs, spec.accept_policy, spec.verify_strategy)
        outputs = accept(
            seqs, target, output_tokens, num_accepted, drafts, self._top_k, self.config.max_model_len, self._count
        )
        if grammars is not None:
            advance(grammars, outputs)  # before MTP drafts from the new state
        if self.mtp is not None:
            features = self.runner.draft_features(hidden)
            self._catch_up(seqs, features, batch.host_query_starts, [o.tokens for o in outputs], starts)
        return outputs, len(seqs) + drafts.num_tokens

    def _penalised(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: DraftBatch | None, width: int
    ) -> torch.Tensor:
        """logits [B * width, vocab] (`width` rows per sequence) under each request's penalties, logit_bias and
        min_tokens, row j counting the sequence's drafts before it as generated; the same tensor when no request
        asks. What sampling and verification read; reported logprobs stay those of the raw logits."""
        draft_tokens = [d.tokens for d in drafts.drafts] if drafts is not None else None
        return apply_penalties(logits, LogitPenalties.build(seqs, draft_tokens, width, self.vocab_size, logits.device))

    def _count(self, seq: Sequence, num_drafted: int, num_verified: int, num_kept: int) -> None:
        """The counters (metrics, acceptance length) count the accepted drafts emitted, as usage.speculative does;
        the controller learns what the verification accepted, a stop after it being no rejection."""
        if not num_drafted:
            return
        seq.num_drafts += 1
        seq.num_draft_tokens += num_drafted
        seq.num_accepted_tokens += num_kept
        self.controller.observe(seq, num_drafted, num_verified)
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafted
        self.stats.num_accepted_tokens += num_kept

    def _calibration_step(self, num_rows: int, width: int) -> None:
        """One verify-shaped step on the idle engine for the controller's timing: forward pass, sampling of every
        scored row, logprobs, and a wait for the device."""
        n = num_rows * width
        device = self.runner.device
        hidden, _ = self.runner.forward([[0] * width] * num_rows, [0] * num_rows, list(range(num_rows)))
        logits = self.runner.logits(hidden)
        ones = torch.ones(n, device=device)
        probs = process_logits(logits, ones, torch.zeros(n, dtype=torch.long, device=device), ones)
        chosen = sample(probs, torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device))
        fetch(list(token_logprobs(logits, chosen, 0)))
