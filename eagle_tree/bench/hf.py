"""Hugging Face ``generate`` observed from outside, as a :class:`GenerateOutput`.

A streamer (:class:`HFRecorder`) timestamps each ``put()`` (the first is the prompt, each later one
holds the tokens one target forward committed), and forward hooks on the target and the assistant
time their forwards and read the number of tokens each target forward verified. The first target
forward is the prefill (for assisted generation and prompt lookup it also verifies a first draft);
as in eagle-tree's loop its tokens count as output and set the time to first token, but it is not a
round. Each later forward is a round: committed = tokens streamed, accepted = committed - 1,
tree_size = draft tokens verified, verify_s = the target forward, draft_s = assistant forwards,
other_s = the rest of the time between two puts.

:func:`hf_generate_batch` is the batched baseline of the serving bench: one ``generate`` call over
left-padded prompts, observed by an :class:`HFBatchRecorder`, returned as the batched engine's
:class:`~eagle_tree.decoding.rounds.BatchOutput`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from eagle_tree.core.sampling import SamplingConfig
from eagle_tree.decoding.decoder import GenerateOutput
from eagle_tree.decoding.rounds import BatchOutput, RequestResult, RoundStats


class _ForwardClock:
    """Forward hooks on one module: seconds spent in its forwards, and the last input length."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.elapsed = 0.0
        self.last_input_len = 0
        self._t0 = 0.0
        self._handles: list = []

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.last_input_len = int(ids.shape[-1]) if ids is not None else 0
        self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        self.elapsed += time.perf_counter() - self._t0

    def attach(self) -> None:
        self._handles = [self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.module.register_forward_hook(self._post, with_kwargs=True)]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def take(self) -> float:
        elapsed, self.elapsed = self.elapsed, 0.0
        return elapsed


class HFRecorder(BaseStreamer):
    """A streamer (pass as ``streamer=``) that turns one ``generate`` call into a GenerateOutput.

    Use as a context manager around the call: it attaches the forward hooks and starts the clock.
    """

    def __init__(self, target: torch.nn.Module, assistant: torch.nn.Module | None = None):
        if assistant is target:
            raise ValueError("the assistant must be a separate model object (load it a second time)")
        self.target = _ForwardClock(target)
        self.assistant = _ForwardClock(assistant) if assistant is not None else None
        self.start = 0.0
        self.prompt_seen = False
        self.last_put = 0.0
        self.prefill_s: float | None = None
        self.rounds: list[RoundStats] = []
        self.token_times: list[float] = []
        self.tokens: list[int] = []

    def __enter__(self) -> HFRecorder:
        for clock in (self.target, self.assistant):
            if clock is not None:
                clock.attach()
        self.start = self.last_put = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        for clock in (self.target, self.assistant):
            if clock is not None:
                clock.detach()

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self.prompt_seen:  # generate streams the prompt first
            self.prompt_seen = True
            return
        new = value.reshape(-1).tolist()
        verify_s = self.target.take()
        draft_s = self.assistant.take() if self.assistant is not None else 0.0
        if self.prefill_s is None:
            self.prefill_s = now - self.start
        else:
            round_s = now - self.last_put
            other_s = max(round_s - verify_s - draft_s, 0.0)
            tree_size = max(self.target.last_input_len - 1, 0)
            self.rounds.append(RoundStats(len(new) - 1, len(new), tree_size, draft_s, verify_s, other_s))
        self.last_put = now
        self.tokens += new
        self.token_times += [now - self.start] * len(new)

    def end(self) -> None:
        pass

    def output(self, input_ids: torch.Tensor, eos: set[int], total_s: float) -> GenerateOutput:
        sequences = torch.cat([input_ids.cpu(), torch.tensor([self.tokens], dtype=torch.long)], dim=1)
        out = GenerateOutput(sequences, input_ids.shape[1], rounds=self.rounds, prefill_s=self.prefill_s or 0.0,
                             total_s=total_s, token_times=self.token_times)
        out.stopped_by = "eos" if self.tokens and self.tokens[-1] in eos else "length"
        return out


def hf_generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int = 0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    assistant=None,
    prompt_lookup_tokens: int | None = None,
) -> GenerateOutput:
    """One Hugging Face ``generate`` call (batch 1), observed by an :class:`HFRecorder`.

    Every sampling field is passed explicitly (and ``eos_token_id=None`` disables EOS), so the
    model's own generation config cannot change the settings; ``seed`` seeds the global RNG. The
    assistant drafts by its own ``generation_config`` (draft length, schedule, confidence stop), which
    HF's "heuristic" schedule updates in place after each call (BenchModels restores it per call).
    """
    input_ids = input_ids.to(model.device)
    kwargs = _generate_kwargs(max_new_tokens, sampling, eos_token_id, pad_token_id)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    if prompt_lookup_tokens is not None:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_tokens
    torch.manual_seed(seed)
    recorder = HFRecorder(model, assistant)
    with recorder:
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=recorder, **kwargs)
        if input_ids.device.type == "cuda":
            torch.cuda.synchronize(input_ids.device)
        total_s = time.perf_counter() - recorder.start
    return recorder.output(input_ids, {eos_token_id} if eos_token_id is not None else set(), total_s)


