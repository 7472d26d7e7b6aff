"""The choices of one response: one request through the mesh per prompt (a completions prompt list can hold
several), each request with the response's n choices.

Choices are numbered prompt-major, as OpenAI does: choice i of prompt p is choice p * n + i. Usage adds up the
requests' own (each counts its prompt once and the tokens of all its choices, as OpenAI counts them). With
return_token_ids a completions choice carries its prompt's ids (`prompt_token_ids`): streamed, on its first chunk.
"""

from __future__ import annotations

from collections import defaultdict

from services.detokenizer.speculation import SpeculationTally
from services.gateway.aggregate import Api, merge_choices
from shared.schemas import Chunk, PromptTokensDetails, Usage


class ResponseChoices:
    def __init__(
        self, api: Api, request_ids: list[str], prompts: list[list[int]], n: int, return_token_ids: bool
    ) -> None:
        self._api = api
        self._first_index = {request_id: p * n for p, request_id in enumerate(request_ids)}
        self._prompt_of = dict(zip(request_ids, prompts))
        self._request_of = [request_id for request_id in request_ids for _ in range(n)]  # by choice index
        self.num_choices = len(request_ids) * n
        self._num_prompt_tokens = sum(map(len, prompts))
        self._num_completion_tokens = 0
        self._usages: list[Usage] = []
        self._prompt_ids_on_choices = return_token_ids and api == "completion"
        self._started: set[int] = set()  # choices whose first chunk was streamed
        self._kept: dict[int, list[Chunk]] = defaultdict(list)  # a whole response's chunks, by choice

    def index(self, chunk: Chunk) -> int:
        return self._first_index[chunk.request_id] + chunk.choice["index"]

    def observe(self, chunk: Chunk) -> None:
        """Counts the chunk's tokens, and takes its request's usage when it is the request's last."""
        self._num_completion_tokens += chunk.num_tokens
        if chunk.final and chunk.usage is not None:
            self._usages.append(chunk.usage)

    def streamed(self, chunk: Chunk) -> dict:
        """The chunk's choice as the response streams it."""
        index = self.index(chunk)
        choice = {**chunk.choice, "index": index}
        if self._prompt_ids_on_choices and index not in self._started:
            choice["prompt_token_ids"] = self._prompt_of[chunk.request_id]
        self._started.add(index)
        return choice

    def keep(self, chunk: Chunk) -> None:
        self._kept[self.index(chunk)].append(chunk)

    def merged(self, with_logprobs: bool, with_draft_logprobs: bool) -> list[dict]:
        """Every choice in the non-streaming shape, from the chunks kept."""
        choices = []
        for index in range(self.num_choices):
            choice = merge_choices(self._api, self._kept[index], with_logprobs, with_draft_logprobs, index)
            if self._prompt_ids_on_choices:
                choice["prompt_token_ids"] = self._prompt_of[self._request_of[index]]
            choices.append(choice)
        return choices

    def running_usage(self) -> Usage:
        """The usage so far: every prompt, and the tokens streamed until now."""
        prompt, completion = self._num_prompt_tokens, self._num_completion_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def usage(self) -> Usage:
        """The usage of the whole response, once every request has ended."""
        if len(self._usages) == 1:
            return self._usages[0]
        prompt = sum(u.prompt_tokens for u in self._usages)
        completion = sum(u.completion_tokens for u in self._usages)
        cached = sum(u.prompt_tokens_details.cached_tokens for u in self._usages)
        summaries = [u.speculative for u in self._usages if u.speculative is not None]
        speculative = SpeculationTally.merged(map(SpeculationTally.of, summaries)).usage() if summaries else None
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached), speculative=speculative,
        )
