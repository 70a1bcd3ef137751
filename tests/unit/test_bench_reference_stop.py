"""The benchmark's transformers reference stops where the engine does: on stop strings
inside the generated text only."""

from __future__ import annotations

from typing import Any

import torch

from workflows.bench.methods import GeneratedStop


class Chars:
    """A tokenizer whose ids are code points."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_a_stop_string_across_the_prompt_end_does_not_stop() -> None:
    """The prompt opens a fence and ends in a newline; a first token of three backticks
    completes "\\n```" only together with the prompt: generation goes on (transformers'
    own stop_strings stopped there, one token into the answer)."""
    prompt = ids("```notes.txt\n")
    crit: Any = GeneratedStop(len(prompt), ["\n```"], Chars())
    rows = torch.tensor([prompt + ids("```..."), prompt + ids("ab\n```")])
    assert crit(rows, None).tolist() == [False, True]
    assert crit(torch.tensor([prompt + ids("ab")]), None).tolist() == [False]
