"""draft_model: a second, smaller checkpoint with the target's tokenizer drafts the next tokens, each drawn from its
own distribution q under the request's sampling (draft_sampling.py), so that verification keeps its real q and
`draft_logprobs` report it.

The draft model has its own paged KV cache with the target's block ids: the engine hands it the same block tables
and block copies (`mirror`), so admission, prefix caching, preemption and freeing need no bookkeeping of its own.
What it does keep, per cache slot, is how far its cache holds the sequence's tokens (`computed_until`): a step first
catches it up with the tokens accepted since the last one (a new sequence's whole prompt, past its cached blocks) in
the same pass that drafts the first token, then drafts the rest one token per pass. Its entries at drafted
positions are overwritten by the next catch-up. A block goes to the prefix cache only once the draft model's cache
holds it too (Engine._publish), so a prefix cache hit drafts exactly as a cold prefill.

A parallel draft model (PARD: its config names a mask token, `pard_token`) drafts every token of the step in the
catch-up pass: k - 1 mask tokens follow the last token, and the row of the mask at position n + l holds the logits of
the token at n + l + 1. Each draft is drawn from its own row's q, so verification is as for chained drafts.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np
import torch

from services.worker.drafting.checkpoints import default_draft_dir
from services.worker.drafting.draft import Draft
from services.worker.drafting.draft_sampling import DraftSampler, precision_groups
from services.worker.engine.runner import ModelRunner, inference
from services.worker.engine.sequence import Sequence
from services.worker.grammar.grammars import Grammars
from services.worker.model.int8_linear import drafter_in_int8
from services.worker.model.llama import CausalLM
from services.worker.model.loader import load_model
from shared.config import EngineConfig


def load_draft_model(config: EngineConfig, target_vocab_size: int, num_blocks: int) -> "DraftModelDrafter":
    """Method draft_model's drafter: the speculative config's `model`, or the one shipped beside the target."""
    path = config.speculative.model or default_draft_dir(config.model)
    if not (Path(path) / "config.json").is_file():
        raise ValueError(
            f'speculative method "draft_model" needs a draft checkpoint: {path} has none (name one with "model" in '
            "--speculative-config)"
        )
    model = load_model(path, getattr(torch, config.dtype), config.device, config.load_format, config.max_model_len)
    drafter = DraftModelDrafter(
        model, target_vocab_size, config.max_num_seqs, config.max_model_len, config.block_size, num_blocks
    )
    if drafter_in_int8(config):
        drafter.runner.quantize_drafting(whole_model=True)
        drafter.int8 = True
    drafter.real_q = config.speculative.draft_q == "model"
    return drafter


class DraftModelDrafter:
    def __init__(
        self, model: CausalLM, target_vocab_size: int, max_num_seqs: int, max_model_len: int, block_size: int,
        num_blocks: int,
    ) -> None:
        # A parallel draft model's mask token (model/config.py, pard_token) may be the one id past the target's.
        self.pard_token = model.config.pard_token
        extra = model.config.vocab_size - target_vocab_size
        if extra > 0 and not (extra == 1 and self.pard_token == target_vocab_size):
            raise ValueError(
                f"the draft model's vocabulary ({model.config.vocab_size}) is larger than the target's "
                f"({target_vocab_size}): it must share the target's tokenizer"
            )
        self.runner = ModelRunner(model, max_num_seqs, max_model_len, block_size, num_blocks)
        self.vocab_size = target_vocab_size
        self.real_q = True  # False: drafts are verified as point masses (SpeculativeConfig.draft_q)
        self.grammars: Grammars | None = None  # set by the engine at its first constrained request
        self.min_confidence = 0.0  # a chain stops after a draft less likely than this (SpeculativeConfig)
        # Whether greedy requests' logits and chain passes go through the int8 twins (ModelRunner.quantize_drafting)
        self.int8 = False
        self._computed = [0] * max_num_seqs  # by slot: positions below this hold the sequence's tokens
        self._owner: list[tuple[str, int] | None] = [None] * max_num_seqs  # by slot: (sequence, its admission)

    def mirror(self, tables: dict[int, list[int]], copies: list[tuple[int, int]]) -> None:
        """The target cache's block-table changes and block copies of this step, applied to the draft cache."""
        for slot, table in tables.items():
            self.runner.cache.set_block_table(slot, table)
        self.runner.cache.copy_blocks(copies)

    @property
    def window(self) -> int | None:
        """The draft model's sliding window (model/config.py, attention_window); None: it attends to every position."""
        return self.runner.model.config.attention_window

    def computed_until(self, seq: Sequence) -> int:
        """Positions below this hold the sequence's tokens in the draft cache."""
        return self._computed[seq.slot] if self._owner[seq.slot] == (seq.key, seq.admission) else seq.prefill_start

    def reset(self, seq: Sequence, valid_until: int) -> None:
        """The draft cache holds the sequence's tokens below `valid_until` only (a handoff brought the target's
        cache alone)."""
        self._owner[seq.slot] = (seq.key, seq.admission)
        self._computed[seq.slot] = valid_until

    def on_finished(self, seq: Sequence) -> None:
        pass  # the next occupant of its slot starts from its own admission

    @inference
    def catch_up(self, seqs: Seq[Sequence]) -> None:
        """Writes the draft cache over each sequence's computed positions, drafting nothing: for sequences that
        finished, whose last tokens the draft model would otherwise never see, so that their blocks can go to the
        prefix cache (a chat's next turn resends the answer; a one-token request leaves its whole prompt)."""
        behind = [(s, self.computed_until(s)) for s in seqs if self.computed_until(s) < s.num_computed]
        if not behind:
            return
        self.runner.forward(
            [s.token_ids[start : s.num_computed] for s, start in behind], [start for _, start in behind],
            [s.slot for s, _ in behind],
        )
        for seq, _ in behind:
            self.reset(seq, seq.num_computed)

    @inference
    def propose_batch(self, seqs: Seq[Sequence], budgets: Seq[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        active = [b for b, budget in enumerate(budgets) if budget > 0]
        if not active:
            return drafts
        chosen_seqs = [seqs[b] for b in active]
        steps = [budgets[b] for b in active]
        starts = [min(self.computed_until(s), s.num_tokens - 1) for s in chosen_seqs]
        # Catch-up and the first draft in one pass: every token the draft cache lacks, the last one included; a
        # parallel draft model's masks after it draft the rest in the same pass (their cache entries, like drafted
        # tokens', are overwritten by the next catch-up).
        masks = [[self.pard_token] * (n - 1) if self.pard_token is not None else [] for n in steps]
        hidden, batch = self.runner.forward(
            [s.token_ids[start:] + m for s, start, m in zip(chosen_seqs, starts, masks)], starts,
            [s.slot for s in chosen_seqs],
        )
        for seq in chosen_seqs:
            self.reset(seq, seq.num_tokens)
        device = self.runner.device
        # Each sequence's drafting rows: its last token's, then its masks'
        first_rows = [int(last) - len(m) for last, m in zip(batch.last_rows, masks)]
        for group, quantized in precision_groups(chosen_seqs, list(range(len(chosen_seqs))), self.int8):
            group_steps = [steps[i] for i in group]
            if self.pard_token is None:
                rows = [first_rows[i] for i in group]
            else:
                rows = [first_rows[i] + j for i in group for j in range(steps[i])]
            picked = hidden.narrow(0, rows[0], 1) if len(rows) == 1 else hidden[torch.tensor(rows, device=device)]
            made = self._draft([chosen_seqs[i] for i in group], picked, group_steps, quantized)
            for i, draft in zip(group, made):
                drafts[active[i]] = draft
        return drafts

    def _draft(self, seqs: list[Sequence], hidden: torch.Tensor, steps: list[int], quantized: bool) -> list[Draft]:
        """Drafts steps[b] tokens for each of seqs. Autoregressive: from the draft model's hidden state at each
        sequence's last token [B, hidden], one pass a further draft; parallel: from every drafting row of the pass,
        each sequence's steps[b] rows in order [sum(steps), hidden], no further pass. quantized: the logits and the
        passes through the int8 twins. The bookkeeping between drafts is host lists: at one sequence a step's
        drafting is a few passes, and each tensor op between them costs as much as a small kernel."""
        device = self.runner.device
        sampler = DraftSampler(seqs, device, self.grammars)
        all_logits = self._logits(hidden, quantized)  # [B or sum(steps), vocab]
        parallel = self.pard_token is not None
        offsets = np.concatenate([[0], np.cumsum(steps)[:-1]]).tolist() if parallel else list(range(len(seqs)))
        if not parallel:
            logits = all_logits
        elif len(seqs) == 1:
            logits = all_logits.narrow(0, 0, 1)
        else:
            logits = all_logits[torch.tensor(offsets, device=device)]
        rows = list(range(len(seqs)))
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        reports: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(steps)):
            chosen, q, report = sampler.step(logits, torch.tensor(rows, device=device), j)
            drafted = chosen.tolist()
            for i, (row, token) in enumerate(zip(rows, drafted)):
                tokens[row].append(token)
                probs[row].append(None if q is None else q[i])
                reports[row].append(report[i])
            sure = sampler.confidence(logits, chosen) if self.min_confidence > 0 else [1.0] * len(rows)
            going = [i for i, row in enumerate(rows) if steps[row] > j + 1 and sure[i] >= self.min_confidence]
            if not going:
                break
            rows, drafted = [rows[i] for i in going], [drafted[i] for i in going]
            if parallel:
                at = [offsets[r] + j + 1 for r in rows]
                logits = all_logits.narrow(0, at[0], 1) if len(at) == 1 else all_logits[torch.tensor(at, device=device)]
                continue
            hidden, _ = self.runner.forward(
                [[t] for t in drafted], [seqs[r].num_tokens + j for r in rows], [seqs[r].slot for r in rows],
                quantized=quantized,
            )
            logits = self._logits(hidden, quantized)
        # q None: verified as point masses (greedy drafts are; draft_q "point_mass" makes every draft one)
        return [
            Draft(tokens[row], torch.stack(probs[row]) if self.real_q and probs[row][0] is not None else None,
                  torch.stack(reports[row]))
            for row in range(len(seqs))
        ]

    def _logits(self, hidden: torch.Tensor, quantized: bool) -> torch.Tensor:
        """The draft model's logits over the target's vocabulary (ids past its own get -inf; a mask token is never
        drafted)."""
        logits = self.runner.logits(hidden, quantized=quantized)  # [A, draft vocab]
        if self.pard_token is not None:
            if logits.shape[-1] > self.vocab_size:
                logits = logits.narrow(-1, 0, self.vocab_size)
            else:
                logits[:, self.pard_token] = float("-inf")
        if logits.shape[-1] == self.vocab_size:
            return logits
        padded = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        padded[:, : logits.shape[-1]] = logits
        return padded
