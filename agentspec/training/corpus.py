"""Teacher data for distilling a drafter: token sequences plus the target's top-K
next-token distribution at every trained position.

Two sources, both cheap on a CPU:

* **Chat generations.** Seeded open-chat prompts (templates × topics, disjoint from the
  ``workflows/workloads/open_chat.py`` benchmark prompts) are answered by the target with
  batched greedy generation; a logits processor records the top-K log-probabilities of every
  generated step, so the teacher signal costs nothing beyond the generation itself. These are the
  contexts a drafter meets in practice: the target's own greedy outputs.
* **Teacher-forced documents.** Workload documents (DELEGATE-52 seed excerpts re-emitted
  after an edit instruction, EditEval code edits; handed in by the caller, the
  ``workflows`` package's ``document_pairs``: training never imports the harness) are
  rendered as a chat turn whose assistant part is the real text; one forward of the target
  gives the teacher at every assistant position.

Only the top-K (default 16) teacher log-probs are kept: full ``[T, V]`` logits would be
~200 KB per token. Position ``t`` of a sequence predicts token ``t + 1``.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from agentspec.errors import TrainingDataError

__all__ = ["DrafterData", "TeacherSeq", "teacher_force", "teacher_generate", "training_prompts"]

_TOPICS = (
    "the moon", "volcanoes", "the internet", "bicycles", "coffee", "the Roman Empire",
    "machine learning", "gardening", "chess", "the ocean", "recycling", "electric cars",
    "the human heart", "honeybees", "jazz music", "the Eiffel Tower", "rainbows",
    "earthquakes", "vaccines", "the stock market", "friendship", "exercise",
    "the solar system", "dinosaurs", "baking bread", "the printing press", "penguins",
    "mountains", "libraries", "time management", "public speaking", "green tea",
    "the Great Wall of China", "robots", "clouds", "cats", "dogs", "the piano", "soccer",
    "the French Revolution", "DNA", "black holes", "renewable energy", "deserts", "rivers",
    "budgeting", "the Olympic Games", "origami", "pizza", "meditation", "trains",
    "airplanes", "the water cycle", "Shakespeare", "algebra", "the brain", "rainforests",
    "snow", "coral reefs", "the telephone", "Python programming", "databases",
    "a healthy breakfast", "camping", "museums", "magnets", "bridges", "spiders",
)
_TEMPLATES = (
    "What is {t}?", "Explain {t} in simple terms.", "Give me three facts about {t}.",
    "Write a short paragraph about {t}.", "What are the pros and cons of {t}?",
    "How does {t} work?", "Write a short poem about {t}.",
    "Summarize the history of {t} in a few sentences.", "List five words related to {t}.",
    "Why is {t} important?", "Write a short story that involves {t}.",
    "Give a beginner one tip about {t}.",
)
_CODE_TASKS = (
    "reverses a string", "checks whether a number is even", "computes the factorial of n",
    "counts the vowels in a word", "returns the largest number in a list",
    "merges two dictionaries", "sorts a list of names alphabetically",
    "converts Celsius to Fahrenheit", "removes duplicates from a list",
    "checks whether a word is a palindrome",
)
_PHRASES = ("thank you very much", "where is the train station?", "I love reading books",
            "see you tomorrow", "the weather is nice today")
_LANGUAGES = ("French", "German", "Italian", "Portuguese")


class DrafterData(Protocol):
    """The workload data ``train-drafter`` learns from (the ``workflows`` package's, handed in
    by the console script: training never imports the benchmark harness)."""

    def folder(self, explicit: str | os.PathLike[str] | None) -> Path:
        """The data folder: ``explicit`` (``--data``) when given, else the default one."""
        ...

    def documents(self, folder: Path, seed: int) -> list[tuple[str, str]]:
        """(user message, assistant text) pairs to teacher-force, shuffled by ``seed``."""
        ...

    def held_out_prompts(self) -> list[str]:
        """Benchmark prompts the drafter must never train on."""
        ...


@dataclass(frozen=True)
class TeacherSeq:
    """One training sequence and the target's top-K distribution over a span of it.

    Attributes:
        tokens: Token ids ``[T]``.
        start: First position with a teacher signal; positions ``start .. start+S-1``.
        top_ids: Teacher's top-K token ids ``[S, K]`` (position ``start+s`` predicts
            token ``start+s+1``).
        top_logp: Their log-probabilities ``[S, K]`` (fp16).
    """

    tokens: torch.Tensor
    start: int
    top_ids: torch.Tensor
    top_logp: torch.Tensor

    def __post_init__(self) -> None:
        span = int(self.top_ids.shape[0])
        if span < 1 or self.start < 0 or self.start + span > int(self.tokens.shape[0]):
            raise TrainingDataError(
                f"teacher span [{self.start}, {self.start + span}) does not fit a "
                f"{int(self.tokens.shape[0])}-token sequence"
            )


def training_prompts(count: int, seed: int = 0, exclude: Sequence[str] = ()) -> list[str]:
    """``count`` seeded open-chat prompts (templates × topics, code, translation, arithmetic).

    ``exclude`` (e.g. the benchmark's prompts) never appear, so held-out numbers stay honest.
    """
    rng = random.Random(seed)
    pool = [tpl.format(t=t) for tpl in _TEMPLATES for t in _TOPICS]
    pool += [f"Write a Python function that {task}." for task in _CODE_TASKS]
    pool += [f"Translate '{p}' into {lang}." for p in _PHRASES for lang in _LANGUAGES]
    pool += [f"What is {a} times {b}? Show your work." for a, b in
             ((12, 14), (23, 7), (45, 3), (16, 16), (9, 31), (120, 5))]
    banned = {e.strip().lower() for e in exclude}
    pool = [p for p in pool if p.lower() not in banned]
    rng.shuffle(pool)
    return pool[:count]


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-softmax of ``[.., V]`` logits: ids (int32) and log-probs (fp16)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [.., V]
    val, idx = logp.topk(k, dim=-1)  # [.., k]
    return idx.to(torch.int32), val.to(torch.float16)


class _Deadline:
    """A stopping criterion: end generation (all rows) once ``deadline`` has passed."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        late = self.deadline is not None and time.monotonic() > self.deadline
        return torch.full((input_ids.shape[0],), late, dtype=torch.bool)  # [B]


class _Recorder:
    """A logits processor that records the top-K of every generation step."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps.append(_topk(scores, self.k))  # ([B, K], [B, K])
        return scores


def _render(tokenizer: Any, user: str) -> list[int]:
    from agentspec.chat.templates import render_prompt

    return render_prompt(tokenizer, [{"role": "user", "content": user}])


def teacher_generate(
    model: Any, tokenizer: Any, prompts: Sequence[str], *, top_k: int = 16,
    max_new_tokens: int = 128, batch_size: int = 16, deadline: float | None = None,
    tick: Callable[[int], None] | None = None,
) -> list[TeacherSeq]:
    """Answer ``prompts`` with the target's batched greedy decoding, recording its top-K.

    Stops once ``time.monotonic()`` passes ``deadline`` (answers cut there still count).
    """
    from transformers import LogitsProcessorList, StoppingCriteriaList

    eos = int(tokenizer.eos_token_id)
    encoded = sorted((_render(tokenizer, p) for p in prompts), key=len)  # less padding
    out: list[TeacherSeq] = []
    for b0 in range(0, len(encoded), batch_size):
        if deadline is not None and time.monotonic() > deadline:
            break
        batch = encoded[b0 : b0 + batch_size]
        width = max(map(len, batch))
        # Left padding: every row's last prompt token sits at column width-1.
        ids = torch.tensor([[eos] * (width - len(r)) + r for r in batch])  # [B, P]
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch])  # [B, P]
        rec = _Recorder(top_k)
        with torch.inference_mode():
            seqs = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False,
                max_new_tokens=max_new_tokens, pad_token_id=eos, eos_token_id=eos,
                logits_processor=LogitsProcessorList([rec]),
                stopping_criteria=StoppingCriteriaList([_Deadline(deadline)]),
            )
        gen = seqs[:, width:]  # [B, S]
        top_i = torch.stack([s[0] for s in rec.steps], dim=1)  # [B, S, K]
        top_v = torch.stack([s[1] for s in rec.steps], dim=1)  # [B, S, K]
        for j, prompt in enumerate(batch):
            row = gen[j].tolist()
            n = row.index(eos) + 1 if eos in row else len(row)  # keep the EOS: it is drafted too
            tokens = torch.tensor(prompt + row[:n])
            out.append(TeacherSeq(tokens, len(prompt) - 1, top_i[j, :n], top_v[j, :n]))
        if tick is not None:
            tick(len(batch))
    return out


def teacher_force(
    model: Any, tokenizer: Any, pairs: Sequence[tuple[str, str]], *, top_k: int = 16,
    max_len: int = 384, deadline: float | None = None,
    tick: Callable[[int], None] | None = None,
) -> list[TeacherSeq]:
    """Score (user, assistant) pairs with one target forward each; teacher on the answer."""
    out: list[TeacherSeq] = []
    for user, answer in pairs:
        eos = int(tokenizer.eos_token_id)
        if deadline is not None and time.monotonic() > deadline:
            break
        prompt = _render(tokenizer, user)[-(max_len // 2) :]  # keep the prompt's tail
        reply = [*tokenizer.encode(answer, add_special_tokens=False), eos]
        tokens = (prompt + reply)[:max_len]
        start = len(prompt) - 1
        span = len(tokens) - 1 - start  # positions start .. T-2 predict a known token
        if span >= 1:
            ids = torch.tensor([tokens])  # [1, T]
            with torch.inference_mode():
                hidden = model.model(input_ids=ids).last_hidden_state[0]  # [T, H]
                logits = model.lm_head(hidden[start : start + span])  # [S, V]
            top_i, top_v = _topk(logits, top_k)
            out.append(TeacherSeq(torch.tensor(tokens), start, top_i, top_v))
        if tick is not None:
            tick(1)
    return out
