"""DELEGATE-52 relays: one session per domain, forward edit, backward edit, forward, ...

Turn 1 applies edit 0's ``forward`` instruction to the seed document, turn 2 applies its
``backward`` instruction to the model's turn-1 output, turn 3 the ``forward`` of edit 1, and
so on. Every turn re-reads and re-emits the whole document, which is where a session-scoped
cache drafter pays off: most of what the model writes it has already seen in the prompt or
in its own previous output.

Two prompt styles. ``template`` is the benchmark's template with ``[[INPUT_CONTEXT]]`` = the
current documents as ```` ```<file_name> ```` blocks, ``[[FILE_NAMES]]`` = the files the turn
must produce and ``[[EDITING_OPERATION]]`` = the instruction. The embedded 135M model does
not follow it: it answers with unrelated code or an empty fence, or loops on one line, so
most of its relay tokens end up inside loops. ``compact`` (the
default) shows the same documents, then the instruction and "Write the complete updated
file.", and opens the assistant turn with the fence of the first file to produce
(:attr:`WorkloadRequest.prefix`), as the template itself asks answers to start; the model then
re-emits the document, which is the copy-heavy behaviour the relay is meant to measure.

The next turn's documents are the file blocks parsed from the model's output (fallback: the
whole output); an empty or garbage output keeps the previous documents and the turn records
``parse_failed``.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentspec.errors import BenchmarkError
from workflows.workloads.base import WorkloadRequest
from workflows.workloads.datasets import Domain, load_delegate52, load_prompt_template
from workflows.workloads.datasets import data_dir as resolve_data_dir

# Token estimate without a tokenizer: letters runs cost one token per 6 letters, every
# digit, punctuation mark, tab or newline one token, runs of spaces one per 16. Fitted to
# SmolLM2's tokenizer on all 38 DELEGATE-52 seeds and 146 EditEval inputs: estimate / true
# count is 0.77-1.69 (mean 1.14), where chars / 3.5 gives 0.32-1.33 and chars / 2 gives
# 0.56-2.32 (digit-heavy formats such as .sdf, .tle and .ly run at 1.5 chars/token).
_PIECE_RE = re.compile(r"[A-Za-z]+|[^A-Za-z ]| {2,}")
MIN_OUTPUT_CHARS = 16  # below this an output cannot be a document: keep the previous one
PROMPT_STYLES = ("compact", "template")

# A file name in an instruction: ``name.ext`` with a lower-case extension, not followed by
# more name characters, so Lean identifiers like ``Nat.Prime.sq_add_sq`` do not match.
_FILE_RE = re.compile(r"(?<![\w./-])([\w-]+(?:\.[\w-]+)*\.([a-z][a-z0-9]{0,9}))(?![\w-]|\.\w)")
# Extensions of the benchmark's documents and of the files its edits create; dotted code
# names in instructions (``_atom_site.label``, ``json.dump``, ``count.index``) are not files.
FILE_EXTENSIONS = frozenset(
    {
        "adi", "beancount", "bib", "c", "cif", "cir", "conllu", "css", "csd", "csv", "d2",
        "dot", "edi", "eml", "fasta", "fea", "fountain", "ged", "geojson", "h", "html", "ics",
        "js", "json", "kml", "lean", "ledger", "log", "ly", "md", "mk", "mmd", "mtl", "obj",
        "patch", "pdb", "po", "py", "qasm", "res", "sdf", "srt", "sql", "tex", "tf", "tle",
        "tsv", "ttml", "txt", "vtt", "xml", "yaml", "yml", "zone",
    }
)
_FENCE = "```"

CountTokens = Callable[[str], int]


@dataclass(frozen=True)
class FileBlock:
    """One fenced block of a model output.

    Attributes:
        name: The header after the opening fence when it names a file, else ``""``.
        content: Text between the fences.
        closed: False when the output ended inside the block (token limit reached).
    """

    name: str
    content: str
    closed: bool


def estimate_tokens(text: str) -> int:
    """Token count estimate without a tokenizer (see ``_PIECE_RE`` for the rule and its fit).

    Args:
        text: Any text.

    Returns:
        Estimated SmolLM2 tokens; usually within -25 % / +70 % of the true count.
    """
    total = 0
    for match in _PIECE_RE.finditer(text):
        piece = match.group()
        if piece[0].isalpha():
            total += math.ceil(len(piece) / 6)
        elif piece[0] == " ":
            total += math.ceil(len(piece) / 16)
        else:
            total += 1
    return total


def mentioned_files(text: str, extra_extensions: Sequence[str] = ()) -> list[str]:
    """File names an instruction mentions, in order of first mention, without repeats.

    Args:
        text: The instruction.
        extra_extensions: Extensions to accept besides :data:`FILE_EXTENSIONS` (e.g. the
            current documents' own).

    Returns:
        Names whose extension is a known document extension.
    """
    seen: dict[str, None] = {}
    for name, ext in _FILE_RE.findall(text):
        if ext in FILE_EXTENSIONS or ext in extra_extensions:
            seen.setdefault(name, None)
    return list(seen)


def expected_files(instruction: str, current: Sequence[str]) -> list[str]:
    """The files a turn must produce (a heuristic; the data has no explicit field).

    The names the instruction mentions that are not current documents are the outputs
    ("Convert ... to `ledger.csv`", "Merge ... into a single `accounting.ledger`"); when it
    mentions no new name the edit is in place and the current documents are the outputs.

    Args:
        instruction: The edit instruction.
        current: Names of the documents the turn receives.

    Returns:
        File names for ``[[FILE_NAMES]]``.
    """
    own = [name.rsplit(".", 1)[-1] for name in current if "." in name]
    new = [name for name in mentioned_files(instruction, own) if name not in current]
    return new or list(current)


def render_documents(docs: Mapping[str, str]) -> str:
    """Documents as the benchmark shows them: ```` ```<file_name>\\n...\\n``` ```` blocks."""
    return "\n\n".join(f"{_FENCE}{name}\n{text}\n{_FENCE}" for name, text in docs.items())


def parse_file_blocks(text: str) -> list[FileBlock]:
    """Split a model output into its fenced blocks.

    A line starting with ```` ``` ```` opens a block (its header is the file name when it
    contains a dot, otherwise a language tag and the block is unnamed); a line that is only
    ```` ``` ```` closes it. A block left open at the end runs to the end of the text.

    Args:
        text: The model output.

    Returns:
        The blocks in order (empty when the output has no fence).
    """
    blocks: list[FileBlock] = []
    name: str | None = None
    body: list[str] = []
    for line in text.split("\n"):
        stripped = line.strip()
        if name is None:
            if stripped.startswith(_FENCE):
                header = stripped[len(_FENCE) :].strip()
                name = header if "." in header and " " not in header else ""
                body = []
        elif stripped == _FENCE:
            blocks.append(FileBlock(name, "\n".join(body), closed=True))
            name = None
        else:
            body.append(line)
    if name is not None:
        blocks.append(FileBlock(name, "\n".join(body).rstrip(), closed=False))
    return blocks


def documents_from_output(
    output: str, expected: Sequence[str], previous: Mapping[str, str]
) -> tuple[dict[str, str], str]:
    """The documents a turn produced.

    Args:
        output: The model output.
        expected: The files the turn was asked for (names unnamed blocks in order).
        previous: The documents the turn received (kept when the output is unusable).

    Returns:
        ``(documents, status)`` where status is ``"blocks"`` (file blocks parsed),
        ``"whole_output"`` (no fence: the stripped output is the one document) or
        ``"parse_failed"`` (empty / too short: the previous documents are kept).
    """
    blocks = [b for b in parse_file_blocks(output) if b.content.strip()]
    if blocks:
        docs: dict[str, str] = {}
        spare = [n for n in expected if n not in {b.name for b in blocks}]
        for i, block in enumerate(blocks):
            name = block.name or (spare.pop(0) if spare else f"unnamed_{i + 1}.txt")
            docs[name] = block.content
        return docs, "blocks"
    stripped = output.strip()
    if len(re.sub(r"\s", "", stripped)) < MIN_OUTPUT_CHARS:
        return dict(previous), "parse_failed"
    name = expected[0] if expected else next(iter(previous), "document.txt")
    return {name: stripped}, "whole_output"


def similarity(a: Mapping[str, str], b: Mapping[str, str]) -> float:
    """difflib ratio between two document sets, line by line (file names ignored).

    Lines are the unit because a restored document is judged by which lines came back; it
    also keeps the comparison fast on long, looping outputs.
    """
    lines_a = "\n".join(a.values()).splitlines()
    lines_b = "\n".join(b.values()).splitlines()
    if not lines_a and not lines_b:
        return 1.0
    return difflib.SequenceMatcher(None, lines_a, lines_b, autojunk=False).ratio()


class RelaySession:
    """One DELEGATE-52 relay over a domain.

    Args:
        domain: The domain (seed document and edit pairs).
        template: The benchmark's prompt template.
        turns: Number of turns (forward/backward edits) to run.
        budget: Maps a turn's rendered documents to its ``max_tokens``.
        style: ``"compact"`` or ``"template"`` (see the module docstring).
    """

    def __init__(
        self,
        domain: Domain,
        template: str,
        turns: int,
        budget: Callable[[str], int],
        style: str = "compact",
    ) -> None:
        if style not in PROMPT_STYLES:
            raise BenchmarkError(
                f"relay prompt style must be one of {PROMPT_STYLES}, got {style!r}"
            )
        self.style = style
        self.domain = domain
        self.session_id = f"delegate52-{domain.domain}"
        self._template = template
        self.turns = min(turns, 2 * len(domain.edits))  # requests this session will make
        self._budget = budget
        self._docs: dict[str, str] = {domain.seed_file: domain.seed_excerpt}
        self._inputs: dict[int, dict[str, str]] = {}  # turn -> documents it received
        self._expected: dict[int, list[str]] = {}  # turn -> files it was asked for
        self._turn = 0

    def next_request(self, last_output: str | None) -> WorkloadRequest | None:
        """Chain the previous output into the next edit; ``None`` after the last turn."""
        if last_output is not None and self._turn > 0:
            self._docs, _ = documents_from_output(
                last_output, self._expected[self._turn], self._docs
            )
        if self._turn >= self.turns:
            return None
        index = self._turn
        self._turn += 1
        edit = self.domain.edits[index // 2]
        direction = "forward" if index % 2 == 0 else "backward"
        instruction = edit.forward if direction == "forward" else edit.backward
        names = expected_files(instruction, list(self._docs))
        context = render_documents(self._docs)
        prefix, stop = "", []
        if self.style == "template":
            prompt = (
                self._template.replace("[[INPUT_CONTEXT]]", context)
                .replace("[[FILE_NAMES]]", ", ".join(names))
                .replace("[[EDITING_OPERATION]]", instruction)
            )
        else:
            ask = ("Write the complete updated file." if names == list(self._docs)
                   and len(names) == 1 else f"Write the complete files: {', '.join(names)}.")
            prompt = f"{context}\n\n{instruction}\n{ask}"
            prefix = f"{_FENCE}{names[0]}\n"
            if len(names) == 1:
                stop = [f"\n{_FENCE}"]  # the closing fence ends the only document
        self._inputs[self._turn] = dict(self._docs)
        self._expected[self._turn] = names
        meta = {"domain": self.domain.domain, "edit": edit.name, "direction": direction,
                "pair": index // 2, "turn": self._turn, "files": names}
        return WorkloadRequest(
            messages=[{"role": "user", "content": prompt}],
            max_tokens=self._budget(context),
            stop=stop,
            meta=meta,
            prefix=prefix,
        )

    def turn_metrics(self, request: WorkloadRequest, output: str) -> dict[str, Any]:
        """Parse and similarity numbers of one turn.

        Returns:
            ``output_chars``, ``output_tokens_est``, ``parse`` (see
            :func:`documents_from_output`), ``file_block_parsed``, ``parse_failed``,
            ``files_out``, ``missing_files``, ``similarity_to_input`` (how much of the
            received document was re-emitted) and, on backward turns,
            ``similarity_to_original`` (how well the document before the forward edit was
            restored; 0.0 when the output could not be parsed).
        """
        turn = int(request.meta["turn"])
        received = self._inputs[turn]
        docs, status = documents_from_output(output, request.meta["files"], received)
        failed = status == "parse_failed"
        metrics: dict[str, Any] = {
            "output_chars": len(output),
            "output_tokens_est": estimate_tokens(output),
            "parse": status,
            "file_block_parsed": status == "blocks",
            "parse_failed": failed,
            "files_out": 0 if failed else len(docs),
            "missing_files": [n for n in request.meta["files"] if failed or n not in docs],
            "similarity_to_input": 0.0 if failed else round(similarity(received, docs), 4),
        }
        if request.meta["direction"] == "backward" and turn - 1 in self._inputs:
            original = self._inputs[turn - 1]
            metrics["similarity_to_original"] = (
                0.0 if failed else round(similarity(original, docs), 4)
            )
        return metrics


class Delegate52Workload:
    """DELEGATE-52 relays, one session per domain.

    Args:
        data_dir: Data folder (``None``: ``$AGENTSPEC_DATA`` or the packaged fixture).
        max_tokens: Upper bound of a turn's budget (``None``: no bound). The default, 640,
            keeps a relay bounded when a small model's looping output (fed back as the next
            document) would otherwise grow every turn's budget.
        token_factor: Budget = ``ceil(document tokens × token_factor) + 32``, at least 64,
            so the model can re-emit the whole document with some growth.
        count_tokens: Token counter (e.g. ``lambda s: len(tok.encode(s))``); defaults to
            :func:`estimate_tokens`.
        prompt_style: ``"compact"`` (default) or ``"template"`` (see the module docstring).
    """

    name = "delegate52"

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        max_tokens: int | None = 640,
        token_factor: float = 1.3,
        count_tokens: CountTokens | None = None,
        prompt_style: str = "compact",
    ) -> None:
        if prompt_style not in PROMPT_STYLES:
            raise BenchmarkError(
                f"relay prompt style must be one of {PROMPT_STYLES}, got {prompt_style!r}"
            )
        self.prompt_style = prompt_style
        folder = resolve_data_dir(data_dir)
        self.domains = load_delegate52(folder)
        self.template = load_prompt_template(folder)
        self.max_tokens = max_tokens
        self.token_factor = token_factor
        self.count_tokens: CountTokens = count_tokens or estimate_tokens

    def budget(self, context: str) -> int:
        """``max_tokens`` of a turn whose rendered documents are ``context``."""
        need = max(64, math.ceil(self.count_tokens(context) * self.token_factor) + 32)
        return need if self.max_tokens is None else min(need, self.max_tokens)

    def sessions(self, limit: int | None, turns: int) -> Iterator[RelaySession]:
        """Fresh relays (at most ``limit`` domains; at most ``turns`` turns each).

        Raises:
            BenchmarkError: ``turns`` < 1 or ``limit`` < 0.
        """
        if turns < 1 or (limit is not None and limit < 0):
            raise BenchmarkError(f"need turns >= 1 and limit >= 0, got {turns=} {limit=}")
        domains = self.domains if limit is None else self.domains[:limit]
        for domain in domains:
            yield RelaySession(domain, self.template, turns, self.budget, self.prompt_style)