def _generate_kwargs(max_new_tokens: int, sampling: SamplingConfig, eos_token_id: int | None,
                     pad_token_id: int | None) -> dict[str, Any]:
    """Every decoding setting of a ``generate`` call, explicit, so the model's generation config changes none."""
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, num_beams=1,
                                  pad_token_id=pad_token_id if pad_token_id is not None else eos_token_id)
    if sampling.greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    return kwargs


class HFBatchRecorder(BaseStreamer):
    """A streamer for a batched ``generate`` call: the time of every decoding step and its (B,) tokens.

    ``generate`` puts the (B, T) prompt first, then after each target forward the token it chose for
    every row (pad for rows that already stopped at EOS), before its stopping check.
    """

    def __init__(self):
        self.start = time.perf_counter()
        self.prompt_seen = False
        self.steps: list[tuple[float, list[int]]] = []

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.steps.append((now - self.start, value.reshape(-1).tolist()))

    def end(self) -> None:
        pass

    def result(self, row: int, prompt: torch.Tensor, max_new_tokens: int, eos: int | None) -> RequestResult:
        """Row ``row``'s request: its tokens up to its EOS (included) or the budget, one per step."""
        tokens, times = [], []
        for t, step in self.steps[:max_new_tokens]:
            tokens.append(step[row])
            times.append(t)
            if eos is not None and step[row] == eos:
                break
        if not tokens:
            raise RuntimeError("generate streamed no token: is the streamer passed to generate?")
        sequence = torch.cat([prompt.reshape(-1).cpu(), torch.tensor(tokens, dtype=torch.long)])
        stopped = "eos" if eos is not None and tokens[-1] == eos else "length"
        return RequestResult(sequence=sequence, prompt_length=int(prompt.numel()),
                             acceptance_lengths=[1] * (len(tokens) - 1), arrival_s=0.0, admitted_s=0.0,
                             first_token_s=times[0], finish_s=times[-1], token_times=times, stopped_by=stopped)


def left_pad(prompts: list[torch.Tensor], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, longest): each 1-D prompt right-aligned after pad tokens
    (attention 0), so every row's next token follows its last prompt token in the same column."""
    width = max(int(p.numel()) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        n = int(p.numel())
        ids[i, width - n:] = p.reshape(-1)
        mask[i, width - n:] = 1
    return ids, mask


def hf_generate_batch(
    model,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int = 0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> BatchOutput:
    """One Hugging Face ``generate`` call over ``prompts`` (1-D token ids of any lengths), left-padded.

    Per-request timing comes from an :class:`HFBatchRecorder`; what it cannot see, and so what is
    approximate:

    - a token's time is when ``generate`` hands the step's tokens to the streamer: after the step's
      forward and token choice, before its stopping check, the same time for every row; the clock
      starts just before the call, so ``generate``'s own set-up counts in the first token's time, and
      the copy of the tokens to the host counts in every step;
    - the batch is static: every request arrives and is admitted at 0, and a row that stops at EOS
      keeps being computed (on pad tokens) until the last row stops; its finish time is when its own
      last token came out, so its latency does not include that tail, but the batch's ``total_s``
      (and so the throughput) does;
    - a row's ``acceptance_lengths`` is one token per step after the first (no speculation);
    - sampling: all rows draw from one global generator (``torch.manual_seed(seed)``), so a row's
      draws depend on the other rows of the batch; each row still follows the target's sampling law.

    ``pad_token_id`` (default: ``eos_token_id``, then 0) fills the left padding and the finished rows.
    """
    if not prompts:
        raise ValueError("hf_generate_batch needs at least one prompt")
    if any(p.numel() == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    pad = pad_token_id if pad_token_id is not None else eos_token_id if eos_token_id is not None else 0
    ids, mask = left_pad(prompts, pad)
    ids, mask = ids.to(model.device), mask.to(model.device)
    kwargs = _generate_kwargs(max_new_tokens, sampling, eos_token_id, pad)
    torch.manual_seed(seed)
    recorder = HFBatchRecorder()
    model.generate(ids, attention_mask=mask, streamer=recorder, **kwargs)
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    total_s = time.perf_counter() - recorder.start
    results = [recorder.result(i, p, max_new_tokens, eos_token_id) for i, p in enumerate(prompts)]
    return BatchOutput(results=results, total_s=total_s)
